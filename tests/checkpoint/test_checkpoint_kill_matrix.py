"""A rank SIGKILLed inside any collective checkpoint entry point fails that call on every
surviving rank (issue 47): each survivor's error names the dead rank within
:data:`~fault_cases.AGREED_WITHIN_S`, found by its silent heartbeat (the calls' own
timeout is far longer), and the survivors, regrouped without it, save and load again.

A killed rank cannot come back, so each (entry point, world size) is a job of its own.
The jobs of one world size run at once: each spends its time waiting out the victim's
silence, not computing.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from functools import partial

import pytest
import torch.distributed as dist
from dist_utils import run_workers
from fault_cases import (
    TIMEOUT,
    async_save,
    checkpointer_load,
    dcp_load,
    dcp_save,
    expect_agreed_failure,
    prepare_step_dir,
    regroup_survivors,
    save_and_load_again,
    ss_load,
    ss_save,
    state,
    tiered_latest,
    tiered_load,
)
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint import api
from slipstream.checkpoint.format.names import SPARE_DIR
from slipstream.checkpoint.storage import resolve_storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Prepared(Enum):
    """What a case's location holds before the entry point runs."""

    NOTHING = "nothing"
    SAVED = "saved"  # one ss.save
    STEPS = "steps"  # a Checkpointer root with step 1


@dataclass(frozen=True)
class KillCase:
    """Where the victim dies: at ``operation`` of its storage (or, with ``operation`` None,
    as its saver stages), while every rank runs ``run(where, rank)``."""

    run: Callable[[object, int], None]
    prepared: Prepared
    operation: str | None


def _tier_base(where: object) -> str:
    return getattr(where, "url", where) + "-tier"  # type: ignore[operator]


def _checkpointer_save(where: object, rank: int) -> None:
    with ss.Checkpointer(where, timeout=TIMEOUT) as ck:  # type: ignore[arg-type]
        ck.save(2, state(rank, 2.0)).result(TIMEOUT)


CASES = {
    "ss.save": KillCase(ss_save, Prepared.NOTHING, "open"),
    "slipstream.dcp.save": KillCase(dcp_save, Prepared.NOTHING, "open"),
    "ss.async_save (staging)": KillCase(async_save, Prepared.NOTHING, None),
    "ss.async_save (upload)": KillCase(async_save, Prepared.NOTHING, "open"),
    "Checkpointer.save": KillCase(_checkpointer_save, Prepared.STEPS, "open"),
    "ss.load": KillCase(ss_load, Prepared.SAVED, "read"),
    "slipstream.dcp.load": KillCase(dcp_load, Prepared.SAVED, "read"),
    "Checkpointer.load": KillCase(checkpointer_load, Prepared.STEPS, "read"),
    "Checkpointer.load (local tier)": KillCase(
        lambda where, rank: tiered_load(where, _tier_base(where), rank), Prepared.STEPS, "read"
    ),
    "Checkpointer.latest (local tier)": KillCase(
        lambda where, rank: tiered_latest(where, _tier_base(where), rank), Prepared.STEPS, "list"
    ),
}


def _die(record: str, *_: object) -> None:
    """Write the time of death to ``record``, then SIGKILL this process."""
    with open(record + ".part", "w") as f:
        f.write(repr(time.time()))
    os.replace(record + ".part", record)
    os.kill(os.getpid(), signal.SIGKILL)


def _time_of_death(record: str) -> float:
    with open(record) as f:
        return float(f.read())


def _killed_in(rank: int, world: int, base: str, entry: str) -> None:
    case = CASES[entry]
    victim = world - 1
    ss.save(state(rank, 1.0), os.path.join(base, "before"), timeout=TIMEOUT)  # a job that saved
    root = os.path.join(base, "target")
    if case.prepared == Prepared.SAVED:
        ss.save(state(rank, 5.0), root, timeout=TIMEOUT)
    elif case.prepared == Prepared.STEPS:
        prepare_step_dir(root)
    where: object = root
    record = os.path.join(base, "died_at")
    if rank == victim and case.operation is None:
        api._savers[tuple(range(world))].before_staging = partial(_die, record)
    elif rank == victim:
        where = FaultStorage(resolve_storage(root, spare_dir_name=SPARE_DIR))
        where.faults.hook(case.operation, partial(_die, record))  # type: ignore[attr-defined]
    expect_agreed_failure(
        f"{entry} with rank {victim} SIGKILLed",
        partial(case.run, where, rank),
        victim,
        "died",
        fault_at=partial(_time_of_death, record),
    )
    regroup_survivors(rank, world, victim)
    save_and_load_again(base, "survivors", dist.get_rank())


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_killed_in_any_entry_point_fails_it_on_every_survivor(tmp_path, world):
    with ThreadPoolExecutor(len(CASES)) as pool:
        jobs = {
            entry: pool.submit(
                run_workers,
                _killed_in,
                world,
                str(tmp_path / f"case{i}"),
                entry,
                timeout=120,
                killed=(world - 1,),
            )
            for i, entry in enumerate(CASES)
        }
    failed = {}
    for entry, job in jobs.items():
        if job.exception() is not None:
            failed[entry] = job.exception()
    assert not failed, "\n\n".join(f"{entry}:\n{exc}" for entry, exc in failed.items())
