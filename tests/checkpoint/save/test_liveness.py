"""A rank that dies or stops is noticed within seconds whatever the timeout; a rank that
is alive but late gets exactly the timeout configured, not the default.

Every test runs two gloo ranks (see :func:`dist_utils.run_workers`). Ranks talk to each
other through the job's store with :func:`dist_utils.wait_for_key`, which polls rather than
blocking in ``store.wait``: a TCPStore client runs one request at a time, so a blocking wait
would hold up the saver's heartbeat thread on the same client (and make a live rank look
dead).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from checkpoint_states import step_state
from dist_utils import run_workers, wait_for_key
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.format.names import SPARE_DIR
from slipstream.checkpoint.save.channel import LIVENESS_CHECK_SECONDS, SILENT_AFTER_SECONDS
from slipstream.checkpoint.storage import LocalStorage, resolve_storage

NOTICE_BOUND_S = 2 * (SILENT_AFTER_SECONDS + LIVENESS_CHECK_SECONDS)
"""A dead or stopped rank must be noticed within this many seconds: what noticing needs
(six seconds of silence plus one liveness check), twice, for a loaded host."""
FAIL_FAST_S = 2.0
"""Once a rank is known dead, the next save must fail within this many seconds."""


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _state(rank: int, step: int) -> dict:
    """The step's state with an entry of ``rank``'s own: each rank writes a part of it."""
    return step_state(step, **{f"own{rank}": torch.full((3,), float(rank))})


def _rank1_killed_mid_write(rank: int, world: int, root: str) -> None:
    store = _store()
    if rank == 1:
        storage = FaultStorage(resolve_storage(root, spare_dir_name=SPARE_DIR))
        ck = ss.Checkpointer(storage, keep_last=None)
    else:
        ck = ss.Checkpointer(root, keep_last=None)
    assert SaveOptions().timeout == 600.0  # the default this Checkpointer runs with
    with ck:
        ck.save(1, _state(rank, 1)).result(30)
        if rank == 1:

            def die(writer, name, start, end) -> None:
                store.set("test/rank1_dying_at", repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)

            storage.faults.hook("write", die)
            ck.save(2, _state(rank, 2)).result(60)
            raise AssertionError("rank 1 survived its own SIGKILL")

        response = ck.save(2, _state(rank, 2))
        with pytest.raises(ss.PeerDiedError) as info:
            response.result(30)  # far below the 600 s timeout: only liveness can end it
        dying_at = wait_for_key(_store(), "test/rank1_dying_at", 30, "rank 1's time of death")
        noticed = time.monotonic() - float(dying_at)
        assert noticed < NOTICE_BOUND_S, f"rank 1's death was noticed after {noticed:.1f} s"
        message = str(info.value)
        assert "rank 1" in message and "finish writing" in message, message
        assert ck.path(2) in message, message

        started = time.monotonic()
        response = ck.save(3, _state(rank, 3))  # on_error="log": returned, not raised
        assert response.upload_completion.done(), "the save after a death was started"
        error = response.upload_completion.exception(FAIL_FAST_S)
        assert time.monotonic() - started < FAIL_FAST_S
        assert isinstance(error, ss.PeerDiedError) and "rank 1" in str(error), error

        health = ck.health()
        assert health.last_durable_step == 1 and health.failed_saves == 2, health
        assert ck.steps() == [1]
        target = _state(rank, 0)
        # a load is collective: in the group rank 1 died in it fails at once, naming rank 1
        with pytest.raises(ss.PeerDiedError, match="rank 1"):
            ck.load(target, strict=False)
    # the survivor loads in a group of its own
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with ss.Checkpointer(root, keep_last=None) as ck:
        assert ck.load(target, strict=False) == 1
        assert torch.equal(target["w"], _state(rank, 1)["w"])


def test_a_rank_killed_mid_write_is_named_within_seconds_with_the_default_timeout(tmp_path):
    """Rank 1 SIGKILLs itself while writing save 2; rank 0, under the default 600 s
    timeout, must fail that save with PeerDiedError naming rank 1, the phase and the step's
    URL within NOTICE_BOUND_S (12 s) of the death: that bound is what this test checks.
    Rank 0's next save must then fail within FAIL_FAST_S, naming rank 1 again."""
    run_workers(_rank1_killed_mid_write, 2, str(tmp_path), timeout=90, killed=(1,))
    with ss.Checkpointer(tmp_path) as ck:
        assert ck.steps() == [1]


