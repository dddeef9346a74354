"""The local tier's commits against its deletions, under contention: 50 rounds of local
saves on 4 gloo ranks standing in for 2 nodes of 2, each save clearing before it and
retention deleting after each commit (``keep_last=1``), some saves left replicating while
the next one clears, some interrupted by a load (which discards the steps past the one it
loaded), the nodes' marker writes and every rank's replication slowed by seeded random
delays (a busy tmpfs, a busy core).

What must hold in every round: every save commits (none fails because its directory was
deleted under it); a save that resolved on a rank is committed on that rank's node (its
marker is in place); a load in the middle of a save loads that save's step, equal to the
state saved; and at the end each node holds exactly the last step, equal to the reference.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from dist_utils import run_workers
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint.storage import LocalStorage

WORLD = 4
RANKS_PER_NODE = 2
ROUNDS = 50
TIMEOUT = 30.0
MARKER = ".local_commit"
SEED = 37


def node_dir(base: str, rank: int) -> str:
    return os.path.join(base, f"node{rank // RANKS_PER_NODE}")


def state_of(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {f"rank{rank}": torch.randn(4096, generator=g), "shared": torch.full((64,), step)}


def template(rank: int) -> dict:
    return {f"rank{rank}": torch.zeros(4096), "shared": torch.zeros(64, dtype=torch.long)}


def assert_state(got: dict, rank: int, step: int) -> None:
    want = state_of(rank, step)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), (rank, step, key)


def plan() -> list[str]:
    """Each round's kind, the same on every rank (every rank calls save and load together)."""
    rng = random.Random(SEED)
    return [rng.choice(["wait", "wait", "pipeline", "load"]) for _ in range(ROUNDS)]


def _stress(rank: int, world: int, base: str) -> None:
    delays = random.Random(SEED * 100 + rank)
    root = FaultStorage(LocalStorage(node_dir(base, rank), direct_io=False))
    # a slow marker write: the window in which a deletion could cut it short
    root.faults.hook(
        "put", lambda *a: time.sleep(delays.uniform(0, 0.02)), when=lambda name: name == MARKER
    )
    tier = ss.LocalTier(root=root, ranks_per_node=RANKS_PER_NODE, keep_last=1, every=1)
    responses = []
    with ss.Checkpointer(
        os.path.join(base, "durable"), timeout=TIMEOUT, local_tier=tier, durable_every=10**6
    ) as ck:
        assert ck.local_tier is not None
        ck.local_tier.before_replication = lambda step: time.sleep(delays.uniform(0, 0.01))
        for step, kind in enumerate(plan(), start=1):
            response = ck.save(step, state_of(rank, step))
            responses.append((step, response))
            if kind == "wait":
                response.result(TIMEOUT)
                marker = os.path.join(node_dir(base, rank), f"step_{step}", MARKER)
                assert os.path.exists(marker), f"rank {rank}: step {step} resolved unmarked"
            elif kind == "pipeline":  # the next save clears while this one replicates
                response.staging_completion.result(TIMEOUT)
            else:  # a load while the save is in flight: retention and the discard run
                probe = template(rank)
                assert ck.load(probe, strict=False) == step
                assert ck.last_load_tier == "local"
                assert_state(probe, rank, step)
        ck.wait(TIMEOUT)
        for step, response in responses:
            error = response.upload_completion.exception(TIMEOUT)
            assert error is None, f"rank {rank}: the local save of step {step} failed: {error!r}"
        final = template(rank)
        assert ck.load(final, strict=False) == ROUNDS
        assert_state(final, rank, ROUNDS)


@pytest.mark.timeout(300)  # 50 rounds of 4 processes on contended cores
def test_local_saves_clears_retention_and_loads_race_without_losing_a_commit(tmp_path):
    base = str(tmp_path)
    run_workers(_stress, WORLD, base, timeout=240)
    for node in (0, 1):
        listed = sorted(n for n in os.listdir(os.path.join(base, f"node{node}")) if n[0] != ".")
        assert listed == [f"step_{ROUNDS}"], listed
