"""Spawn trainer and rollout processes that join only a sync group (no default group).

``spawn(fn, world_size, *args)`` runs ``fn(rank, port, *args)`` on ``world_size`` processes;
the return values come back as ``{rank: value}``. A rank listed in ``may_die`` may exit
without reporting (it is the one a test kills). A rank listed in ``restart`` is started
again, once, as soon as its first process has exited (a replacement joining the running
group: :func:`life` tells the two apart); its result is the replacement's. Results are read
while the processes run (a pipe holds only so much), and every process is joined with a
timeout and killed if it overstays, so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import os
import time
import traceback

from dist_utils import free_port, worker_context


def _entry(fn, rank, port, args, results, life):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["SLIPSTREAM_TEST_LIFE"] = str(life)
    try:
        import torch

        torch.set_num_threads(1)
        results.put((rank, "ok", fn(rank, port, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # The result is in the pipe; skip interpreter teardown (seconds under torch on a busy host).
    os._exit(0)


def life() -> int:
    """1 in a rank's first process, 2 in the one that replaced it (``spawn(restart=...)``)."""
    return int(os.environ.get("SLIPSTREAM_TEST_LIFE", "1"))


def spawn(
    fn,
    world_size: int,
    *args,
    timeout: float = 60.0,
    may_die: tuple[int, ...] = (),
    restart: tuple[int, ...] = (),
):
    ctx = worker_context()
    results = ctx.SimpleQueue()
    port = free_port()

    def start(rank: int, n: int):
        p = ctx.Process(target=_entry, args=(fn, rank, port, args, results, n), daemon=True)
        p.start()
        return p

    procs = {r: start(r, 1) for r in range(world_size)}
    pending_restart = set(restart)
    out, errors = {}, []

    def collect() -> None:
        while not results.empty():
            rank, status, value = results.get()
            if status == "ok":
                out[rank] = value
            else:
                errors.append((rank, value))

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        collect()
        for r in sorted(pending_restart):
            if not procs[r].is_alive():
                procs[r].join()
                pending_restart.discard(r)
                procs[r] = start(r, 2)
        if not pending_restart and not any(p.is_alive() for p in procs.values()):
            break
        time.sleep(0.05)
    hung = [r for r, p in procs.items() if p.is_alive()]
    for p in procs.values():
        if p.is_alive():
            p.kill()
        p.join(5)
    collect()
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
