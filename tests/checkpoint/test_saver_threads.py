import os
import sys
import threading

import pytest
import torch

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_saver_threads_run_below_the_callers_priority(tmp_path):
    caller = _own_nice()
    saver = CheckpointSaver(options=SaveOptions(thread_nice=2))
    try:
        saver.save({"w": torch.ones(1000)}, tmp_path / "ck").upload_completion.result(30)
        pools = (
            saver._stage_thread,
            saver._stager._tail_copier,
            saver._upload_thread,
            saver._writer._io_pool,
        )
        for pool in pools:
            assert pool.submit(_own_nice).result(10) == min(19, caller + 2)
        assert _own_nice() == caller
    finally:
        saver.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE policy")
def test_idle_saver_threads_run_under_sched_idle_and_still_save(tmp_path):
    saver = CheckpointSaver(options=SaveOptions(idle_threads=True))
    try:
        state = {"w": torch.arange(1000.0)}
        saver.save(state, tmp_path / "ck").upload_completion.result(30)
        pools = (
            saver._stage_thread,
            saver._stager._tail_copier,
            saver._upload_thread,
            saver._writer._io_pool,
        )
        for pool in pools:
            assert pool.submit(lambda: os.sched_getscheduler(0)).result(10) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
        back = {"w": torch.zeros(1000)}
        ss.load(back, checkpoint_id=tmp_path / "ck")
        assert torch.equal(back["w"], state["w"])
    finally:
        saver.close()
