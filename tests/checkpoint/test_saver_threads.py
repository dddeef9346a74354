import os
import sys
import threading

import pytest
import torch

from slipstream.checkpoint.saver import CheckpointSaver, SaveOptions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_saver_threads_run_below_the_callers_priority(tmp_path):
    caller = _own_nice()
    saver = CheckpointSaver(options=SaveOptions(thread_nice=2))
    try:
        saver.save({"w": torch.ones(1000)}, tmp_path / "ck").upload_completion.result(30)
        pools = (saver._stage_thread, saver._tail_copier, saver._upload_thread, saver._io_pool)
        for pool in pools:
            assert pool.submit(_own_nice).result(10) == min(19, caller + 2)
        assert _own_nice() == caller
    finally:
        saver.close()
