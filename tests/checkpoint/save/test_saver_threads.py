import os
import sys
import threading
import time

import pytest
import torch

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


SAVER_THREADS = ("slipstream-stage", "slipstream-upload", "slipstream-io")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _saver_threads(before: set[int]) -> dict[str, int]:
    """Name -> native id of the saver threads started since ``before`` (the thread idents
    that existed then), found by the names the saver gives them."""
    return {
        t.name: t.native_id
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith(SAVER_THREADS) and t.native_id
    }


def _check_every_kind_ran(threads: dict[str, int]) -> None:
    for kind in (
        "slipstream-stage_",
        "slipstream-stage-tail_",
        "slipstream-upload_",
        "slipstream-io_",
    ):
        assert any(name.startswith(kind) for name in threads), (kind, sorted(threads))


def test_saver_threads_run_below_the_callers_priority(tmp_path):
    caller = _own_nice()
    before = {t.ident for t in threading.enumerate()}
    # split_copy, so the tail copier runs too
    saver = CheckpointSaver(options=SaveOptions(thread_nice=2, split_copy=True))
    try:
        state = {f"w{i}": torch.ones(100_000) for i in range(8)}
        saver.save(state, tmp_path / "ck").upload_completion.result(30)
        threads = _saver_threads(before)
        _check_every_kind_ran(threads)
        for name, tid in threads.items():
            assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, caller + 2), name
        assert _own_nice() == caller
    finally:
        saver.close()


def _idle_once_started(before: set[int], within: float) -> dict[str, int]:
    """The saver threads started since ``before``, once one of every kind runs and each
    has put itself under ``SCHED_IDLE`` (a thread does so first thing)."""
    deadline = time.monotonic() + within
    while True:
        threads = _saver_threads(before)
        try:
            _check_every_kind_ran(threads)
            if all(os.sched_getscheduler(tid) == os.SCHED_IDLE for tid in threads.values()):
                return threads
        except AssertionError:
            pass
        if time.monotonic() > deadline:
            policies = {n: os.sched_getscheduler(t) for n, t in threads.items()}
            raise AssertionError(f"saver threads not all under SCHED_IDLE: {policies}")
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE policy")
def test_idle_saver_threads_run_under_sched_idle_and_still_save(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    saver = CheckpointSaver(options=SaveOptions(idle_threads=True, split_copy=True))
    try:
        state = {f"w{i}": torch.arange(100_000.0) + i for i in range(8)}
        done = saver.save(state, tmp_path / "ck").upload_completion
        threads = _idle_once_started(before, within=60)
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
        # How long the save now takes depends on how busy other work keeps the cores (an
        # idle thread gets only idle time: a save of 14 ms took 132-269 s beside a burner on
        # every core), which is not what this test checks: where the process may, its
        # threads go back to the normal policy to finish.
        for tid in threads.values():
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except (PermissionError, ProcessLookupError):
                pass
        done.result(300)
        back = {k: torch.zeros(100_000) for k in state}
        ss.load(back, checkpoint_id=tmp_path / "ck")
        assert all(torch.equal(back[k], v) for k, v in state.items())
    finally:
        saver.close()
