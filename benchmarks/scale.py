"""Store traffic of checkpoint coordination against the number of ranks (issue 55).

N simulated ranks, each a thread of this process with its own client of one real TCPStore
(hosted by a child process, as rank 0's process hosts a job's), run the real coordination
code of slipstream's checkpoints on tiny layouts: the layout exchange of a first save, the
commit round of every save, a second saver of the same layout (a new ``Checkpointer``), the
load agreement of ``ss.load`` and of ``Checkpointer.load``, and an idle second with every
channel open. Every ``torch.distributed.Store`` call made from Python is counted (the
methods of ``TCPStore`` and ``PrefixStore`` patched at class level) and charged to the
rank whose thread made it; the calls of the process's own heartbeat and watch thread are
counted apart, as background traffic. Reported per op: the median and the largest count of
the ranks other than the coordinator (rank 0), the coordinator's count, and the wall time
from the start of the op on every rank to its end on the last.

    python benchmarks/scale.py --out benchmarks/results/scale.json
    python benchmarks/scale.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Result, Table  # noqa: E402

from slipstream.checkpoint.agreement import agreement_for  # noqa: E402
from slipstream.checkpoint.save import channel as channel_module  # noqa: E402
from slipstream.checkpoint.save import saver as saver_module  # noqa: E402
from slipstream.checkpoint.save.channel import RankChannel  # noqa: E402
from slipstream.checkpoint.save.layout import LocalLayout, local_layout  # noqa: E402
from slipstream.checkpoint.save.messages import CommitOutcome, Topics, WriteReport  # noqa: E402
from slipstream.core.waits import Deadline  # noqa: E402

STORE_METHODS = (
    "add",
    "append",
    "check",
    "compare_set",
    "delete_key",
    "get",
    "multi_get",
    "multi_set",
    "num_keys",
    "set",
    "wait",
)

_who = threading.local()


class CallCounter:
    """Counts every Python call of ``STORE_METHODS`` on ``TCPStore`` and ``PrefixStore``
    (patched at class level, so clones and prefix stores are counted alike), by the rank
    label of the calling thread (``None``: a background thread)."""

    def __init__(self) -> None:
        self.counts: Counter[int | None] = Counter()
        self._lock = threading.Lock()
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> CallCounter:
        for cls in (dist.TCPStore, dist.PrefixStore):
            for name in STORE_METHODS:
                original = getattr(cls, name)
                self._saved.append((cls, name, original))
                setattr(cls, name, self._wrap(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def counted(store: Any, *args: Any, **kwargs: Any) -> Any:
            rank = getattr(_who, "rank", None)
            with counter._lock:
                counter.counts[rank] += 1
            return original(store, *args, **kwargs)

        return counted

    def take(self) -> Counter[int | None]:
        with self._lock:
            taken, self.counts = self.counts, Counter()
        return taken


def start_store_host() -> tuple[subprocess.Popen[str], int]:
    """A child process hosting a TCPStore server (its sockets count against its own file
    limit, not this process's); returns it and the port it listens on."""
    code = (
        "import sys, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    host = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert host.stdout is not None
    return host, int(host.stdout.readline())


def rank_layout(rank: int) -> LocalLayout:
    """A tiny state: one tensor every rank holds, one of its own, one plain value."""
    return local_layout({"shared": torch.zeros(4), f"own{rank}": torch.zeros(2), "step": 1})


TIMEOUT_S = 120.0


@dataclass
class RankState:
    """One simulated rank: its channel (a saver's), its layout, its save count."""

    channel: RankChannel
    layout: LocalLayout
    store: dist.Store
    namespace: str
    seq: int = 0
    channels: int = 1

    def close(self) -> None:
        self.channel.close()


def _plan(state: RankState) -> Any:
    """The layout exchange of a first save, as the saver runs it."""
    seq = state.seq
    make = getattr(saver_module, "plan_for", None)
    if make is not None:
        return make(state.channel, state.layout, seq, "scale", Deadline(TIMEOUT_S))
    holder = type("Holder", (), {"channel": state.channel, "plans_made": 0})()
    return saver_module.CheckpointSaver._make_plan(
        holder, state.layout, seq, "scale", Deadline(TIMEOUT_S)
    )


def _commit_round(state: RankState, fingerprint: str) -> None:
    """A save's commit round without the storage: every rank posts its write report, rank 0
    gathers them and posts the outcome, every rank waits for it; rank 0 forgets the
    round's keys as the saver does."""
    ch, seq = state.channel, state.seq
    ch.post(Topics.written(seq), WriteReport(fingerprint))
    deadline = Deadline(TIMEOUT_S)
    if ch.rank == 0:
        collect = getattr(ch, "collect", None) or ch.gather
        collect(Topics.written(seq), WriteReport.from_json, deadline, "finish writing")
        ch.post(Topics.commit(seq), CommitOutcome(save_id=f"save-{seq}"))
        forget = getattr(saver_module, "forget_round", None)
        if forget is not None:
            forget(ch, seq)
        else:
            ch.forget(Topics.written(seq))
            if seq > 0:
                ch.forget(Topics.commit(seq - 1), [0])
                ch.forget(Topics.layout(seq - 1))
    outcome = ch.receive(Topics.commit(seq), CommitOutcome.from_json, 0, deadline, "commit")
    assert outcome.error is None, outcome.error
    state.seq += 1


def first_save(state: RankState) -> None:
    plan = _plan(state)
    _commit_round(state, plan.fingerprints[plan.rank])


def steady_save(state: RankState) -> None:
    _commit_round(state, state.layout.fingerprint())


def new_saver_first_save(state: RankState) -> None:
    """A new ``Checkpointer`` beside the first saver: a channel of its own, then its first
    save of the layout the first saver planned already."""
    state.channels += 1
    old = state.channel
    state.channel = RankChannel(
        state.store, old.rank, old.world_size, f"{state.namespace}/{state.channels}"
    )
    state.seq = 0
    old.close()
    first_save(state)


def plain_load(state: RankState) -> None:
    agreement_for(state.channel).run("load", lambda: None, TIMEOUT_S)


def checkpointer_load(state: RankState) -> None:
    """``Checkpointer.load`` without a step: the newest step agreed, then the load."""
    agreement = agreement_for(state.channel)
    agree = getattr(agreement, "newest_then", None)
    if agree is not None:
        agree("load", lambda: 7, lambda step: step, TIMEOUT_S)
        return
    newest = agreement.values("listing", lambda: 7, TIMEOUT_S)
    step = min(newest)
    agreement.run("load", lambda: step, TIMEOUT_S)


OPS: dict[str, Callable[[RankState], None]] = {
    "ss.save (first)": first_save,
    "ss.save (steady)": steady_save,
    "Checkpointer.save (first)": new_saver_first_save,
    "ss.load": plain_load,
    "Checkpointer.load": checkpointer_load,
}


@dataclass
class OpFigures:
    op: str
    ranks: int
    median_rank: float
    max_rank: int
    coordinator: int
    wall_s: float


def run_ranks(
    states: Sequence[RankState], counter: CallCounter, work: Callable[[RankState], None]
) -> tuple[Counter[int | None], float]:
    """``work(state)`` on one thread per rank, all started together; returns the calls
    counted meanwhile and the wall time from the start to the last rank's end."""
    start = threading.Barrier(len(states) + 1)
    errors: list[BaseException] = []

    def body(state: RankState) -> None:
        _who.rank = state.channel.rank
        start.wait()
        try:
            work(state)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(s,)) for s in states]
    for t in threads:
        t.start()
    counter.take()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"{len(errors)} rank(s) failed, the first: {errors[0]!r}")
    return counter.take(), wall


