import os
import sys
import threading

import pytest
import torch

from slipstream.checkpoint.saver import CheckpointSaver, SaveOptions

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def test_saver_threads_run_below_the_callers_priority(tmp_path):
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver = CheckpointSaver(options=SaveOptions(thread_nice=2))
    try:
        saver.save({"w": torch.ones(1000)}, tmp_path / "ck").upload_completion.result(30)
        workers = [t for t in threading.enumerate() if t.name.startswith("slipstream-")]
        assert {t.name.split("_")[0] for t in workers} >= {"slipstream-stage", "slipstream-upload"}
        for t in workers:
            assert os.getpriority(os.PRIO_PROCESS, t.native_id) == min(19, caller + 2), t.name
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    finally:
        saver.close()
