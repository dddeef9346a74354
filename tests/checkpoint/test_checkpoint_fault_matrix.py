"""Every collective checkpoint entry point fails on every rank when it fails on one
(issue 47): a fault injected on one rank of 2 and of 4 (a storage error, a flipped byte, a
missing file) gives every surviving rank an error naming the failing rank and its cause
within :data:`~fault_cases.AGREED_WITHIN_S`, through the control plane (no collective
times out), and the ranks save and load again afterwards. A SIGKILL, the fourth fault, is
:mod:`test_checkpoint_kill_matrix`'s.

Process starts dominate the cost, so each world size spawns its ranks once and loops over
every (entry point, fault) case inside them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import pytest
import torch.distributed as dist
from dist_utils import run_workers
from fault_cases import (
    InjectedError,
    async_save,
    checkpointer_load,
    dcp_load,
    dcp_save,
    expect_agreed_failure,
    prepare_step_dir,
    save_and_load_again,
    ss_load,
    ss_save,
    tiered_latest,
    tiered_load,
)
from fault_storage import FaultStorage

from slipstream.checkpoint import api
from slipstream.checkpoint.format.names import SPARE_DIR
from slipstream.checkpoint.storage import resolve_storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _data_file(root: str, rank: int) -> str:
    return os.path.join(root, f"__{rank}_0.distcp")


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- faults: each prepares the victim's view of a saved checkpoint at ``root`` ------------


def _storage_error(operation: str) -> Callable[[str, int, int], tuple[object, str]]:
    def inject(root: str, rank: int, victim: int) -> tuple[object, str]:
        if rank != victim:
            return root, ""
        storage = FaultStorage(resolve_storage(root, spare_dir_name=SPARE_DIR))
        storage.faults.fail(operation, InjectedError(f"injected {operation} failure"))
        return storage, f"injected {operation} failure"

    return inject


def _checksum(root: str, rank: int, victim: int) -> tuple[object, str]:
    if rank == victim and os.path.exists(_data_file(root, victim)):
        _flip_byte(_data_file(root, victim))
    return root, "CorruptCheckpointError"


def _missing(root: str, rank: int, victim: int) -> tuple[object, str]:
    if rank == victim and os.path.exists(_data_file(root, victim)):
        os.remove(_data_file(root, victim))
    return root, f"__{victim}_0.distcp"


def _staging_fault(rank: int, victim: int) -> None:
    """The victim's shared saver fails its next save's staging."""
    saver = api._savers[tuple(range(dist.get_world_size()))]

    def fail() -> None:
        saver.before_staging = None
        raise InjectedError("injected staging failure")

    if rank == victim:
        saver.before_staging = fail


LOADS = {
    "ss.load": ss_load,
    "slipstream.dcp.load": dcp_load,
    "Checkpointer.load": checkpointer_load,
}
LOAD_FAULTS = {
    "storage error": _storage_error("read"),
    "checksum": _checksum,
    "missing file": _missing,
}
SAVES = {
    "ss.save": ss_save,
    "slipstream.dcp.save": dcp_save,
    "ss.async_save (upload)": async_save,
}


def _move_fault_into_step(step_root: str, fault: str, rank: int, victim: int) -> None:
    """For a Checkpointer given the root: a file fault goes into its step's directory."""
    if fault == "checksum":
        _checksum(os.path.join(step_root, "step_1"), rank, victim)
    elif fault == "missing file":
        _missing(os.path.join(step_root, "step_1"), rank, victim)


def _matrix(rank: int, world: int, base: str) -> None:
    victim = world - 1
    number = 0
    for entry, run in LOADS.items():
        for fault, inject in LOAD_FAULTS.items():
            number += 1
            step_root = prepare_step_dir(os.path.join(base, f"case{number}"))
            dist.barrier()
            if entry == "Checkpointer.load":  # the fault in its step, it given the root
                target, cause = inject(step_root, rank, victim)
                _move_fault_into_step(step_root, fault, rank, victim)
                where: object = step_root if isinstance(target, str) else target
            else:
                where, cause = inject(os.path.join(step_root, "step_1"), rank, victim)
            expect_agreed_failure(
                f"{entry} with a {fault}", partial(run, where, rank), victim, cause or "injected"
            )
            save_and_load_again(base, f"{number}", rank)
    for entry, run in SAVES.items():
        number += 1
        where, cause = _storage_error("finish")(os.path.join(base, f"save{number}"), rank, victim)
        expect_agreed_failure(
            f"{entry} with a storage error", partial(run, where, rank), victim, "injected"
        )
        save_and_load_again(base, f"{number}", rank)
    number += 1
    _staging_fault(rank, victim)
    expect_agreed_failure(
        "ss.async_save (staging) with a staging failure",
        partial(async_save, os.path.join(base, f"save{number}"), rank),
        victim,
        "injected staging failure",
    )
    save_and_load_again(base, f"{number}", rank)
    # with a local tier: a durable step's checksum, and a rank that cannot list the steps
    number += 1
    step_root = prepare_step_dir(os.path.join(base, f"case{number}"))
    dist.barrier()
    _checksum(os.path.join(step_root, "step_1"), rank, victim)
    expect_agreed_failure(
        "Checkpointer.load (local tier) with a checksum",
        partial(tiered_load, step_root, step_root + "-tier", rank),
        victim,
        "CorruptCheckpointError",
    )
    number += 1
    step_root = prepare_step_dir(os.path.join(base, f"case{number}"))
    where = step_root
    if rank == victim:
        where = FaultStorage(resolve_storage(step_root, spare_dir_name=SPARE_DIR))
        where.faults.fail("list", InjectedError("injected list failure"))  # type: ignore[attr-defined]
    expect_agreed_failure(
        "Checkpointer.latest (local tier) with a storage error",
        partial(tiered_latest, where, step_root + "-tier", rank),
        victim,
        "injected list failure",
    )
    save_and_load_again(base, f"{number}", rank)


@pytest.mark.parametrize("world", [2, 4])
def test_a_fault_on_one_rank_fails_every_entry_point_on_every_rank(tmp_path, world):
    run_workers(_matrix, world, str(tmp_path), timeout=300)
