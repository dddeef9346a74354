"""What the checkpoint fault matrices share: the states saved, the collective entry points
run on every rank, the check that a failure is agreed, and the survivors' way on.

An entry point here is ``run(where, rank)``: one collective call on every rank of the job
against ``where`` (a path, or the victim's :class:`~fault_storage.FaultStorage`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_utils import free_port

import slipstream as ss
import slipstream.dcp as ss_dcp

AGREED_WITHIN_S = 5.0
"""Every surviving rank must have its error this soon after the fault."""
TIMEOUT = 120.0
"""The saves' and loads' timeout: far above AGREED_WITHIN_S, so only agreement (or the
heartbeat, for a killed rank) can end the waits in time."""


def state(rank: int, value: float) -> dict:
    return {f"own{rank}": torch.full((256,), value), "step": int(value)}


def blank(rank: int) -> dict:
    return {f"own{rank}": torch.zeros(256), "step": -1}


class InjectedError(OSError):
    """The storage error a case injects (its text is the cause every rank must name)."""


def ss_load(where: object, rank: int) -> None:
    ss.load(blank(rank), where, strict=False)


def dcp_load(where: object, rank: int) -> None:
    ss_dcp.load(blank(rank), checkpoint_id=where)


def checkpointer_load(where: object, rank: int) -> None:
    with ss.Checkpointer(where, timeout=TIMEOUT) as ck:
        ck.load(blank(rank), strict=False)


def ss_save(where: object, rank: int) -> None:
    ss.save(state(rank, 7.0), where, timeout=TIMEOUT)


def dcp_save(where: object, rank: int) -> None:
    ss_dcp.save(state(rank, 7.0), checkpoint_id=where, timeout=TIMEOUT)


def async_save(where: object, rank: int) -> None:
    """Both phases: the staging the caller waits for, then the upload."""
    response = ss.async_save(state(rank, 7.0), where, timeout=TIMEOUT)
    response.staging_completion.result(TIMEOUT)
    response.result(TIMEOUT)


def tier(base: str, rank: int) -> ss.LocalTier:
    """A local tier that takes even steps only: step 1 is in the durable tier alone."""
    return ss.LocalTier(root=os.path.join(base, f"node{rank}"), ranks_per_node=1, every=2)


def prepare_step_dir(root: str) -> str:
    """``root`` as a Checkpointer root whose step 1 every rank saved."""
    with ss.Checkpointer(root, timeout=TIMEOUT) as ck:
        ck.save(1, state(dist.get_rank(), 1.0)).result(TIMEOUT)
    return root


def expect_agreed_failure(
    name: str,
    run: Callable[[], None],
    victim: int,
    cause: str,
    fault_at: Callable[[], float] | None = None,
) -> float:
    """``run`` must raise on this rank within AGREED_WITHIN_S, naming the victim and cause;
    returns how long it took. The time runs from when the ranks start ``run`` together, or,
    with ``fault_at``, from the wall-clock time it returns: when the fault struck (the
    ranks share one host's clock)."""
    dist.barrier()  # the ranks start the case together: the time bound is the agreement's
    started = time.time()
    try:
        run()
    except Exception as exc:  # every error counts: what it says is checked below
        failed = time.time()
        message = str(exc)
    else:
        raise AssertionError(f"rank {dist.get_rank()}: {name} succeeded despite the fault")
    took = failed - (fault_at() if fault_at is not None else started)
    assert took < AGREED_WITHIN_S, f"rank {dist.get_rank()}: {name} failed after {took:.1f} s"
    if dist.get_rank() != victim:  # the victim's own error is its cause, as it happened
        assert f"rank {victim}" in message, f"{name}: rank {victim} is not named: {message}"
    assert cause in message, f"{name}: the error does not give the cause {cause!r}: {message}"
    return took


def save_and_load_again(base: str, case: str, rank: int) -> None:
    """After a failure the ranks save and load as before."""
    root = os.path.join(base, f"again-{case}")
    ss.save(state(rank, 3.0), root, timeout=TIMEOUT)
    got = blank(rank)
    ss.load(got, root, strict=False)
    assert torch.equal(got[f"own{rank}"], torch.full((256,), 3.0)) and got["step"] == 3


def regroup_survivors(rank: int, world: int, victim: int) -> None:
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


def tiered_load(where: object, tier_base: str, rank: int) -> None:
    """``Checkpointer.load`` of step 1 (durable only) with a local tier, given the root."""
    with ss.Checkpointer(where, timeout=TIMEOUT, local_tier=tier(tier_base, rank)) as ck:  # type: ignore[arg-type]
        ck.load(blank(rank), step=1, strict=False)


def tiered_latest(where: object, tier_base: str, rank: int) -> None:
    """``Checkpointer.latest`` with a local tier, given the root."""
    with ss.Checkpointer(where, timeout=TIMEOUT, local_tier=tier(tier_base, rank)) as ck:  # type: ignore[arg-type]
        ck.latest()
