"""Every collective checkpoint entry point fails on every rank when it fails on one
(issue 47): a fault injected on one rank of 2 and of 4 (a storage error, a flipped byte, a
missing file, a SIGKILL) gives every surviving rank an error naming the failing rank and
its cause within :data:`AGREED_WITHIN_S`, through the control plane (no collective times
out), and the ranks can save and load again afterwards.

Process starts dominate the cost, so each world size spawns its ranks once and loops over
every (entry point, fault) case inside them; the SIGKILL comes last (the killed rank cannot
come back), after which the survivors form a fresh process group and save and load in it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, run_workers
from fault_storage import FaultStorage

import slipstream as ss
import slipstream.dcp as ss_dcp
from slipstream.checkpoint import api
from slipstream.checkpoint.format.names import SPARE_DIR
from slipstream.checkpoint.storage import resolve_storage

AGREED_WITHIN_S = 10.0
"""Every surviving rank must have its error this soon after the fault."""
TIMEOUT = 120.0
"""The saves' and loads' timeout: far above AGREED_WITHIN_S, so only agreement (or the
heartbeat, for a killed rank) can end the waits in time."""

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(rank: int, value: float) -> dict:
    return {f"own{rank}": torch.full((256,), value), "step": int(value)}


def _blank(rank: int) -> dict:
    return {f"own{rank}": torch.zeros(256), "step": -1}


def _data_file(root: str, rank: int) -> str:
    return os.path.join(root, f"__{rank}_0.distcp")


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


class InjectedError(OSError):
    """The storage error a case injects (its text is the cause every rank must name)."""


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


# -- entry points: each runs on every rank against a location a fault prepared ------------


def _ss_load(where: object, rank: int) -> None:
    ss.load(_blank(rank), where, strict=False)


def _dcp_load(where: object, rank: int) -> None:
    ss_dcp.load(_blank(rank), checkpoint_id=where)


def _ss_save(where: object, rank: int) -> None:
    ss.save(_state(rank, 7.0), where, timeout=TIMEOUT)


def _dcp_save(where: object, rank: int) -> None:
    ss_dcp.save(_state(rank, 7.0), checkpoint_id=where, timeout=TIMEOUT)


def _async_save_upload(where: object, rank: int) -> None:
    response = ss.async_save(_state(rank, 7.0), where, timeout=TIMEOUT)
    response.staging_completion.result(TIMEOUT)
    response.result(TIMEOUT)


def _checkpointer_load(where: object, rank: int) -> None:
    with ss.Checkpointer(where, timeout=TIMEOUT) as ck:
        ck.load(_blank(rank), strict=False)


def _tier(base: str, rank: int) -> ss.LocalTier:
    return ss.LocalTier(
        root=os.path.join(base, f"node{rank}"), ranks_per_node=1, host="127.0.0.1", every=2
    )


def _tiered_load(where: object, rank: int) -> None:
    base = where.url if hasattr(where, "url") else str(where)  # type: ignore[attr-defined]
    tier = _tier(os.path.dirname(base) + "-tier", rank)
    with ss.Checkpointer(os.path.dirname(base), timeout=TIMEOUT, local_tier=tier) as ck:
        # step 1 is in the durable tier only (the local tier takes even steps)
        ck.load(_blank(rank), step=1, strict=False)


def _tiered_latest(where: object, tier_base: str, rank: int) -> None:
    tier = _tier(tier_base, rank)
    with ss.Checkpointer(where, timeout=TIMEOUT, local_tier=tier) as ck:  # type: ignore[arg-type]
        ck.latest()


def _staging_fault(rank: int, victim: int) -> None:
    """The victim's shared saver fails its next save's staging."""
    saver = api._savers[tuple(range(dist.get_world_size()))]

    def fail() -> None:
        saver.before_staging = None
        raise InjectedError("injected staging failure")

    if rank == victim:
        saver.before_staging = fail


def _async_save_staging(where: object, rank: int) -> None:
    response = ss.async_save(_state(rank, 7.0), where, timeout=TIMEOUT)
    response.result(TIMEOUT)


LOADS = {
    "ss.load": _ss_load,
    "slipstream.dcp.load": _dcp_load,
    "Checkpointer.load": _checkpointer_load,
}
LOAD_FAULTS = {
    "storage error": _storage_error("read"),
    "checksum": _checksum,
    "missing file": _missing,
}
SAVES = {
    "ss.save": _ss_save,
    "slipstream.dcp.save": _dcp_save,
    "ss.async_save (upload)": _async_save_upload,
}


def _prepare_step_dir(base: str, case: int) -> str:
    """A directory for one case: a Checkpointer root whose step 1 every rank saved."""
    root = os.path.join(base, f"case{case}")
    with ss.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, _state(dist.get_rank(), 1.0)).result(TIMEOUT)
    return root


def _expect_agreed_failure(name: str, run: Callable[[], None], victim: int, cause: str) -> None:
    """``run`` must raise on this rank within AGREED_WITHIN_S, naming the victim and cause."""
    dist.barrier()  # the ranks start the case together: the time bound is the agreement's
    started = time.monotonic()
    try:
        run()
    except Exception as exc:  # every error counts: what it says is checked below
        took = time.monotonic() - started
        message = str(exc)
    else:
        raise AssertionError(f"rank {dist.get_rank()}: {name} succeeded despite the fault")
    assert took < AGREED_WITHIN_S, f"rank {dist.get_rank()}: {name} failed after {took:.1f} s"
    if dist.get_rank() != victim:  # the victim's own error is its cause, as it happened
        assert f"rank {victim}" in message, f"{name}: rank {victim} is not named: {message}"
    assert cause in message, f"{name}: the error does not give the cause {cause!r}: {message}"


def _save_and_load_again(base: str, case: str, rank: int) -> None:
    """After a failure the ranks save and load as before."""
    root = os.path.join(base, f"again-{case}")
    ss.save(_state(rank, 3.0), root, timeout=TIMEOUT)
    got = _blank(rank)
    ss.load(got, root, strict=False)
    assert torch.equal(got[f"own{rank}"], torch.full((256,), 3.0)) and got["step"] == 3


def _move_fault_into_step(step_root: str, fault: str, rank: int, victim: int) -> None:
    """For a Checkpointer given the root: a file fault goes into its step's directory."""
    if fault == "checksum":
        _checksum(os.path.join(step_root, "step_1"), rank, victim)
    elif fault == "missing file":
        _missing(os.path.join(step_root, "step_1"), rank, victim)


