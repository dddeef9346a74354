"""A publish round's store traffic stays flat as rollouts are added (issue 55).

64 simulated ranks of one sync group (threads of this process, each with its own client of
one real TCPStore hosted by a child process: ``benchmarks/scale_sync.py``'s harness) run the
real round code of a publish: trainers 0 and 1 start and finish the round, 62 rollouts ask
for it, wait for its start and acknowledge it; every ``torch.distributed.Store`` call is
counted by patching ``TCPStore`` and ``PrefixStore`` at class level. The same rounds at 2
ranks (one trainer, one rollout) are the reference: the median rank other than the lead
may make at most 1.5x as many calls at 64 ranks, and at most 20; the lead at most 8N + 20.
Counts, not times. Every rollout is recorded by both trainers as holding the version."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

from scale_sync import OPS, SyncRanks  # noqa: E402
from store_calls import CallCounter, store_host  # noqa: E402

N = 64


@pytest.fixture(scope="module")
def store_port():
    with store_host() as port:
        yield port


def _op_counts(n: int, port: int) -> dict[str, tuple[float, int]]:
    """Each op's (median calls of the ranks other than the lead, the lead's) at ``n`` ranks;
    checks that the trainers saw every rollout take each version."""
    found: dict[str, tuple[float, int]] = {}
    with CallCounter() as counter:
        ranks = SyncRanks(n, port)
        try:
            for version, (op, work) in enumerate(OPS.items(), 1):
                counts, _ = ranks.run(counter, work)
                others = sorted(counts.get(r, 0) for r in range(1, n))
                found[op] = (float(others[len(others) // 2]), counts.get(0, 0))
                for state in ranks.states:
                    assert state is not None
                    if state.trainer is not None:
                        held = state.trainer.rollout_versions.snapshot()
                        assert held == {r: version for r in ranks.rollouts}, (op, held)
        finally:
            ranks.run(counter, None)
    return found


def test_store_calls_of_a_publish_round_do_not_grow_with_the_rollouts(store_port):
    small = _op_counts(2, store_port)
    large = _op_counts(N, store_port)
    for op, (median, lead) in large.items():
        assert median <= 20, f"{op}: the median rank made {median} store calls at {N} ranks"
        assert median <= 1.5 * small[op][0], (
            f"{op}: the median rank made {median} store calls at {N} ranks, {small[op][0]} at 2"
        )
        assert lead <= 8 * N + 20, f"{op}: the lead trainer made {lead} calls at {N} ranks"