def figures(op: str, n: int, counts: Counter[int | None], wall: float) -> OpFigures:
    others = [counts.get(r, 0) for r in range(1, n)]
    return OpFigures(op, n, float(statistics.median(others)), max(others), counts.get(0, 0), wall)


def measure(
    n: int, port: int, counter: CallCounter, idle_s: float
) -> tuple[list[OpFigures], float]:
    """Every op of :data:`OPS` at ``n`` ranks, then the idle traffic (calls per rank per
    second of the background threads)."""
    clients: list[dist.Store] = []
    states: list[RankState] = []
    for _ in range(n):
        tcp = dist.TCPStore("127.0.0.1", port, n, False, wait_for_workers=False)
        store = dist.PrefixStore(f"scale/{n}", tcp)
        clients.append(store)
    made: list[RankState | None] = [None] * n

    def make(state_rank: int) -> None:
        _who.rank = state_rank
        namespace = f"scale/{n}"
        channel = RankChannel(clients[state_rank], state_rank, n, namespace)
        made[state_rank] = RankState(
            channel, rank_layout(state_rank), clients[state_rank], namespace
        )

    threads = [threading.Thread(target=make, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    states = [s for s in made if s is not None]
    assert len(states) == n
    results = []
    try:
        for op, work in OPS.items():
            counts, wall = run_ranks(states, counter, work)
            results.append(figures(op, n, counts, wall))
            print(
                f"N={n:5d} {op:28s} rank median {results[-1].median_rank:6.1f} "
                f"max {results[-1].max_rank:6d} coordinator {results[-1].coordinator:7d} "
                f"wall {wall:7.3f} s",
                flush=True,
            )
        counter.take()
        time.sleep(idle_s)
        idle = counter.take()
        per_rank_s = sum(idle.values()) / n / idle_s
        print(f"N={n:5d} idle: {per_rank_s:.2f} calls per rank per second", flush=True)
    finally:
        for s in states:
            s.close()
    return results, per_rank_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 1024, 4096])
    parser.add_argument("--quick", action="store_true", help="N = 2 and 16 only")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle measured")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ranks = [2, 16] if args.quick else args.ranks
    threading.stack_size(256 * 1024)
    host, port = start_store_host()
    rows: list[OpFigures] = []
    idle: dict[int, float] = {}
    try:
        with CallCounter() as counter:
            for n in ranks:
                found, idle[n] = measure(n, port, counter, args.idle)
                rows.extend(found)
    finally:
        assert host.stdin is not None
        host.stdin.close()
        host.wait(30)
    table = Table(
        "store calls per op and wall time against the number of ranks",
        ["op", "ranks", "median rank > 0", "max rank > 0", "coordinator", "wall s"],
    )
    for f in rows:
        table.rows.append(
            [f.op, f.ranks, f.median_rank, f.max_rank, f.coordinator, round(f.wall_s, 3)]
        )
    idle_table = Table("idle traffic, every channel open", ["ranks", "calls per rank per second"])
    for n, v in idle.items():
        idle_table.rows.append([n, round(v, 2)])
    if args.out:
        result = Result(
            benchmark="scale",
            title="Checkpoint coordination's store traffic against the number of ranks",
            command="python benchmarks/scale.py " + " ".join(sys.argv[1:]),
            setup={"ranks": ranks, "beat_s": channel_module.BEAT_SECONDS},
            tables=[table, idle_table],
        )
        result.write(args.out)


if __name__ == "__main__":
    main()