def _rank1_stopped_mid_write(rank: int, world: int, root: str) -> None:
    saver = CheckpointSaver()  # the default options: a 600 s timeout
    try:
        saver.save(_state(rank, 1), os.path.join(root, "first")).result(30)
        if rank == 1:
            storage = FaultStorage(LocalStorage(os.path.join(root, "second")))

            def stop_here(writer, name, start, end) -> None:
                _store().set("test/rank1_pid", str(os.getpid()))
                time.sleep(120)  # rank 0 stops, then kills, this process in here

            storage.faults.hook("write", stop_here)
            saver.save(_state(rank, 2), storage).result(150)
            raise AssertionError("rank 1 was never stopped")

        response = saver.save(_state(rank, 2), os.path.join(root, "second"))
        pid = int(wait_for_key(_store(), "test/rank1_pid", 30, "rank 1's pid"))
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(ss.PeerDiedError) as info:
                response.result(30)
            noticed = time.monotonic() - stopped
        finally:
            os.kill(pid, signal.SIGKILL)
        assert noticed < NOTICE_BOUND_S, f"rank 1 was noticed stopped after {noticed:.1f} s"
        message = str(info.value)
        assert "rank 1" in message and "finish writing" in message, message
        assert os.path.join(root, "second") in message, message

        started = time.monotonic()
        with pytest.raises(ss.PeerDiedError, match="rank 1"):
            saver.save(_state(rank, 3), os.path.join(root, "third"))
        assert time.monotonic() - started < FAIL_FAST_S
    finally:
        saver.close()


def test_a_stopped_rank_is_named_within_seconds_with_the_default_timeout(tmp_path):
    """Rank 0 SIGSTOPs rank 1 while rank 1 writes its part of a save; rank 0 (default 600 s
    timeout) must fail the save with PeerDiedError naming rank 1 within NOTICE_BOUND_S of
    the stop (the bound under test), and its saver's next save must raise at once. Rank 0
    then SIGKILLs rank 1 so that the test ends."""
    run_workers(_rank1_stopped_mid_write, 2, str(tmp_path), timeout=90, killed=(1,))
    assert (tmp_path / "first" / ".metadata").is_file()
    assert not (tmp_path / "second" / ".metadata").exists()
    assert not (tmp_path / "third").exists()


def _rank1_late(rank: int, world: int, root: str) -> None:
    """For each configuration, rank 0 saves step 2 while rank 1, alive and beating, holds
    back its own save of step 2 until rank 0 has given up on it."""
    configs = [
        ("options", {"options": SaveOptions(timeout=3.0)}, 3.0),
        ("explicit", {"timeout": 1.5, "options": SaveOptions(timeout=600.0)}, 1.5),
    ]
    for name, kwargs, timeout in configs:
        with ss.Checkpointer(os.path.join(root, name), **kwargs) as ck:
            ck.save(1, _state(rank, 1)).result(30)
            if rank == 0:
                started = time.monotonic()
                error = ck.save(2, _state(rank, 2)).upload_completion.exception(30)
                elapsed = time.monotonic() - started
                _store().set(f"test/{name}/rank0_gave_up", "1")
                assert isinstance(error, ss.PeerTimeoutError), error
                assert not isinstance(error, ss.PeerDiedError), error
                assert f"within {timeout:.1f} s" in str(error) and "rank(s) [1]" in str(error)
                assert timeout <= elapsed < timeout + 3.0, f"{name}: failed after {elapsed:.2f} s"
                wait_for_key(_store(), f"test/{name}/rank1_done", 30, "rank 1 to finish")
            else:
                wait_for_key(_store(), f"test/{name}/rank0_gave_up", 30, "rank 0 to give up")
                error = ck.save(2, _state(rank, 2)).upload_completion.exception(30)
                assert isinstance(error, ss.PeerTimeoutError), error
                _store().set(f"test/{name}/rank1_done", "1")
            # the ranks are in step again: the next save commits
            ck.save(3, _state(rank, 3)).result(30)
            assert ck.steps() == [1, 3]


def test_the_timeout_configured_is_the_timeout_waited(tmp_path):
    """``Checkpointer(options=SaveOptions(timeout=3))`` waits 3 s for a live but late rank,
    not the 600 s default; an explicit ``timeout=1.5`` beats ``options.timeout=600``. The
    late rank is alive (it beats), so the error is a PeerTimeoutError, not PeerDiedError."""
    run_workers(_rank1_late, 2, str(tmp_path), timeout=60)
