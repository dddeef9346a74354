"""Storage failures do not stop training: a ``Checkpointer`` reports failed saves on their
futures, in the log and in ``health()``, and recovers with the next good save;
``on_error="raise"`` hands the failure back on the next call; ``when_busy="skip"`` skips
steps while a save is in flight (the same steps on every rank), within ``max_lag_steps``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from checkpoint_states import step_state
from dist_utils import run_workers, wait_for_key
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint.format.names import METADATA_FILE, SPARE_DIR
from slipstream.checkpoint.storage import resolve_storage

MESSAGE = "simulated storage failure"


def _checkpointer(root, **kwargs) -> tuple[ss.Checkpointer, FaultStorage]:
    storage = FaultStorage(resolve_storage(root, spare_dir_name=SPARE_DIR))
    return ss.Checkpointer(storage, **kwargs), storage


def _fail(storage: FaultStorage, fault: str) -> None:
    cause = OSError(errno.EIO, os.strerror(errno.EIO))
    error = ss.CheckpointError(f"{MESSAGE} ({fault}): {cause}")
    error.__cause__ = cause
    if fault == "put-metadata":
        storage.faults.fail("put", error, when=lambda name: name == METADATA_FILE)
    else:
        storage.faults.fail(fault, error)


def _health_when(ck: ss.Checkpointer, settled, timeout: float = 5.0) -> ss.CheckpointHealth:
    """``ck.health()`` once ``settled(health)`` holds (it is updated by a callback of the
    save's future, which may run just after a waiter on that future wakes)."""
    deadline = time.monotonic() + timeout
    while not settled(health := ck.health()):
        assert time.monotonic() < deadline, f"health never settled: {health}"
        time.sleep(0.01)
    return health


def _eventually(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def _logged_error(caplog, *parts: str) -> bool:
    return any(
        r.levelno == logging.ERROR and all(p in r.getMessage() for p in parts)
        for r in caplog.records
    )


@pytest.mark.parametrize("fault", ["put-metadata", "write"])
def test_failed_saves_are_reported_never_raised_and_the_next_good_save_recovers(
    tmp_path, caplog, fault
):
    caplog.set_level(logging.ERROR, logger="slipstream")
    ck, storage = _checkpointer(tmp_path)
    with ck:
        ck.save(1, step_state(1)).result(30)
        health = _health_when(ck, lambda h: h.last_durable_step == 1)
        assert health.healthy and health.lag_steps == 0 and health.last_error is None

        _fail(storage, fault)
        responses = [ck.save(step, step_state(step)) for step in (2, 3)]  # never raises
        for response in responses:
            error = response.upload_completion.exception(30)
            assert isinstance(error, ss.CheckpointError) and MESSAGE in str(error), error
        health = _health_when(ck, lambda h: h.failed_saves == 2)
        assert not health.healthy
        assert health.last_durable_step == 1 and health.last_requested_step == 3
        assert health.lag_steps == 2 and health.in_flight_step is None
        assert health.last_error.startswith("step 3: ") and MESSAGE in health.last_error
        for step in (2, 3):  # logged on the upload thread, just after health() counts it
            words = f"checkpoint of step {step} "
            _eventually(lambda words=words: _logged_error(caplog, words, MESSAGE))
        assert ck.steps() == [1]

        storage.faults.clear()
        ck.save(4, step_state(4)).result(30)
        health = _health_when(ck, lambda h: h.last_durable_step == 4)
        assert health.healthy and health.failed_saves == 0 and health.last_error is None
        assert health.lag_steps == 0 and health.in_flight_step is None
        assert ck.steps() == [1, 4]
        target = step_state(-1)
        assert ck.load(target) == 4 and torch.equal(target["w"], step_state(4)["w"])


def test_a_save_that_fails_in_the_call_is_reported_too(tmp_path):
    with ss.Checkpointer(tmp_path) as ck:
        ck.save(1, step_state(1)).result(30)
        response = ck.save(2, dict(step_state(2), hook=lambda: None))  # cannot be serialized
        assert isinstance(response.upload_completion.exception(0), ss.CheckpointError)
        health = _health_when(ck, lambda h: h.failed_saves == 1)
        assert health.last_requested_step == 2 and "step 2: " in health.last_error
        assert ck.steps() == [1]


def test_on_error_raise_raises_the_previous_failure_from_the_next_save(tmp_path):
    ck, storage = _checkpointer(tmp_path, on_error="raise")
    with ck:
        ck.save(1, step_state(1)).result(30)
        _fail(storage, "write")
        failed = ck.save(2, step_state(2))  # asynchronous: the failure is on its future first
        with pytest.raises(ss.CheckpointError, match=MESSAGE) as info:
            ck.save(3, step_state(3))
        assert info.value is failed.upload_completion.exception(0)
        storage.faults.clear()
        assert not (tmp_path / "step_3").exists(), "the save that raised was started"
        ck.save(4, step_state(4)).result(30)  # raised once: the next save goes ahead
        assert ck.steps() == [1, 4]


def test_when_busy_skip_skips_while_a_save_is_in_flight_and_writes_nothing(tmp_path):
    ck, storage = _checkpointer(tmp_path, keep_last=None, when_busy="skip")
    with ck:
        ck.save(1, step_state(1)).result(30)
        gate = storage.faults.gate("finish")
        try:
            slow = ck.save(2, step_state(2))
            skipped = ck.save(3, step_state(3))
            assert skipped.skipped and skipped.upload_completion.done()
            assert skipped.upload_completion.exception(0) is None
            health = ck.health()
            assert health.skipped_saves == 1 and health.in_flight_step == 2
            assert health.last_requested_step == 3 and health.lag_steps == 2
            assert not slow.skipped and not slow.upload_completion.done()
        finally:
            gate.set()
        slow.result(30)
        assert not any("step_3" in name for _, name, _ in storage.faults.calls)
        assert not (tmp_path / "step_3").exists()
        response = ck.save(4, step_state(4))
        assert not response.skipped
        response.result(30)
        health = _health_when(ck, lambda h: h.last_durable_step == 4)
        assert health.skipped_saves == 0 and health.healthy
        assert ck.steps() == [1, 2, 4]


@pytest.mark.parametrize("max_lag_steps", [1, 2])
def test_when_busy_skip_waits_instead_once_the_lag_would_exceed_max_lag_steps(
    tmp_path, max_lag_steps
):
    ck, storage = _checkpointer(
        tmp_path, keep_last=None, when_busy="skip", max_lag_steps=max_lag_steps
    )
    with ck:
        ck.save(1, step_state(1)).result(30)
        _health_when(ck, lambda h: h.last_durable_step == 1)
        gate = storage.faults.gate("finish")
        opened: list[float] = []

        def open_gate() -> None:
            opened.append(time.monotonic())  # just before: the save may return at once
            gate.set()

        opener = threading.Timer(0.5, open_gate)
        try:
            ck.save(2, step_state(2))
            step = 3
            while step - 1 <= max_lag_steps:  # within the lag: skipped at once
                assert ck.save(step, step_state(step)).skipped, step
                step += 1
            opener.start()
            response = ck.save(step, step_state(step))  # would lag too far: waits for step 2
            returned = time.monotonic()
        finally:
            gate.set()
            opener.cancel()
        assert not response.skipped
        assert opened and returned >= opened[0], "the save returned before step 2 could finish"
        response.result(30)
        assert ck.steps() == [1, 2, step]
        assert ck.health().skipped_saves == 0


def _skip_on_two_ranks(rank: int, world: int, root: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    storage = FaultStorage(resolve_storage(root, spare_dir_name=SPARE_DIR))
    storage.faults.hook("write", lambda *args: time.sleep(0.1))
    steps = range(1, 11)
    with ss.Checkpointer(storage, keep_last=None, when_busy="skip") as ck:
        skipped = []
        for step in steps:
            time.sleep(0.03)  # compute
            dist.barrier()  # a training step's gradient all-reduce keeps the ranks in step
            if rank == 1:  # rank 1 reaches its save later, often after its save in flight ended
                time.sleep(0.04 * (step % 4))
            if ck.save(step, dict(step_state(step), own=torch.full((3,), float(rank)))).skipped:
                skipped.append(step)
        ck.wait(30)
        store.set(f"test/skipped/{rank}", json.dumps(skipped))
        other = json.loads(
            wait_for_key(store, f"test/skipped/{1 - rank}", 30, "the other rank's skipped steps")
        )
        assert skipped == other, f"rank {rank} skipped {skipped}, rank {1 - rank} {other}"
        assert skipped and len(skipped) < len(steps), skipped
        assert ck.steps() == [s for s in steps if s not in skipped]


def test_when_busy_skip_skips_the_same_steps_on_every_rank(tmp_path):
    run_workers(_skip_on_two_ranks, 2, str(tmp_path), timeout=60)


def _rank0_never_decides(rank: int, world: int, root: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    with ss.Checkpointer(root, when_busy="skip", timeout=2.0) as ck:
        ck.save(1, step_state(1)).result(30)
        if rank == 1:
            try:
                response = ck.save(2, step_state(2))  # rank 0 (alive) never saves step 2
            finally:
                store.set("test/rank1_done", "1")
            assert isinstance(response.upload_completion.exception(10), ss.PeerTimeoutError)
            assert _health_when(ck, lambda h: h.failed_saves == 1).last_requested_step == 2
        else:
            wait_for_key(store, "test/rank1_done", 30, "rank 1's save of step 2 to return")


def test_when_busy_skip_never_raises_into_the_loop_while_waiting_for_rank_0(tmp_path):
    run_workers(_rank0_never_decides, 2, str(tmp_path), timeout=60)


def _rank1_three_saves_behind(rank: int, world: int, root: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    steps = (2, 3, 4, 5)
    with ss.Checkpointer(root, when_busy="skip", timeout=3.0, keep_last=None) as ck:
        ck.save(1, step_state(1)).result(30)
        if rank == 0:
            # step 2 is saved; it cannot finish before rank 1 joins it, so 3, 4, 5 are skipped
            decisions = [ck.save(step, step_state(step)).skipped for step in steps]
            store.set("test/rank0_decided", json.dumps(decisions))
        else:
            rank0 = wait_for_key(store, "test/rank0_decided", 30, "rank 0's skip decisions")
            decisions = [ck.save(step, step_state(step)).skipped for step in steps]
            assert decisions == json.loads(rank0)
        assert decisions == [False, True, True, True], decisions
        ck.wait(30)
        assert ck.steps() == [1, 2]


def test_when_busy_skip_agrees_with_a_rank_several_saves_behind(tmp_path):
    run_workers(_rank1_three_saves_behind, 2, str(tmp_path), timeout=60)
