"""Spawn trainer and rollout processes that join only a sync group (no default group).

``spawn(fn, world_size, *args)`` runs ``fn(rank, port, *args)`` on ``world_size`` processes;
the return values come back as ``{rank: value}``. A rank listed in ``may_die`` may exit
without reporting (it is the one a test kills). A rank listed in ``restart`` is started
again, once, as soon as its first process has exited (a replacement joining the running
group: :func:`life` tells the two apart); its result is the replacement's. The processes are
run by ``dist_utils.supervise``, as ``run_workers``'s are: results read while they run, a
process that overstays the timeout killed, a failed rank's traceback raised in the test.
:func:`wait_root_key` waits for a sync group's store key from outside the group;
:func:`long_transfer`, :func:`zeros_module` and :func:`held_version` are the weights, the
target and the check of the tests that kill a rank mid-transfer; :func:`publish_each` is the
trainer of a test that only publishes.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_utils import free_port, supervise, wait_for_key, worker_context
from torch import nn

from slipstream.sync.group import STORE_PREFIX


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

    def start(rank: int, life: int):
        p = ctx.Process(target=_entry, args=(fn, rank, port, args, results, life), daemon=True)
        p.start()
        return p

    out, _ = supervise(start, world_size, results, timeout, restart)
    missing = [r for r in range(world_size) if r not in out and r not in may_die]
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result")
    return out


def publish_each(group, rollouts, weights: Callable[[int], dict], versions, **options) -> None:
    """Rank 0's part as the only trainer: publish ``weights(v)`` for each version ``v`` to
    ``rollouts``, each delivered before the next, then close ``group``."""
    import slipstream as ss

    with ss.WeightPublisher(group, [0], list(rollouts), **options) as pub:
        for version in versions:
            pub.publish(weights(version), version=version).delivered.result(timeout=60)
    group.close()


def wait_root_key(port: int, key: str, timeout: float = 60.0) -> None:
    """Wait, from outside the sync group on ``port`` (a rank that has not joined it yet), for
    ``key`` to appear in its store."""
    tcp = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    store = dist.PrefixStore(STORE_PREFIX, tcp)
    wait_for_key(store, key, timeout, f"the sync group on port {port}")


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


def long_transfer(version: int) -> dict[str, torch.Tensor]:
    """About 3 MiB over some 50 buckets of 64 KiB: a transfer long enough to die in, each
    tensor's value naming its version."""
    return {f"t{i}": torch.full((20_000,), float(100 * version + i)) for i in range(40)}


def zeros_module(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> nn.Module:
    """A receive's target: a module whose buffers are zeros shaped like ``named``."""
    m = nn.Module()
    for name, t in named.items() if isinstance(named, Mapping) else named:
        m.register_buffer(name, torch.zeros_like(t))
    return m


def held_version(
    m: nn.Module, weights: Callable[[int], Mapping[str, torch.Tensor]], last: int
) -> int | None:
    """The one version (0 to ``last``) every buffer of ``m`` holds, or None for a mix."""
    for version in range(last + 1):
        if all(torch.equal(m.get_buffer(n), t) for n, t in weights(version).items()):
            return version
    return None
