"""Checkpoint benchmark: slipstream against torch.save, safetensors, DCP and torchsnapshot.

Every peer saves and loads the same state (``--gib`` of fp32 in ``--tensors`` tensors of
mixed sizes) in one invocation, interleaved after a warm-up (each round in a new seeded
order, see ``SHUFFLE_SEED``), and the medians of ``--repeats`` repetitions are reported
with their ratio to slipstream's. Next to them:
a warm memcpy and a raw fsync'd write of the same bytes (the floors are set against
those; the memcpy also runs in the rounds of the saves and loads, for per-round ratios),
peak memory of each peer measured in a fresh subprocess, a 1 -> 4 rank resharding
load, and the cost of checkpointing every step of the demo model's training loop.
The ``object_store`` section (``object_store.py``) does the same on S3, against a moto
server it starts, and on ``memory://``.

    python benchmarks/checkpoint.py               # every section, one result file
    python benchmarks/checkpoint.py --quick       # smoke test, ~1 min
    python benchmarks/checkpoint.py --sections local --out benchmarks/results/checkpoint.json
    python benchmarks/checkpoint.py --sections object_store \\
        --out benchmarks/results/object_store.json   # as `make bench` splits them
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slipstream.core.buffers import byte_view
from slipstream.core.threads import usable_cores

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    Result,
    Table,
    drop_page_cache,
    free_port,
    interleave,
    join_all,
    median,
)

MIB = 2**20
GIB = 2**30
COLUMNS = 256
SAVE_PEERS = [
    "torch.save",
    "safetensors",
    "dcp.save",
    "dcp.async_save",
    "dcp.async_save+DefaultStager",
    "torchsnapshot.take",
    "torchsnapshot.async_take",
    "ss.save",
    "ss.async_save",
    "slipstream.dcp.async_save",
]
#: Saves and loads run in a new order each round (see ``common.interleave``). In the fixed
#: order ss.async_save always came right after ss.save, at the end of nine 1 GiB writes in a
#: row, while the raw write came after a memcpy. On the development host ss.async_save then
#: took 1.7 - 1.9x the raw write's time in three of four rounds; with the order varied, the
#: same writes took 0.65 - 0.97x the raw write's in eight of eight.
SHUFFLE_SEED = 0
LOAD_PEERS = ["torch.load", "safetensors", "dcp.load", "ss.load", "ss.load (dcp-written)"]
SECTIONS = ("local", "object_store")


@dataclass
class BenchOptions:
    """What to measure, and how big."""

    gib: float = 1.0
    tensors: int = 256
    repeats: int = 3
    out: str = "benchmarks/results/checkpoint.json"
    workdir: str = "/tmp/slipstream-bench/checkpoint"
    quick: bool = False
    train_steps: int = 3
    train_batch: int = 4
    reshard_ranks: int = 4
    skip: tuple[str, ...] = ()
    """Optional parts left out: any of ``memory`` (peak RSS, in every section),
    ``reshard``, ``train``."""
    sections: tuple[str, ...] = SECTIONS
    """What runs: ``local`` (saves and loads on the local disk, with their memory,
    resharding and training-loop parts) and ``object_store`` (S3 on moto, memory://)."""
    object_store_gib: float = 0.5
    object_store_tensors: int = 128

    @property
    def nbytes(self) -> int:
        return int(self.gib * GIB)


# ---------------------------------------------------------------------------------------
# The state


def tensor_sizes(total_bytes: int, count: int) -> list[int]:
    """Element counts of ``count`` tensors summing to about ``total_bytes`` of fp32.

    Sizes follow a log-uniform spread over three decades (a few large matrices, many
    small vectors), each a whole number of ``COLUMNS``-wide rows, deterministic.
    """
    g = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.rand(count, generator=g, dtype=torch.float64) * math.log(1000.0))
    weights = weights / weights.sum()
    rows = [max(1, int(w * total_bytes / 4 / COLUMNS)) for w in weights.tolist()]
    return [r * COLUMNS for r in rows]


