"""Ranks agree on what a collective load loads, not only on whether it failed: a
``Checkpointer.load`` without a step loads the same step on every rank, even when one rank
lists the committed steps differently (a lagging listing, another copy of the root)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

import slipstream as ss
from slipstream.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(rank: int, step: int) -> dict:
    return {f"own{rank}": torch.full((64,), float(step)), "step": step}


def _blank(rank: int) -> dict:
    return {f"own{rank}": torch.zeros(64), "step": -1}


def _tier(base: str, rank: int, local: bool) -> ss.LocalTier | None:
    """A local tier that takes no step of these tests (``every=100``), or none."""
    if not local:
        return None
    return ss.LocalTier(root=os.path.join(base, f"local{rank}"), every=100, replicas=0)


def _saved_steps_then_a_lagging_copy(rank: int, world: int, base: str, local: bool) -> None:
    full, lagging = os.path.join(base, "full"), os.path.join(base, "lagging")
    with ss.Checkpointer(full) as ck:
        for step in (1, 2):
            ck.save(step, _state(rank, step)).result(60)
        dist.barrier()
        if rank == 0:
            shutil.copytree(full, lagging)  # sees steps 1 and 2 only
        dist.barrier()
        ck.save(3, _state(rank, 3)).result(60)
    got = _blank(rank)
    root = lagging if rank == world - 1 else full
    with ss.Checkpointer(root, local_tier=_tier(base, rank, local)) as ck:
        loaded = ck.load(got, strict=False)
    assert loaded == 2, f"rank {rank} loaded step {loaded}"
    assert got["step"] == 2 and torch.equal(got[f"own{rank}"], torch.full((64,), 2.0))


def _one_rank_sees_no_checkpoint(rank: int, world: int, base: str) -> None:
    full, empty = os.path.join(base, "full"), os.path.join(base, "empty")
    os.makedirs(empty, exist_ok=True)
    with ss.Checkpointer(full) as ck:
        ck.save(1, _state(rank, 1)).result(60)
    with ss.Checkpointer(empty if rank == world - 1 else full) as ck:
        with pytest.raises(
            CheckpointError, match=rf"no committed checkpoint.*rank\(s\) \[{world - 1}\]"
        ):
            ck.load(_blank(rank), strict=False)


@pytest.mark.parametrize("local", [False, True], ids=["durable", "with_a_local_tier"])
def test_a_load_without_a_step_loads_the_newest_step_every_rank_sees(tmp_path, local):
    run_workers(_saved_steps_then_a_lagging_copy, 2, str(tmp_path), local)


def test_a_rank_that_sees_no_checkpoint_fails_the_load_on_every_rank(tmp_path):
    run_workers(_one_rank_sees_no_checkpoint, 2, str(tmp_path))
