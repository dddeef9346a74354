"""A failed save lets go of everything it holds (its staging buffer above all) before its
error reaches the caller, so the very next save of the same state works.

Each failure point that the fault-storage tests inject is hit in a loop: the failed save
raises, the next save of the same state succeeds at once, reuses the staging buffer
(nothing is still holding it, nothing is allocated anew), and loads back exactly.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable

import pytest
import torch
from checkpoint_states import small_state
from dist_utils import run_workers
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver
from slipstream.checkpoint.format.names import METADATA_FILE
from slipstream.checkpoint.storage import LocalStorage, Storage, resolve_storage

ROUNDS = 12


def _assert_loads_exactly(location: object) -> None:
    got = {"model": {"w": torch.zeros(96, 64), "b": torch.zeros(7)}, "step": -1}
    ss.load(got, location)
    want = small_state()
    assert got["step"] == want["step"]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


def _eio(operation: str) -> Callable[..., None]:
    def fail(target: object, name: str, *args: object) -> None:
        raise ss.CheckpointError(f"{operation} of {name} failed: {os.strerror(errno.EIO)}")

    return fail


STORAGE_POINTS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "prepare": ("prepare", lambda name: True),
    "open": ("open", lambda name: True),
    "write": ("write", lambda name: True),
    "append": ("append", lambda name: True),
    "finish": ("finish", lambda name: True),
    "put-index": ("put", lambda name: name.startswith(".slipstream")),
    "put-metadata": ("put", lambda name: name == METADATA_FILE),
    "get-committed": ("get", lambda name: name == METADATA_FILE),
}
"""Every storage operation a save makes, failed where the fault-storage tests fail it."""


def _storage(backend: str, tmp_path) -> Storage:
    if backend == "local":
        return LocalStorage(tmp_path / "ck")
    return resolve_storage(f"memory://release-{uuid.uuid4().hex[:8]}/ck")


@pytest.mark.parametrize("backend", ["local", "memory"])
@pytest.mark.parametrize("point", [*STORAGE_POINTS, "staging"])
def test_the_save_after_a_failed_one_works_and_loads_exactly(tmp_path, backend, point):
    storage = FaultStorage(_storage(backend, tmp_path))
    saver = CheckpointSaver()
    try:
        saver.save(small_state(), storage).result(30)  # a committed checkpoint to save over
        for _ in range(ROUNDS):
            if point == "staging":
                saver.before_staging = _raise_in_staging
            else:
                operation, when = STORAGE_POINTS[point]
                storage.faults.hook(operation, _eio(operation), when=when)
            with pytest.raises(ss.CheckpointError, match="failed"):
                saver.save(small_state(), storage).result(30)
            storage.faults.clear()
            saver.before_staging = None
            saver.save(small_state(), storage).result(30)
            _assert_loads_exactly(storage)
        assert saver.staging_allocations == 1, "a failed save kept its staging buffer"
        assert saver.plans_made == 1
    finally:
        saver.close()


def _raise_in_staging() -> None:
    raise RuntimeError("staging failed")


def test_a_save_whose_directory_cannot_be_made_never_blocks_the_next_one(tmp_path):
    """The reported case, through the public ``ss.save``: a regular file where the
    checkpoint's parent directory should be; the same state saved elsewhere right after."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    state = small_state()
    for i in range(100):
        with pytest.raises(ss.CheckpointError):
            ss.save(state, blocker / "ck")
        ss.save(state, tmp_path / f"ck{i % 2}")
    _assert_loads_exactly(tmp_path / "ck0")
    _assert_loads_exactly(tmp_path / "ck1")


def _one_rank_fails_then_both_save(rank: int, world: int, root: str) -> None:
    """Rank 1's save fails at ``point`` (rank 0's fails with it, at the commit); the next
    save of the same state, on both ranks, commits and loads exactly, round after round."""
    directory = os.path.join(root, "ck")
    state = {"w": torch.zeros(4096), f"own{rank}": torch.arange(5.0) + rank}
    storage = FaultStorage(LocalStorage(directory))
    saver = CheckpointSaver()
    try:
        for round_ in range(4):
            point = ("prepare", "write", "staging", "finish")[round_]
            if rank == 1:
                if point == "staging":
                    saver.before_staging = _raise_in_staging
                else:
                    storage.faults.hook(point, _eio(point))
            with pytest.raises(ss.CheckpointError, match="failed"):
                saver.save(state, storage).result(60)
            storage.faults.clear()
            saver.before_staging = None
            state["w"].add_(1)
            saver.save(state, storage).result(60)
            got = {"w": torch.zeros(4096), "own0": torch.zeros(5), "own1": torch.zeros(5)}
            ss.load(got, directory, strict=True)
            assert torch.equal(got[f"own{rank}"], state[f"own{rank}"]), (rank, round_)
            assert torch.equal(got["w"], torch.full((4096,), float(round_ + 1))), (rank, round_)
        assert saver.staging_allocations == 1 and saver.plans_made == 1, rank
    finally:
        saver.close()


def test_a_save_that_failed_on_one_rank_leaves_every_rank_ready_for_the_next(tmp_path):
    run_workers(_one_rank_fails_then_both_save, 2, str(tmp_path), timeout=120)
