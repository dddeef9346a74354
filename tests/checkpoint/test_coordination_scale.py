"""Checkpoint coordination's store traffic stays flat as ranks are added (issue 55).

64 simulated ranks (threads of this process, each with its own client of one real TCPStore
hosted by a child process: ``benchmarks/scale.py``'s harness) run the real coordination
code of the first and steady save, a second saver of the same layout, ``ss.load``'s rounds
and ``Checkpointer.load``'s (its step agreed, then ``ss.load``'s rounds); every
``torch.distributed.Store`` call is counted by patching ``TCPStore`` and ``PrefixStore`` at
class level. The same ops at 2 ranks are the
reference: the median rank other than the coordinator may make at most 1.5x as many calls
at 64 ranks, and at most 20; the coordinator at most 8N + 20. Counts, not times. The same
harness shows that a failure on one rank, and a rank that falls silent, still end the
exchange on every rank, naming it."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from scale import OPS, CallCounter, Ranks, RankState, measure, store_host  # noqa: E402

from slipstream.checkpoint.save.channel import LIVENESS_CHECK_SECONDS, SILENT_AFTER_SECONDS
from slipstream.checkpoint.save.messages import LayoutDescription, LayoutReport, Topics
from slipstream.checkpoint.save.saver import exchange_plan
from slipstream.core.waits import Deadline
from slipstream.errors import CheckpointError, PeerDiedError

N = 64
IDLE_S = 2.5


@pytest.fixture(scope="module")
def store_port():
    with store_host() as port:
        yield port


def _op_counts(n: int, port: int) -> tuple[dict[str, tuple[float, int]], float]:
    """Each op's (median calls of the ranks other than 0, rank 0's calls) at ``n`` ranks,
    and the background calls per rank per second while every channel is open and idle."""
    found: dict[str, tuple[float, int]] = {}
    with CallCounter() as counter:
        ranks = Ranks(n, port)
        try:
            for op, work in OPS.items():
                counts, _ = ranks.run(counter, work)
                others = sorted(counts.get(r, 0) for r in range(1, n))
                found[op] = (float(others[len(others) // 2]), counts.get(0, 0))
            counter.take()
            time.sleep(IDLE_S)
            idle = sum(counter.take().values()) / n / IDLE_S
        finally:
            ranks.run(counter, None)
    return found, idle


def test_store_calls_per_rank_do_not_grow_with_the_ranks(store_port):
    small, _ = _op_counts(2, store_port)
    large, idle = _op_counts(N, store_port)
    for op, (median, coordinator) in large.items():
        assert median <= 20, f"{op}: the median rank made {median} store calls at {N} ranks"
        assert median <= 1.5 * small[op][0], (
            f"{op}: the median rank made {median} store calls at {N} ranks, {small[op][0]} at 2"
        )
        assert coordinator <= 8 * N + 20, f"{op}: rank 0 made {coordinator} calls at {N} ranks"
    # one beat per rank per second, and a beat more in the window at most
    assert idle <= 1.0 + 1.0 / IDLE_S, f"{idle:.2f} calls per rank per second while idle"


def test_ranks_spread_over_processes_make_the_calls_of_ranks_in_one(store_port):
    """The benchmark's wall times come from ranks spread over forked processes (rank 0
    alone): each op's counts there are those of the same ranks as threads of one process."""
    together, _ = _op_counts(16, store_port)
    spread, idle = measure(16, store_port, 4, 0.005, IDLE_S)
    assert {f.op for f in spread} == set(together)
    for f in spread:
        median, coordinator = together[f.op]
        assert (f.median_rank, f.coordinator) == (median, coordinator), (f, together[f.op])
    assert idle <= 1.0 + 1.0 / IDLE_S, f"{idle:.2f} calls per rank per second while idle"


def _layout_error_on_rank_5(state: RankState) -> None:
    channel = state.channel
    topic = Topics.layout(state.seq)
    if channel.rank == 5:
        channel.post(topic, LayoutReport(error="its state dict could not be flattened"))
        return
    with pytest.raises(CheckpointError, match=r"rank 5: its state dict could not be flattened"):
        exchange_plan(channel, state.layout, state.seq, "scale-test", Deadline(60))


def test_a_rank_that_fails_fails_the_exchange_on_every_rank(store_port):
    with CallCounter() as counter:
        ranks = Ranks(16, store_port)
        try:
            ranks.run(counter, _layout_error_on_rank_5)  # raises if any rank did not raise
        finally:
            ranks.run(counter, None)


def _rank_9_falls_silent(state: RankState) -> None:
    channel = state.channel
    if channel.rank == 9:
        channel.close()  # its process stops beating, and never posts its layout
        return
    started = time.monotonic()
    report = LayoutReport(state.layout.fingerprint(), LayoutDescription.of(state.layout))
    with pytest.raises(PeerDiedError) as info:
        channel.exchange(
            Topics.layout(state.seq),
            report,
            LayoutReport.from_json,
            lambda reports: [""] * len(reports),
            Deadline(120),
            "send their layout",
            per_rank=True,
        )
    waited = time.monotonic() - started
    assert info.value.ranks == [9] and "rank(s) [9] died" in str(info.value), info.value
    assert waited < 2 * (SILENT_AFTER_SECONDS + 2 * LIVENESS_CHECK_SECONDS + 1), waited


def test_a_silent_rank_is_named_by_every_rank(store_port):
    with CallCounter() as counter:
        ranks = Ranks(16, store_port)
        try:
            ranks.run(counter, _rank_9_falls_silent)
        finally:
            ranks.run(counter, None)
