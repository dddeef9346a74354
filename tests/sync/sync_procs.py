"""Spawn trainer and rollout processes that join only a sync group (no default group).

``spawn(fn, world_size, *args)`` runs ``fn(rank, port, *args)`` on ``world_size`` processes;
the return values come back as ``{rank: value}``. A rank listed in ``may_die`` may exit
without reporting (it is the one a test kills). Every process is joined with a timeout and
killed if it overstays, so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import os
import traceback

from dist_utils import free_port, start_and_join, worker_context


def _entry(fn, rank, port, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        results.put((rank, "ok", fn(rank, port, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # The result is in the pipe; skip interpreter teardown (seconds under torch on a busy host).
    os._exit(0)


def spawn(fn, world_size: int, *args, timeout: float = 60.0, may_die: tuple[int, ...] = ()):
    ctx = worker_context()
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    hung = start_and_join(procs, timeout)
    out, errors = {}, []
    while not results.empty():
        rank, status, value = results.get()
        if status == "ok":
            out[rank] = value
        else:
            errors.append((rank, value))
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors)))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
    missing = [r for r in range(world_size) if r not in out and r not in may_die]
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result")
    return out


def remote_reads_allowed() -> bool:
    """Whether the kernel lets a process read a same-user sibling's memory, judged from the
    host's settings rather than by trying: Yama's ptrace_scope absent or 0, or the
    CAP_SYS_PTRACE capability (bit 19) in this process's effective set."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() == "0":
                return True
    except FileNotFoundError:
        return True
    with open("/proc/self/status") as f:
        caps = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> 19 & 1)