def make_state(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    """The benchmark's state dict: 2-D fp32 tensors of mixed sizes, filled and touched."""
    g = torch.Generator().manual_seed(1)
    state = {}
    for i, numel in enumerate(tensor_sizes(total_bytes, count)):
        t = torch.empty(numel // COLUMNS, COLUMNS)
        t.uniform_(-1, 1, generator=g)
        state[f"layer{i:04d}.weight"] = t
    return state


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destination tensors of the same shapes, every page touched once."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or every file of a directory and the directory itself."""
    path = os.fspath(path)
    if os.path.isfile(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    for d, _, names in os.walk(path):
        for name in names:
            fsync_path(os.path.join(d, name))
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def clear_before_timing(path: Path) -> None:
    """Delete a timed write's previous output and flush the filesystem, so that freeing
    its blocks (and, on a disk mounted with ``discard``, dropping them on the device) lands
    before the clock starts instead of in whichever timed fsync commits the journal next."""
    clear(path)
    os.sync()


# ---------------------------------------------------------------------------------------
# References: what the hardware can do with the same bytes


def memcpy_seconds(state: dict[str, torch.Tensor], flat: torch.Tensor, one_thread: bool) -> float:
    """Copy every tensor into an already-touched flat buffer, back to back.

    ``one_thread``: a plain ``memmove`` per tensor on this thread; otherwise
    ``Tensor.copy_`` with torch's default intra-op threads.
    """
    start = time.perf_counter()
    offset = 0
    for t in state.values():
        n = t.numel()
        dst = flat[offset : offset + n]
        if one_thread:
            ctypes.memmove(dst.data_ptr(), t.data_ptr(), n * t.element_size())
        else:
            dst.view(t.shape).copy_(t)
        offset += n
    return time.perf_counter() - start


def raw_write_seconds(buf: memoryview, path: Path) -> float:
    """One ``os.write`` of a preallocated buffer plus ``fsync`` into a fresh file, as every
    peer of the saves table writes (its target is cleared first): the disk's durable speed."""
    clear_before_timing(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(buf):
            done += os.write(fd, buf[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


#: A busy loop for one core: from the wall-clock instant argv[1] it counts loop turns
#: for argv[2] seconds and prints the count (no torch import, so it starts at once).
SPIN = """
import sys, time
start, seconds = float(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
end, turns = time.perf_counter() + seconds, 0
while time.perf_counter() < end:
    for _ in range(10_000):
        turns += 1
print(turns)
"""


def spin_turns(seconds: float, during: Callable[[float], Any] | None) -> tuple[int, Any]:
    """Loop turns of one busy process per usable core over ``seconds``, while ``during``
    (given the window's end, on ``time.perf_counter``'s clock) runs on this thread."""
    start = time.time() + 1.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SPIN, str(start), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(usable_cores())
    ]
    try:
        time.sleep(max(0.0, start - time.time()))
        got = during(time.perf_counter() + seconds) if during else None
        turns = sum(int(p.communicate(timeout=seconds + 60)[0]) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return turns, got


def direct_writes_until(path: Path, deadline: float) -> int:
    """Write 64 MiB pieces of random bytes with ``O_DIRECT`` (as slipstream's writers do),
    cycling over the first GiB of ``path``, until ``deadline`` (at least one piece, so a
    short window still measures something); fsync; return bytes written."""
    piece = mmap.mmap(-1, 64 * MIB)
    piece.write(os.urandom(len(piece)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    written = 0
    try:
        while True:
            written += os.pwrite(fd, piece, written % GIB)
            if time.perf_counter() >= deadline:
                break
        os.fsync(fd)
    finally:
        os.close(fd)
        piece.close()
    return written


def write_core_seconds_per_gib(workdir: Path, repeats: int, seconds: float = 6.0) -> float:
    """Core-seconds that durable writes take from cores that are all busy, per GiB written:
    busy loops on every core run alone and beside ``O_DIRECT`` writes, interleaved, and
    the turns they lose are charged to the bytes written (median over ``repeats``).

    It counts the guest kernel's work for the writes and, on a virtual machine, the time
    the hypervisor takes from the virtual CPUs to emulate the disk: the floor under what
    checkpointing can cost a training loop that keeps every core busy."""
    target = workdir / "write_cost.bin"
    cores = usable_cores()
    costs = []
    for _ in range(repeats):
        alone, _ = spin_turns(seconds, None)
        beside, written = spin_turns(seconds, lambda end: direct_writes_until(target, end))
        lost = cores * seconds * max(0.0, 1 - beside / alone)
        costs.append(lost / (written / GIB))
    clear(target)
    return median(costs)


# ---------------------------------------------------------------------------------------
# Savers: each returns blocked / staged / durable seconds of one save


class Stamp:
    """Seconds since ``start`` at which a future resolved (taken on the resolving thread)."""

    def __init__(self, fut: Future, start: float) -> None:
        self.at: float | None = None
        self.start = start
        self.fut = fut
        fut.add_done_callback(self._mark)

    def _mark(self, _fut: Future) -> None:
        self.at = time.perf_counter() - self.start

    def wait(self, timeout: float = 600.0) -> float:
        """The stamp, once the future has resolved and its callback has run."""
        self.fut.result(timeout)
        deadline = time.perf_counter() + timeout
        while self.at is None:
            if time.perf_counter() > deadline:
                raise TimeoutError("a future resolved but its done-callback never ran")
            time.sleep(0.0001)
        return self.at


def default_stager(stager, state: dict):
    """DCP's ``DefaultStager`` for the next save of ``state``: ``stager`` again (its pinned
    buffers are kept between saves), or a new one where there is none or it was closed.

    The options are DefaultStager()'s all-True ones less those that do not apply: on CPU the
    two that need an accelerator; on a GPU shared memory, which serves the process-based
    upload executor (this is the thread-based one). torch 2.11's ``async_save`` closes the
    stager it is given once the upload ends, and a closed stager fails its next save
    ("KeyError: <class 'type'>"): its copy table is emptied (a private field, read here).
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if stager is not None and stager._state_dict_stager._deepcopy_dispatch:
        return stager
    on_device = any(t.is_cuda for t in state.values() if torch.is_tensor(t))
    return DefaultStager(
        StagingOptions(use_shared_memory=False)
        if on_device
        else StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)
    )


class SavePeers:
    """One object per benchmark run, so per-peer state (stagers, savers) persists."""

    def __init__(self, state: dict[str, torch.Tensor], workdir: Path) -> None:
        self.state = state
        self.workdir = workdir
        self._stager = None

    def target(self, peer: str) -> Path:
        return self.workdir / "save" / peer.replace("+", "_").replace(" ", "_")

    def run(self, peer: str) -> dict[str, float]:
        path = self.target(peer)
        clear_before_timing(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fn = getattr(self, "_" + peer.replace(".", "_").replace("+", "_").replace(" ", "_"))
        return fn(path)

    def _sync(self, path: Path, save: Callable[[], None]) -> dict[str, float]:
        start = time.perf_counter()
        save()
        fsync_path(path)
        total = time.perf_counter() - start
        return {"blocked": total, "staged": total, "durable": total}

    def _torch_save(self, path: Path) -> dict[str, float]:
        return self._sync(path, lambda: torch.save(self.state, path))

    def _safetensors(self, path: Path) -> dict[str, float]:
        from safetensors.torch import save_file

        return self._sync(path, lambda: save_file(self.state, str(path)))

    def _dcp_save(self, path: Path) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        return self._sync(path, lambda: dcp.save(self.state, checkpoint_id=str(path)))

    def _dcp_async_save(self, path: Path) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        resp = dcp.async_save(self.state, checkpoint_id=str(path))
        blocked = time.perf_counter() - start
        upload = resp.upload_completion if hasattr(resp, "upload_completion") else resp
        durable = Stamp(upload, start).wait()
        return {"blocked": blocked, "staged": blocked, "durable": durable}

    def _dcp_async_save_DefaultStager(self, path: Path) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        self._stager = default_stager(self._stager, self.state)
        start = time.perf_counter()
        resp = dcp.async_save(self.state, checkpoint_id=str(path), async_stager=self._stager)
        blocked = time.perf_counter() - start
        staged = Stamp(resp.staging_completion, start)
        durable = Stamp(resp.upload_completion, start)
        return {"blocked": blocked, "staged": staged.wait(), "durable": durable.wait()}

    def _snapshot_state(self):
        from torchsnapshot import StateDict

        return {"state": StateDict(**self.state)}

    def _torchsnapshot_take(self, path: Path) -> dict[str, float]:
        from torchsnapshot import Snapshot

        app_state = self._snapshot_state()
        return self._sync(path, lambda: Snapshot.take(str(path), app_state))

    def _torchsnapshot_async_take(self, path: Path) -> dict[str, float]:
        from torchsnapshot import Snapshot

        app_state = self._snapshot_state()
        start = time.perf_counter()
        pending = Snapshot.async_take(str(path), app_state)
        blocked = time.perf_counter() - start
        pending.wait()
        fsync_path(path)
        durable = time.perf_counter() - start
        return {"blocked": blocked, "staged": blocked, "durable": durable}

    def _ss_save(self, path: Path) -> dict[str, float]:
        import slipstream as ss

        return self._sync(path, lambda: ss.save(self.state, checkpoint_id=path))

    def _ss_async_save(self, path: Path) -> dict[str, float]:
        import slipstream as ss

        start = time.perf_counter()
        resp = ss.async_save(self.state, checkpoint_id=path)
        blocked = time.perf_counter() - start
        staged = Stamp(resp.staging_completion, start)
        durable = Stamp(resp.upload_completion, start)
        return {"blocked": blocked, "staged": staged.wait(), "durable": durable.wait()}

    def _slipstream_dcp_async_save(self, path: Path) -> dict[str, float]:
        """The DCP stand-in's ``async_save``: it blocks until staged, as ``dcp.async_save``
        does, and returns a ``Future`` of the ``Metadata``."""
        import slipstream.dcp

        start = time.perf_counter()
        future = slipstream.dcp.async_save(self.state, checkpoint_id=str(path))
        blocked = time.perf_counter() - start
        durable = Stamp(future, start).wait()
        return {"blocked": blocked, "staged": blocked, "durable": durable}

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


# ---------------------------------------------------------------------------------------
# Loaders: into existing tensors (the resume path), warm or cold page cache


def load_source(peer: str, workdir: Path) -> Path:
    saved = {
        "torch.load": "torch.save",
        "safetensors": "safetensors",
        "dcp.load": "dcp.save",
        "ss.load": "ss.save",
        "ss.load (dcp-written)": "dcp.save",
    }[peer]
    return workdir / "save" / saved.replace("+", "_").replace(" ", "_")


def load_into(peer: str, path: Path, dest: dict[str, torch.Tensor]) -> None:
    """Load the checkpoint at ``path`` into the existing tensors of ``dest``."""
    if peer == "torch.load":
        loaded = torch.load(path, weights_only=True)
        for k, t in dest.items():
            t.copy_(loaded[k])
    elif peer == "safetensors":
        from safetensors.torch import load_file

        loaded = load_file(str(path))
        for k, t in dest.items():
            t.copy_(loaded[k])
    elif peer == "dcp.load":
        import torch.distributed.checkpoint as dcp

        dcp.load(dest, checkpoint_id=str(path))
    else:
        import slipstream as ss

        ss.load(dest, checkpoint_id=path)


def load_runner(peer: str, workdir: Path, dest: dict, cold: bool) -> Callable[[int], dict]:
    path = load_source(peer, workdir)

    def run(_rep: int) -> dict[str, float]:
        if cold:
            drop_page_cache([path])
        start = time.perf_counter()
        load_into(peer, path, dest)
        return {"seconds": time.perf_counter() - start}

    return run


# ---------------------------------------------------------------------------------------
# Peak memory, each peer in a fresh process


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> float:
    """Reset this process's peak RSS (VmHWM) to its current RSS, and return that in MiB.

    ``getrusage``'s ``ru_maxrss`` survives ``fork`` + ``exec`` (a child started from a big
    parent reports the parent's peak), so peaks here come from ``/proc/self/status``.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mib("VmRSS")


def child_memory(kind: str, peer: str, opts: BenchOptions) -> dict[str, float]:
    """In a fresh process: build the state, then save (twice) or load once; report MiB.

    ``growth`` is the peak resident memory minus the resident memory once the state
    (and, for loads, the destination tensors) exist: what the peer itself allocated.
    """
    state = make_state(opts.nbytes, opts.tensors)
    workdir = Path(opts.workdir) / "memory"
    if kind == "save":
        peers = SavePeers(state, workdir)
        base = reset_peak_rss()
        for _ in range(2):
            peers.run(peer)
        peers.close()
    else:
        dest = empty_like_state(state)
        del state
        base = reset_peak_rss()
        load_into(peer, load_source(peer, Path(opts.workdir)), dest)
    return {"growth": _status_mib("VmHWM") - base}


# ---------------------------------------------------------------------------------------
# Resharding: saved by 1 rank, loaded by N ranks into DTensor Shard(0) targets


def reshard_rank(rank: int, world: int, port: int, opts: BenchOptions, queue) -> None:
    """One rank: load the 1-rank checkpoint into Shard(0) DTensors with each loader."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import empty as dtensor_empty

    import slipstream as ss

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        shapes = [(n // COLUMNS, COLUMNS) for n in tensor_sizes(opts.nbytes, opts.tensors)]
        dest = {
            f"layer{i:04d}.weight": dtensor_empty(shape, device_mesh=mesh, placements=[Shard(0)])
            for i, shape in enumerate(shapes)
        }
        for t in dest.values():
            t.to_local().zero_()
        path = str(Path(opts.workdir) / "save" / "ss.save")
        loaders = {
            "dcp.load": lambda: dcp.load(dest, checkpoint_id=path),
            "ss.load": lambda: ss.load(dest, checkpoint_id=path),
        }
        times: dict[str, list[float]] = {name: [] for name in loaders}
        # twice the repetitions: a round takes seconds, and four ranks on a small host
        # make single rounds noisy
        for rep in range(1 + 2 * opts.repeats):
            for name, fn in loaders.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep > 0:
                    times[name].append(float(elapsed))
        if rank == 0:
            queue.put(times)
    finally:
        dist.destroy_process_group()


def spawn_ranks(target: Callable, world: int, opts: BenchOptions, timeout: float) -> Any:
    """Run ``target(rank, world, port, opts, queue)`` in ``world`` spawned processes joined
    over gloo on a free port; return what rank 0 puts on the queue (within ``timeout``
    seconds). Every process is joined, and killed if it does not exit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, opts, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        join_all(procs)


# ---------------------------------------------------------------------------------------
# Training-loop overhead of checkpointing every step (demo model, one thread)


#: slipstream saves through a saver whose threads run under SCHED_IDLE
IDLE = "ss.async_save, idle threads"
#: slipstream saves into new files each step, deleting the retired step's files
NEW_FILES = "ss.async_save, new files (reuse_files=False)"
TRAIN_MODES = ["none", "ss.async_save", "dcp.async_save"]
TWO_RANK_MODES = ["none", "ss.async_save", NEW_FILES, IDLE]


def train_child(opts: BenchOptions) -> dict[str, list[float]]:
    """Step times of the demo model in this one process (one compute thread), with no
    checkpoint, ss.async_save, dcp.async_save (see :func:`interleaved_steps`)."""
    from slipstream.demo.model import ModelConfig, build_model

    torch.set_num_threads(1)
    cfg = ModelConfig.tiny() if opts.quick else ModelConfig()
    model = build_model(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    times = interleaved_steps(opts, cfg, model, optim, state, 0, TRAIN_MODES)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state()))
    return {**times, "checkpoint_bytes": [float(nbytes)]}


def train_ranks_child(rank: int, world: int, port: int, opts: BenchOptions, queue) -> None:
    """One of the demo's two training ranks (slipstream FSDP over gloo, one compute thread
    each, so with 2 cores no core is spare), running :func:`interleaved_steps`; rank 0
    puts the step times on ``queue``. No dcp.async_save here: DCP's stager deep-copies each
    DTensor, and in torch 2.13 that fails for one whose local tensor starts past offset 0
    of its storage, as the shards of slipstream's flat parameter buffers do
    ("Attempted to call copy_() on an invalid python storage")."""
    import torch.distributed as dist

    from slipstream.demo.model import ModelConfig, build_model
    from slipstream.demo.train import TrainState, join_training_group, shard_model

    join_training_group(rank, world, port)
    try:
        cfg = ModelConfig.tiny() if opts.quick else ModelConfig()
        model = build_model(cfg, seed=0)
        shard_model(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train = TrainState(model, optim)

        def state() -> dict:
            return {"train": train}

        times = interleaved_steps(opts, cfg, model, optim, state, rank, TWO_RANK_MODES)
        dist.barrier()
        if rank == 0:
            queue.put(times)
    finally:
        dist.destroy_process_group()


def interleaved_steps(
    opts: BenchOptions,
    cfg,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    state: Callable[[], dict],
    rank: int,
    modes: list[str],
) -> dict[str, list[float]]:
    """Step times of ``model`` in each of ``modes`` (of ``TRAIN_MODES``, ``NEW_FILES`` and
    ``IDLE``): no checkpoint, a slipstream save (through an ``ss.Checkpointer`` with
    ``keep_last=2``, a new directory each step and the oldest retired once a newer one
    commits, as the demo saves; by default writing over the retired step's files, or into
    new files with ``reuse_files=False``, or with idle saver threads) or dcp.async_save of
    ``state()`` every step (over one of two directories in turn).

    Each step: forward + backward, wait for the previous save's staging, optimizer step,
    then start this step's save. DCP gets the same one-save-in-flight rule slipstream
    applies itself (wait for the previous upload before starting a new save). Modes run
    in interleaved blocks of ``train_steps`` steps, ``train_rounds(opts)`` rounds after a
    warm-up round; each block ends once its last save is durable, so no save's cost
    spills into another mode's block. A block's first step is not counted: every counted
    step runs beside the previous step's save, as in a long run. Returns, per mode, each
    counted step's time (``<mode>``), the training thread's CPU time (``<mode>/cpu``)
    and the time spent in the save call and the wait for staging (``<mode>/stall``).
    """
    import torch.distributed.checkpoint as dcp

    import slipstream as ss
    from slipstream.demo.model import batch

    workdir = Path(opts.workdir) / "train"
    savers = {
        mode: ss.Checkpointer(
            workdir / mode.replace(" ", "_"),
            keep_last=2,
            options=ss.SaveOptions(idle_threads=mode == IDLE),
            reuse_files=mode != NEW_FILES,
        )
        for mode in modes
        if mode.startswith("ss.")
    }
    kinds = ("", "/cpu", "/stall")
    times: dict[str, list[float]] = {m + k: [] for m in modes for k in kinds}
    pending: dict[str, Any] = {}
    step = 0

    def save(mode: str) -> Any:
        if mode in savers:
            return savers[mode].save(step, state())
        path = workdir / mode / str(step % 2)
        previous = pending.get(mode)
        if previous is not None:
            previous.result(600)
        return dcp.async_save(state(), checkpoint_id=str(path))

    def staged(mode: str) -> None:
        fut = pending.get(mode)
        if fut is not None and hasattr(fut, "staging_completion"):
            fut.staging_completion.result(600)

    def durable(mode: str) -> None:
        fut = pending.pop(mode, None)
        if fut is not None:
            getattr(fut, "upload_completion", fut).result(600)

    for rnd in range(1 + train_rounds(opts)):
        for mode in modes:
            for i in range(opts.train_steps):
                start, cpu_start = time.perf_counter(), time.thread_time()
                loss = model.loss(batch(step, rank, opts.train_batch, cfg))
                loss.backward()
                stall_start = time.perf_counter()
                staged(mode)
                stall = time.perf_counter() - stall_start
                optim.step()
                optim.zero_grad(set_to_none=False)
                if mode != "none":
                    stall_start = time.perf_counter()
                    pending[mode] = save(mode)
                    stall += time.perf_counter() - stall_start
                step += 1
                if rnd > 0 and i > 0:
                    times[mode].append(time.perf_counter() - start)
                    times[mode + "/cpu"].append(time.thread_time() - cpu_start)
                    times[mode + "/stall"].append(stall)
            durable(mode)
    for saver in savers.values():
        saver.close()
    return times


def train_rounds(opts: BenchOptions) -> int:
    """Rounds of the training-loop measurement: steps of about a second each make few
    samples per round, and a round's ratio moves by several percent on a noisy host, so it
    runs six times the repetitions."""
    return 6 * opts.repeats


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def child_json(spec: str, opts: BenchOptions) -> dict:
    cmd = [sys.executable, __file__, "--child", spec, "--options", json.dumps(asdict(opts))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# Orchestration


def ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else float("nan")


def measure_references(state: dict, repeats: int) -> dict[str, float]:
    """Warm memcpy of the state's bytes two ways, interleaved, medians (the raw write is
    timed beside the saves instead: see :func:`measure_saves`).

    ``memcpy`` is the faster of the two copies (the stricter reference for the floors).
    """
    flat = torch.zeros(state_bytes(state) // 4)
    got = interleave(
        {
            "memcpy, torch copy_": lambda _r: {"seconds": memcpy_seconds(state, flat, False)},
            "memcpy, one thread": lambda _r: {"seconds": memcpy_seconds(state, flat, True)},
        },
        repeats,
    )
    refs = {name: median(m["seconds"]) for name, m in got.items()}
    refs["memcpy"] = min(refs["memcpy, torch copy_"], refs["memcpy, one thread"])
    return refs


MEMCPY = "warm memcpy"


def memcpy_runner(state: dict) -> Callable[[int], dict]:
    """The faster of the two warm copies of the state, run as a peer in the same rounds as
    the saves or loads it is the reference of."""
    flat = torch.zeros(state_bytes(state) // 4)

    def run(_rep: int) -> dict[str, float]:
        copies = [memcpy_seconds(state, flat, one_thread) for one_thread in (False, True)]
        return {"seconds": min(copies)}

    return run


RAW_WRITE = "raw write + fsync"


def raw_write_runner(state: dict, workdir: Path) -> Callable[[int], dict]:
    """A raw fsync'd write of the state's bytes into a fresh file, run as a peer in the same
    rounds as the saves it is the reference of."""
    image = torch.empty(state_bytes(state), dtype=torch.uint8)
    image.fill_(7)
    target = workdir / "save" / "raw.bin"

    def run(_rep: int, image: torch.Tensor = image) -> dict[str, float]:
        return {"seconds": raw_write_seconds(byte_view(image), target)}

    return run


def per_round(numerator: list[float], reference: list[float]) -> float:
    """Median over rounds of a peer's time over the reference timed in the same round."""
    return median([a / b for a, b in zip(numerator, reference, strict=True)])


def measure_saves(state: dict, workdir: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Medians per save peer; ``ss.async_save`` also gets ``staged/memcpy`` and
    ``durable/raw``, medians of per-round ratios to the memcpy and the raw write run in the
    same rounds."""
    peers = SavePeers(state, workdir)
    (workdir / "save").mkdir(parents=True, exist_ok=True)
    runners = {p: (lambda _r, p=p: peers.run(p)) for p in SAVE_PEERS}
    runners[MEMCPY] = memcpy_runner(state)
    runners[RAW_WRITE] = raw_write_runner(state, workdir)
    try:
        got = interleave(runners, repeats, shuffle_seed=SHUFFLE_SEED)
    finally:
        peers.close()
    out = {p: {k: median(v) for k, v in m.items()} for p, m in got.items()}
    ss_async = got["ss.async_save"]
    out["ss.async_save"]["staged/memcpy"] = per_round(ss_async["staged"], got[MEMCPY]["seconds"])
    out["ss.async_save"]["durable/raw"] = per_round(ss_async["durable"], got[RAW_WRITE]["seconds"])
    return out


RAW_READ = "raw pread of the ss data file, one thread (reference)"


def raw_read_runner(workdir: Path, cold: bool) -> Callable[[int], dict]:
    """``preadv`` of slipstream's data file into a touched buffer: the kernel's read speed."""
    path = load_source("ss.load", workdir) / "__0_0.distcp"
    buf = torch.ones(path.stat().st_size, dtype=torch.uint8)
    view = byte_view(buf)
    piece = 64 * MIB

    def run(_rep: int, buf: torch.Tensor = buf) -> dict[str, float]:
        """(``buf`` is bound here so the memory ``view`` points into stays alive.)"""
        if cold:
            drop_page_cache([path])
        start = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(0, len(view), piece):
                os.preadv(fd, [view[offset : offset + piece]], offset)
        finally:
            os.close(fd)
        return {"seconds": time.perf_counter() - start}

    return run


def measure_loads(state: dict, workdir: Path, repeats: int) -> dict[str, dict[str, float]]:
    dest = empty_like_state(state)
    out: dict[str, dict[str, float]] = {p: {} for p in [*LOAD_PEERS, RAW_READ]}
    for cold in (False, True):
        runners = {p: load_runner(p, workdir, dest, cold) for p in LOAD_PEERS}
        runners[RAW_READ] = raw_read_runner(workdir, cold)
        if not cold:
            runners[MEMCPY] = memcpy_runner(state)
        got = interleave(runners, repeats, shuffle_seed=SHUFFLE_SEED)
        for p in [*LOAD_PEERS, RAW_READ]:
            out[p]["cold" if cold else "warm"] = median(got[p]["seconds"])
        if not cold:
            out["ss.load"]["warm/memcpy"] = per_round(
                got["ss.load"]["seconds"], got[MEMCPY]["seconds"]
            )
    for k, t in dest.items():
        if not torch.equal(t, state[k]):
            raise AssertionError(f"a loader got {k} wrong")
    return out


def save_table(saves: dict, memory: dict) -> Table:
    ref = saves["ss.async_save"]
    rows = []
    for p in SAVE_PEERS:
        m = saves[p]
        rows.append(
            [
                p,
                m["blocked"],
                m["staged"],
                m["durable"],
                ratio(m["blocked"], ref["blocked"]),
                ratio(m["durable"], ref["durable"]),
                memory.get(("save", p), ""),
            ]
        )
    memcpy, raw = saves[MEMCPY]["seconds"], saves[RAW_WRITE]["seconds"]
    rows.append(["warm memcpy, faster of two (reference)", "", memcpy, "", "", "", ""])
    rows.append(["raw write + fsync (reference)", "", "", raw, "", "", ""])
    return Table(
        "Saves (steady state; seconds, medians; x = peer / ss.async_save)",
        ["peer", "blocked s", "staged s", "durable s", "blocked x", "durable x", "peak RSS +MiB"],
        rows,
    )


def load_table(loads: dict, memory: dict, refs: dict) -> Table:
    ref = loads["ss.load"]
    rows = [
        [
            p,
            loads[p]["warm"],
            loads[p]["cold"],
            ratio(loads[p]["warm"], ref["warm"]),
            ratio(loads[p]["cold"], ref["cold"]),
            memory.get(("load", p), ""),
        ]
        for p in [*LOAD_PEERS, RAW_READ]
    ]
    rows.append(["warm memcpy, faster of two (reference)", refs["memcpy"], "", "", "", ""])
    return Table(
        "Loads into existing tensors (seconds, medians; x = peer / ss.load)",
        ["peer", "warm s", "cold s", "warm x", "cold x", "peak RSS +MiB"],
        rows,
    )


def record_floors(result: Result, saves: dict, loads: dict, extra: dict) -> None:
    ss_async, dcp_async = saves["ss.async_save"], saves["dcp.async_save"]
    blocked = ratio(ss_async["blocked"], dcp_async["blocked"])
    result.floor("caller blocked / dcp.async_save's", blocked, "<= 0.05", blocked <= 0.05)
    stand_in = ratio(saves["slipstream.dcp.async_save"]["blocked"], dcp_async["blocked"])
    result.floor(
        "slipstream.dcp.async_save blocked (until staged) / dcp.async_save's",
        stand_in,
        "<= 1",
        stand_in <= 1,
    )
    staged = ss_async["staged/memcpy"]
    result.floor("staged / warm memcpy of the same bytes", staged, "<= 2", staged <= 2)
    durable = ss_async["durable/raw"]
    result.floor("durable / raw fsync'd write of the same bytes", durable, "<= 1.2", durable <= 1.2)
    vs_dcp = ratio(loads["dcp.load"]["warm"], loads["ss.load"]["warm"])
    result.floor("warm load: dcp.load / ss.load", vs_dcp, ">= 2", vs_dcp >= 2)
    vs_copy = loads["ss.load"]["warm/memcpy"]
    result.floor("warm load: ss.load / warm memcpy", vs_copy, "<= 1.5", vs_copy <= 1.5)
    if "reshard" in extra:
        r = extra["reshard"]
        speedup = ratio(r["dcp.load"], r["ss.load"])
        result.floor("1 -> 4 rank load: dcp.load / ss.load", speedup, ">= 3", speedup >= 3)
    for label, overheads in extra.get("train", {}).items():
        overhead = overheads["ss.async_save"]
        result.floor(
            f"checkpoint every step of the demo model: step time overhead % ({label})",
            overhead,
            "<= 5",
            overhead <= 5,
        )


def run_reshard(result: Result, opts: BenchOptions, extra: dict) -> None:
    times = spawn_ranks(reshard_rank, opts.reshard_ranks, opts, 900)
    med = {k: median(v) for k, v in times.items()}
    extra["reshard"] = med
    result.tables.append(
        Table(
            f"Resharding load: saved by 1 rank, loaded by {opts.reshard_ranks} ranks into "
            f"DTensor Shard(0) (gloo, 127.0.0.1; seconds of the slowest rank, warm cache, "
            f"median of {2 * opts.repeats} rounds)",
            ["loader", "seconds", "x (/ ss.load)"],
            [[k, v, ratio(v, med["ss.load"])] for k, v in med.items()],
        )
    )


ONE_PROCESS = "one process, a core to spare"
TWO_RANKS = "2 ranks, FSDP, one core each (the demo's setup)"


def run_train(result: Result, opts: BenchOptions, extra: dict) -> None:
    """Per-mode step times, and the overhead of each mode as the median over rounds of its
    median step against the no-checkpoint block of the same round (the host's drift between
    rounds cancels; each round runs the modes back to back): in one process with a core to
    spare, and on the demo's two FSDP ranks, which share the host's two cores."""
    per_round = opts.train_steps - 1
    rounds = train_rounds(opts)
    rows = []
    runs = {
        ONE_PROCESS: child_json("train", opts),
        TWO_RANKS: spawn_ranks(train_ranks_child, 2, opts, 1800),
    }
    checkpoint_bytes = runs[ONE_PROCESS]["checkpoint_bytes"][0]
    mb = checkpoint_bytes / 1e6
    seconds = 1.0 if opts.quick else 6.0
    write_cost = write_core_seconds_per_gib(Path(opts.workdir), opts.repeats, seconds)
    extra["write_cost"] = {
        "core_seconds_per_gib": write_cost,
        "checkpoint_bytes": checkpoint_bytes,
        "two_rank_step": median(runs[TWO_RANKS]["none"]),
    }
    for label, got in runs.items():

        def round_medians(mode: str, got: dict = got) -> list[float]:
            steps = got[mode]
            return [median(steps[r * per_round : (r + 1) * per_round]) for r in range(rounds)]

        base = round_medians("none")
        overheads = {}
        for mode in [m for m in [*TRAIN_MODES, NEW_FILES, IDLE] if m in got]:
            paired = [m / b for m, b in zip(round_medians(mode), base, strict=True)]
            overheads[mode] = 100 * (median(paired) - 1)
            cpu, stall = median(got[mode + "/cpu"]), 1000 * median(got[mode + "/stall"])
            extra.setdefault("train_detail", {}).setdefault(label, {})[mode] = {
                "cpu": cpu,
                "stall": stall,
            }
            row = [label, mode, median(got[mode]), overheads[mode], cpu, stall, len(got[mode])]
            rows.append(row)
        extra.setdefault("train", {})[label] = overheads
    result.tables.append(
        Table(
            f"Checkpoint every step, demo model ({mb:.0f} MB with AdamW state, batch "
            f"{opts.train_batch}, torch.set_num_threads(1)): {rounds} rounds of interleaved "
            f"blocks of {opts.train_steps} steps per mode; step s and CPU are medians over "
            "the counted steps, overhead the median over rounds of the step time against "
            "the same round's no-checkpoint block. The ss rows save through "
            "ss.Checkpointer(keep_last=2), a new directory each step, as the demo does. "
            f"'{TWO_RANKS}': the state is sharded "
            "over two processes that share the host's two cores, each saving its half (no "
            "dcp.async_save row: see docs/fsdp.md)",
            [
                "environment",
                "checkpointing",
                "step s",
                "overhead %",
                "train thread CPU s / step",
                "stall ms / step",
                "steps counted",
            ],
            rows,
        )
    )


def memory_figures(opts: BenchOptions) -> dict[tuple[str, str], float]:
    """Peak RSS growth of each peer in its own process (``--quick``: slipstream's only)."""
    saves = ["ss.async_save"] if opts.quick else SAVE_PEERS
    loads = ["ss.load"] if opts.quick else LOAD_PEERS
    out = {("save", p): child_memory_or_nan("save", p, opts) for p in saves}
    out.update({("load", p): child_memory_or_nan("load", p, opts) for p in loads})
    return out


def child_memory_or_nan(kind: str, peer: str, opts: BenchOptions) -> float:
    try:
        return child_json(f"memory:{kind}:{peer}", opts)["growth"]
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return float("nan")


def plot(saves: dict, path: Path) -> str | None:
    """A bar chart of blocked / staged / durable per peer, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [n for n in saves if "blocked" in saves[n]]  # the raw write is the dashed line
    for i, metric in enumerate(("blocked", "staged", "durable")):
        ax.barh(
            [j + 0.27 * i for j in range(len(names))],
            [saves[n][metric] for n in names],
            height=0.27,
            label=metric,
        )
    ax.axvline(saves[RAW_WRITE]["seconds"], color="k", ls="--", lw=1, label="raw write + fsync")
    ax.set_yticks([j + 0.27 for j in range(len(names))], names)
    ax.set_xlabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def run(opts: BenchOptions) -> Result:
    workdir = Path(opts.workdir)
    clear(workdir)
    workdir.mkdir(parents=True)
    if "local" in opts.sections:
        result = Result(
            "checkpoint",
            "asynchronous checkpoints: slipstream vs torch.save, safetensors, DCP, torchsnapshot",
        )
    else:
        result = Result(
            "object_store",
            "checkpoints on object storage: slipstream vs DCP (s3fs, fsspec memory), "
            "torchsnapshot and raw boto3 on a local S3 (moto), and memory://",
        )
    result.note_load("start")
    if "local" in opts.sections:
        run_local(result, opts)
    if "object_store" in opts.sections:
        import object_store

        object_store.run_section(result, opts)
    result.note_load("end")
    clear(workdir)
    return result


def run_local(result: Result, opts: BenchOptions) -> None:
    """The local disk: saves, loads, references, and the memory, resharding and training-loop
    parts not skipped; the saves and loads tables go first in ``result``."""
    workdir = Path(opts.workdir)
    state = make_state(opts.nbytes, opts.tensors)
    sizes = sorted(t.numel() * 4 for t in state.values())
    result.setup.update(
        {
            "state": f"{state_bytes(state) / GIB:.2f} GiB fp32 in {len(state)} tensors "
            f"({sizes[0] / 1024:.0f} KiB - {sizes[-1] / MIB:.0f} MiB)",
            "repetitions": f"1 warm-up + {opts.repeats}, interleaved, saves and loads in a "
            f"new order each round (seed {SHUFFLE_SEED}), medians",
            "directory": str(workdir.resolve()),
        }
    )
    first_table = len(result.tables)
    print("references ...", flush=True)
    refs = measure_references(state, opts.repeats)
    print("saves ...", flush=True)
    saves = measure_saves(state, workdir, opts.repeats)
    print("loads ...", flush=True)
    loads = measure_loads(state, workdir, opts.repeats)
    del state
    memory: dict = {}
    if "memory" not in opts.skip:
        print("memory ...", flush=True)
        memory = memory_figures(opts)
    extra: dict = {}
    if "reshard" not in opts.skip:
        print("resharding ...", flush=True)
        run_reshard(result, opts, extra)
    if "train" not in opts.skip:
        print("training loop ...", flush=True)
        run_train(result, opts, extra)
    result.tables[first_table:first_table] = [
        save_table(saves, memory),
        load_table(loads, memory, refs),
    ]
    result.tables.append(
        Table(
            "References (same bytes, medians)",
            ["what", "seconds", "GiB/s"],
            [[k, v, opts.nbytes / GIB / v] for k, v in refs.items() if k != "memcpy"],
        )
    )
    record_floors(result, saves, loads, extra)
    result.notes += NOTES
    result.notes += measured_notes(loads, refs, extra)
    figure = plot(saves, Path(opts.out).with_suffix(".png"))
    if figure:
        result.notes.append(f"Figure: `{figure}`.")


NOTES = [
    "blocked: time until the call returned; staged: until the caller may mutate the state "
    "(equal to blocked for peers that stage on the caller's thread); durable: until the "
    "data is fsync'd and committed (torch.save, safetensors and torchsnapshot get an explicit "
    "fsync of what they wrote, timed). Peak RSS +MiB: peak resident memory of a fresh process "
    "minus its resident memory once the state exists, over a warm-up and a steady-state save "
    "(loads: one load into existing tensors).",
    "Loads go into existing, already-touched tensors (the resume path): torch.load and "
    "safetensors load whole then copy_; cold means the checkpoint files were evicted from "
    "the page cache (fsync + POSIX_FADV_DONTNEED) before each repetition.",
]


def measured_notes(loads: dict, refs: dict, extra: dict) -> list[str]:
    """What the reference measurements say about the floors, in this run's numbers."""
    raw = loads[RAW_READ]["warm"]
    notes = [
        f"Reading alone: one thread's pread of slipstream's data file from a warm page cache "
        f"(no checksum, no copy to the destination beyond the kernel's) took {raw:.3f} s, "
        f"{raw / refs['memcpy']:.2f}x the warm memcpy; ss.load took "
        f"{loads['ss.load']['warm']:.3f} s, {loads['ss.load']['warm'] / raw:.2f}x that read. "
        "ss.load reads with one thread more than the cores and verifies an xxh3 checksum "
        "of every 1 MiB block right after reading it.",
        "The floors against a reference (staged and warm load against a memcpy, durable "
        "against a raw write) are medians of per-round ratios: the reference runs as a peer "
        "in the same interleaved rounds as the saves or the warm loads, so a host that copies "
        "or writes faster or slower in one phase moves both sides of the ratio. Every timed "
        "write starts after its previous output is deleted and the filesystem flushed, so "
        "freeing those blocks is not charged to whichever peer commits the journal next. "
        "Each round runs the peers in a new order: on this host a write's time depends on "
        "what ran just before it, and in a fixed order that cost fell on the same peers "
        "every round. "
        "The References table is a separate phase, and its memcpy can differ from the one "
        "beside the saves and loads.",
    ]
    for label, detail in extra.get("train_detail", {}).items():
        none, ss_ = detail["none"], detail["ss.async_save"]
        notes.append(
            f"Training loop ({label}): the training thread's own CPU time per step was "
            f"{none['cpu']:.3f} s without checkpoints and {ss_['cpu']:.3f} s with "
            f"ss.async_save every step, which stalled the loop {ss_['stall']:.1f} ms per step "
            "(the save call plus the wait for staging). Wall time beyond that is time the "
            "machine's other runnable threads took from the training thread."
        )
    if "write_cost" in extra:
        w = extra["write_cost"]
        per_step = w["core_seconds_per_gib"] * w["checkpoint_bytes"] / GIB
        cores = usable_cores()
        share = 100 * per_step / (cores * w["two_rank_step"])
        notes.append(
            f"What the disk charges: durable O_DIRECT writes took "
            f"{w['core_seconds_per_gib']:.2f} core-s per GiB written from cores that were all "
            "busy (busy loops on every core, beside the writes against alone, median of "
            "the repetitions): the guest kernel's share and, on a virtual machine, the time "
            "the hypervisor takes from the virtual CPUs to emulate the disk. Writing the "
            f"demo's {w['checkpoint_bytes'] / 1e6:.0f} MB every step therefore takes "
            f"{1000 * per_step:.0f} core-ms a step, {share:.1f}% of the {cores} cores over "
            f"the two ranks' {w['two_rank_step']:.3f} s step without checkpoints: the floor "
            "under the two-rank overhead before slipstream copies or hashes a byte."
        )
    return notes


def child_main(spec: str, opts: BenchOptions) -> None:
    if spec == "train":
        out = train_child(opts)
    elif spec.startswith("object_store:"):
        import object_store

        _, kind, peer = spec.split(":", 2)
        out = object_store.child_memory(kind, peer, opts)
    else:
        _, kind, peer = spec.split(":", 2)
        out = child_memory(kind, peer, opts)
    print(json.dumps(out))


def parse() -> tuple[BenchOptions, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the state in GiB")
    p.add_argument("--tensors", type=int, default=256, help="number of tensors")
    p.add_argument("--repeats", type=int, default=3, help="repetitions after the warm-up")
    p.add_argument("--out", default="benchmarks/results/checkpoint.json")
    p.add_argument("--workdir", default="/tmp/slipstream-bench/checkpoint", help="scratch dir")
    p.add_argument("--skip", default="", help="comma list of parts: memory,reshard,train")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma list of sections to run: local (the disk), object_store (S3 on a "
        "local moto server, memory://); default both",
    )
    p.add_argument("--object-store-gib", type=float, default=0.5, help="object store section: GiB")
    p.add_argument(
        "--object-store-tensors", type=int, default=128, help="object store section: tensors"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a ~30 s smoke test")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--options", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.options:
        return BenchOptions(**json.loads(args.options)), args.child
    opts = BenchOptions(args.gib, args.tensors, args.repeats, args.out, args.workdir)
    opts.skip = tuple(s for s in args.skip.split(",") if s)
    opts.sections = tuple(s for s in args.sections.split(",") if s)
    unknown = set(opts.sections) - set(SECTIONS)
    if unknown or not opts.sections:
        p.error(f"--sections: choose from {', '.join(SECTIONS)} (got {args.sections!r})")
    opts.object_store_gib, opts.object_store_tensors = (
        args.object_store_gib,
        args.object_store_tensors,
    )
    name = "checkpoint" if "local" in opts.sections else "object_store"
    if args.quick:
        opts.gib, opts.tensors, opts.repeats, opts.quick = 0.03, 24, 1, True
        opts.object_store_gib, opts.object_store_tensors = 0.03, 24
        opts.train_steps, opts.train_batch = 2, 1
        if args.out == p.get_default("out"):
            opts.out = f"/tmp/slipstream-bench/{name}_quick.json"
    elif args.out == p.get_default("out"):
        opts.out = f"benchmarks/results/{name}.json"
    return opts, args.child


def main() -> None:
    opts, child = parse()
    if child:
        child_main(child, opts)
        return
    result = run(opts)
    result.write(opts.out)


if __name__ == "__main__":
    main()
