"""Run a function on N local processes joined by a gloo group on 127.0.0.1 and a free port.

Workers are forked from a forkserver that imports torch and slipstream once per test
session: a fresh interpreter importing ``torch.distributed`` costs seconds per process,
a fork from the server a few milliseconds. The server is single-threaded, so forking it
is safe; every worker still starts from a clean process (no state of the test process).

Every worker is joined with a timeout; a worker's exception is re-raised in the test with
its rank, and a worker that does not finish in time fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import socket
import traceback
from datetime import timedelta

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, fn, args, errors, environ, barrier):
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
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_and_join(procs: list, timeout: float) -> list[int]:
    """Start ``procs``, join each within ``timeout``, kill stragglers; return their indices."""
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    return hung


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
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, fn, args, errors, dict(os.environ), not killed),
            daemon=True,
        )
        for r in range(world_size)
    ]
    hung = start_and_join(procs, timeout)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        # every failed rank, lowest first: a rank that fails often takes the others down
        # with it (a collective they were in fails), and its own error is the one that counts
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(failures)))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s")
    want = {r: -signal.SIGKILL if r in killed else 0 for r in range(world_size)}
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != want[r]]
    if bad:
        raise AssertionError(f"workers exited abnormally (rank, exit code): {bad}")
