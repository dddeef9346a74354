"""Background threads that yield the CPU to the training thread.

On CPU a worker thread stands in for an accelerator's side stream: it stages and writes
while the training thread computes. Where the cores are oversubscribed, a background
thread at the training thread's priority takes its time slices from training as much as
from anything else. Linux keeps a nice value (and a scheduling policy) per thread, so
the worker threads of a checkpoint saver lower their own priority when they start: they
still run whenever a core is free (an idle core, or while the training thread waits on
them), and they give way to training when there is not.
"""

from __future__ import annotations

import os
import platform
import sys
import threading

MAX_NICE = 19


#: Whether this host's CPU is x86: stores become visible to other cores in program order
#: (TSO), and glibc's x86 tunables apply.
X86_CPU = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def lower_thread_priority(increment: int, idle: bool = False) -> None:
    """Run the calling thread ``increment`` nice levels below the main thread (Linux only),
    or with ``idle`` under Linux's ``SCHED_IDLE`` policy, falling back to ``increment``.

    ``SCHED_IDLE``: the thread runs only on a core that no thread of normal policy wants,
    and a normal thread that wakes (a training thread whose collective completed) takes
    that core at once. On a host whose cores are all busy the thread gets next to no time
    until its owner waits for it.

    Only the calling thread changes: the process and its other threads keep theirs. The
    level is relative to the main thread, not to the caller's current one, so a worker
    started by another lowered worker (which inherits its nice value) is not lowered
    twice. Failure to change it is ignored, since priority is a hint, never a requirement.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    if increment <= 0:
        return
    try:
        target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + increment)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:
        pass
