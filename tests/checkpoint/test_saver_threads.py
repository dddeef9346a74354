import os
import sys
import threading

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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE policy")
def test_idle_saver_threads_run_under_sched_idle_and_still_save(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    saver = CheckpointSaver(options=SaveOptions(idle_threads=True, split_copy=True))
    try:
        state = {f"w{i}": torch.arange(100_000.0) + i for i in range(8)}
        saver.save(state, tmp_path / "ck").upload_completion.result(30)
        threads = _saver_threads(before)
        _check_every_kind_ran(threads)
        for name, tid in threads.items():
            assert os.sched_getscheduler(tid) == os.SCHED_IDLE, name
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
        back = {k: torch.zeros(100_000) for k in state}
        ss.load(back, checkpoint_id=tmp_path / "ck")
        assert all(torch.equal(back[k], v) for k, v in state.items())
    finally:
        saver.close()