def _cases(base: str, rank: int, victim: int) -> None:
    number = 0
    for entry, run in LOADS.items():
        for fault, inject in LOAD_FAULTS.items():
            number += 1
            step_root = _prepare_step_dir(base, number)
            dist.barrier()
            if entry == "Checkpointer.load":  # the fault in its step, it given the root
                target, cause = inject(step_root, rank, victim)
                _move_fault_into_step(step_root, fault, rank, victim)
                where: object = step_root if isinstance(target, str) else target
            else:
                where, cause = inject(os.path.join(step_root, "step_1"), rank, victim)
            _expect_agreed_failure(
                f"{entry} with a {fault}", partial(run, where, rank), victim, cause or "injected"
            )
            _save_and_load_again(base, f"{number}", rank)
    for entry, run in SAVES.items():
        number += 1
        where, cause = _storage_error("finish")(os.path.join(base, f"save{number}"), rank, victim)
        _expect_agreed_failure(
            f"{entry} with a storage error", partial(run, where, rank), victim, "injected"
        )
        _save_and_load_again(base, f"{number}", rank)
    number += 1
    _staging_fault(rank, victim)
    _expect_agreed_failure(
        "ss.async_save (staging) with a staging failure",
        lambda: _async_save_staging(os.path.join(base, f"save{number}"), rank),
        victim,
        "injected staging failure",
    )
    _save_and_load_again(base, f"{number}", rank)
    # with a local tier: a durable step's checksum, and a rank that cannot list the steps
    number += 1
    step_root = _prepare_step_dir(base, number)
    dist.barrier()
    _checksum(os.path.join(step_root, "step_1"), rank, victim)
    _expect_agreed_failure(
        "Checkpointer.load (local tier) with a checksum",
        lambda: _tiered_load(os.path.join(step_root, "step_1"), rank),
        victim,
        "CorruptCheckpointError",
    )
    number += 1
    step_root = _prepare_step_dir(base, number)
    where: object = step_root
    if rank == victim:
        where = FaultStorage(resolve_storage(step_root, spare_dir_name=SPARE_DIR))
        where.faults.fail("list", InjectedError("injected list failure"))  # type: ignore[attr-defined]
    _expect_agreed_failure(
        "Checkpointer.latest (local tier) with a storage error",
        lambda: _tiered_latest(where, step_root + "-tier", rank),
        victim,
        "injected list failure",
    )
    _save_and_load_again(base, f"{number}", rank)


def _regroup_survivors(rank: int, world: int, victim: int) -> None:
    """Leave the group the victim died in and form a fresh one of the survivors (rank 0,
    which hosts the job's store, is never the victim)."""
    store = dist.distributed_c10d._get_default_store()
    survivors = [r for r in range(world) if r != victim]
    if rank == 0:
        store.set("regroup/port", str(free_port()))
    deadline = time.monotonic() + 30
    while not store.check(["regroup/port"]):
        assert time.monotonic() < deadline, "no port for the survivors' group"
        time.sleep(0.01)
    port = int(store.get("regroup/port"))
    store.set(f"regroup/read/{rank}", "1")
    if rank == 0:
        while not store.check([f"regroup/read/{r}" for r in survivors]):
            assert time.monotonic() < deadline, "survivors did not read the port"
            time.sleep(0.01)
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=survivors.index(rank),
        world_size=len(survivors),
        timeout=timedelta(seconds=60),
    )


def _matrix(rank: int, world: int, base: str) -> None:
    victim = world - 1
    _cases(base, rank, victim)
    # last: the victim is SIGKILLed as it reads its file of a collective load
    root = os.path.join(base, "kill")
    ss.save(_state(rank, 5.0), root, timeout=TIMEOUT)
    where: object = root
    if rank == victim:
        where = FaultStorage(resolve_storage(root))
        where.faults.hook("read", lambda *a: os.kill(os.getpid(), signal.SIGKILL))  # type: ignore[attr-defined]
    _expect_agreed_failure(
        "ss.load with a rank SIGKILLed", lambda: _ss_load(where, rank), victim, "died"
    )
    _regroup_survivors(rank, world, victim)
    new_rank = dist.get_rank()
    _save_and_load_again(base, "survivors", new_rank)


@pytest.mark.parametrize("world", [2, 4])
def test_a_fault_on_one_rank_fails_every_entry_point_on_every_rank(tmp_path, world):
    run_workers(_matrix, world, str(tmp_path), timeout=300, killed=(world - 1,))
