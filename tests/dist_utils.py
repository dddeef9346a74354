"""Run a function on N local processes joined by a gloo group on 127.0.0.1 and a free port,
and the process and store machinery every multi-process test shares.

Workers are forked from a forkserver that imports torch and slipstream once per test
session: a fresh interpreter importing ``torch.distributed`` costs seconds per process,
a fork from the server a few milliseconds. The server is single-threaded, so forking it
is safe; every worker still starts from a clean process (no state of the test process).

:func:`supervise` runs one process per rank for both harnesses (:func:`run_workers` here,
``sync_procs.spawn`` for processes that join only a sync group): results are read while the
processes run, a process that overstays its timeout is killed, and a worker's exception is
re-raised in the test with its rank, so a hang fails the test instead of blocking it.
:func:`wait_for_key` is the one way a test process waits for another's word in a store.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "slipstream",
    "dist_utils",
]


def worker_context():
    """The multiprocessing context workers start from (a forkserver with torch preloaded)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ports() -> range:
    """The ports this test process picks from: below the kernel's ephemeral range, and a
    share of them of its own under pytest-xdist (``PYTEST_XDIST_WORKER`` = ``gwN``)."""
    low, high = 10000, _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        share = (high - low) // count
        low += int(worker[2:]) % count * share
        high = low + share
    return range(low, high)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, below the kernel's ephemeral range and in this
    process's own share of it (:func:`_ports`).

    A port the kernel handed out as ephemeral can be handed out again at once, to any
    process's outgoing connection (another test's store client), before the rank meant to
    listen on it binds it; a port below that range is never chosen for a connection, and
    two xdist workers never pick the same one."""
    ports = _ports()
    for _ in range(200):
        port = random.choice(ports)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports} on 127.0.0.1 after 200 tries")


def wait_for_key(store: dist.Store, key: str, timeout: float, what: str) -> bytes:
    """Poll ``store`` until ``key`` is set and return its value; past ``timeout`` seconds, fail
    with an AssertionError naming the key and ``what`` it waited for. Polls rather than blocking
    in ``store.wait``: a blocking wait holds the store client, which other threads of the
    process (a publisher's, a checkpointer's) are using meanwhile."""
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{key!r} was not set within {timeout} s: {what}")
        time.sleep(0.02)
    return store.get(key)


def supervise(
    start: Callable[[int, int], Any],
    world_size: int,
    results,
    timeout: float,
    restart: tuple[int, ...] = (),
) -> tuple[dict[int, Any], dict[int, int | None]]:
    """Run one process per rank to its end; return ``({rank: value}, {rank: exit code})``.

    ``start(rank, life)`` starts a rank's process: life 1 for every rank, then life 2, once,
    for a rank in ``restart`` as soon as its first process has exited (the replacement's
    report is the one kept). A process reports by putting ``(rank, "ok", value)`` or
    ``(rank, "error", traceback)`` on ``results``, which is read while they run (a pipe holds
    only so much). Whatever still runs ``timeout`` seconds after the start is killed. Raises
    an AssertionError with every failed rank's traceback, lowest rank first (a rank that
    fails often takes the others down with it, and its own error is the one that counts),
    or else naming the ranks that did not finish in time."""
    procs = {r: start(r, 1) for r in range(world_size)}
    pending_restart = set(restart)
    values: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []

    def collect() -> None:
        while not results.empty():
            rank, status, value = results.get()
            if status == "ok":
                values[rank] = value
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
    return values, {r: p.exitcode for r, p in procs.items()}


def _worker(rank, world_size, port, backend, fn, args, results, environ, barrier):
    os.environ.clear()
    os.environ.update(environ)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        fn(rank, world_size, *args)
        if barrier:
            dist.barrier()
        results.put((rank, "ok", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str = "gloo",
    killed: tuple[int, ...] = (),
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes joined by a ``backend``
    group (gloo unless a test needs NCCL); raise on failure. Workers get the test's
    environment as it is now (the forkserver they fork from may have started before a
    fixture set a variable, such as an S3 endpoint). Ranks in ``killed`` are meant to die
    by SIGKILL: they must, and the survivors skip the closing barrier."""
    ctx = worker_context()
    results = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)

    def start(rank: int, life: int):
        p = ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, fn, args, results, environ, not killed),
            daemon=True,
        )
        p.start()
        return p

    _, exitcodes = supervise(start, world_size, results, timeout)
    want = {r: -signal.SIGKILL if r in killed else 0 for r in range(world_size)}
    bad = [(r, code) for r, code in exitcodes.items() if code != want[r]]
    if bad:
        raise AssertionError(f"workers exited abnormally (rank, exit code): {bad}")


def links_in_child(fds: list[int]) -> list[str]:
    """What each of ``fds`` names in a child forked now (its ``/proc/self/fd`` link, or
    ``"closed"``): how a test sees what a forked child inherits."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                links.append("closed")
        os.write(write, "\n".join(links).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read().split("\n")
    os.waitpid(pid, 0)
    return out
