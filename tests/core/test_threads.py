import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from slipstream.core.threads import lower_thread_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_only_the_calling_worker_thread_is_lowered():
    main_before = _nice_of(threading.get_native_id())

    def lowered() -> tuple[int, int]:
        tid = threading.get_native_id()
        before = _nice_of(tid)
        lower_thread_priority(3)
        return before, _nice_of(tid)

    with ThreadPoolExecutor(1) as pool:
        before, after = pool.submit(lowered).result(10)
    assert after == min(19, before + 3)
    assert _nice_of(threading.get_native_id()) == main_before
    assert os.getpriority(os.PRIO_PROCESS, 0) == main_before


def test_zero_increment_changes_nothing():
    with ThreadPoolExecutor(1) as pool:
        tid = pool.submit(threading.get_native_id).result(10)
        before = _nice_of(tid)
        pool.submit(lower_thread_priority, 0).result(10)
        assert _nice_of(tid) == before


def test_a_worker_started_by_a_lowered_worker_is_not_lowered_twice():
    main = _nice_of(threading.get_native_id())

    def nested() -> int:
        lower_thread_priority(2)
        with ThreadPoolExecutor(1, initializer=lower_thread_priority, initargs=(2,)) as inner:
            return inner.submit(lambda: _nice_of(threading.get_native_id())).result(10)

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(nested).result(10) == min(19, main + 2)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE policy")
def test_idle_runs_only_the_calling_worker_under_sched_idle():
    main = threading.get_native_id()
    main_policy = os.sched_getscheduler(main)

    def lowered() -> tuple[int, int]:
        lower_thread_priority(3, idle=True)
        return os.sched_getscheduler(threading.get_native_id()), _nice_of(main)

    with ThreadPoolExecutor(1) as pool:
        policy, main_nice = pool.submit(lowered).result(10)
    assert policy == os.SCHED_IDLE
    assert os.sched_getscheduler(main) == main_policy != os.SCHED_IDLE
    assert main_nice == _nice_of(main)
