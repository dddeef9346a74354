"""Read-once loads: 4 data-parallel replicas loading one checkpoint, today's way and read-once.

One checkpoint (``--size-mib`` of fp32 tensors, ``--tensors`` of them, saved by one process)
on a moto S3 server (``tests/storage_server.py``, 127.0.0.1), on the local disk, and on a shared
file system of as many hosts as ranks, emulated on this one (``emulated_hosts.py``: an ext4 image
that each rank mounts read-only through its own direct-I/O loop device, in its own mount
namespace, so each has its own page cache and all read the one disk; needs root). ``--where``
picks among them. ``--ranks`` processes joined by a gloo group each load the whole state, as DDP
replicas do:

- **every rank reads all** (today): what ``ss.load`` on a group did before read-once, run
  through the same internals: each rank's ``loader.load`` inside one round of the group's
  load agreement;
- **read-once**: ``ss.load`` on the group: each rank reads about 1/ranks of the bytes and the
  parts are exchanged over slipstream's gloo group.

Every load counts the bytes it reads through a wrapper of the storage backend (for S3, the
bytes of the GET bodies the server sent). Before every load from a disk every rank evicts the
checkpoint's files from its page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``; on one host
the ranks share one, on the emulated hosts each has its own), so reads come from the disk.
The two ways alternate in a new seeded order each round, after a warm-up of each; a load's
time is its slowest rank's (the job resumes when all have loaded), medians over
``--repeats``. Every loaded state is compared with the saved one.

python benchmarks/read_once.py --out benchmarks/results/read_once.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
from functools import partial
from pathlib import Path

import emulated_hosts
import torch
import torch.distributed as dist
from common import Result, Table, drop_page_cache, fmt, join_all, median, scratch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from storage_server import CREDENTIALS, UNSET, moto_server  # noqa: E402

import slipstream as ss  # noqa: E402
from slipstream.checkpoint.agreement import agreement_for  # noqa: E402
from slipstream.checkpoint.api import _saver  # noqa: E402
from slipstream.checkpoint.load import loader  # noqa: E402
from slipstream.checkpoint.storage import (  # noqa: E402
    DataWriter,
    LocalStorage,
    Storage,
    resolve_storage,
)
from slipstream.core import tracing  # noqa: E402

MIB = 1 << 20
BUCKET = "slipstream-read-once"
TODAY = "every rank reads all (today)"
READ_ONCE = "read-once"
WAYS = (TODAY, READ_ONCE)
S3 = "S3 (moto)"
LOCAL = "local disk, cold page cache"
WHERE = ("s3", "local", "hosts")


def hosts_name(ranks: int) -> str:
    return f"shared file system, {ranks} hosts (emulated)"


SHUFFLE_SEED = 56
STORAGE_OPTIONS = {"client_options": {"timeout": "600s"}}
"""On S3 one GET may take long: today's way has 4 x 16 ranged GETs of up to 64 MiB in flight at
once, more than one moto server on a shared host answers within the default 30 s."""
RESULT_TIMEOUT_S = 3600


class CountingStorage(Storage):
    """``inner`` with every byte it reads for a load counted (reads of checkpoint data)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.small_reads_are_cheap = inner.small_reads_are_cheap
        self.splits_shared_reads = inner.splits_shared_reads
        self.nbytes = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self.nbytes += n

    def take(self) -> int:
        with self._lock:
            n, self.nbytes = self.nbytes, 0
        return n

    def child(self, name: str) -> Storage:
        return CountingStorage(self.inner.child(name))

    def prepare(self) -> None:
        self.inner.prepare()

    def open_writer(self, name: str, image: memoryview) -> DataWriter:
        return self.inner.open_writer(name, image)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(name, offset, out)
        self._count(len(out))

    def read(self, name: str, offset: int, length: int) -> memoryview:
        data = self.inner.read(name, offset, length)
        self._count(len(data))
        return data

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def get(self, name: str) -> bytes | None:
        data = self.inner.get(name)
        self._count(0 if data is None else len(data))
        return data

    def put_atomic(self, name: str, data: bytes) -> None:
        self.inner.put_atomic(name, data)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def list_children(self) -> list[str]:
        return self.inner.list_children()

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def delete_all(self) -> None:
        self.inner.delete_all()

    def close(self) -> None:
        self.inner.close()


def make_state(size_mib: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` fp32 tensors of 1024 columns, ``size_mib`` in all, seeded."""
    g = torch.Generator().manual_seed(1)
    rows = size_mib * MIB // 4 // 1024 // tensors
    return {f"layer{i:03d}.weight": torch.randn(rows, 1024, generator=g) for i in range(tensors)}


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def total(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def exchange_seconds(since_us: float) -> float:
    """Seconds this rank spent in read-once exchanges that began after ``since_us`` (the
    trace's clock: ``time.monotonic_ns`` in microseconds)."""
    return (
        sum(
            e["dur"]
            for e in tracing.trace_events()
            if e["name"] == "slipstream.load.exchange" and e["ts"] >= since_us
        )
        / 1e6
    )


def load_once(
    way: str, location: str, local_dir: str | None, want: dict[str, torch.Tensor]
) -> tuple[float, int, int, float]:
    """One load on every rank: (slowest rank's seconds, bytes all ranks read, most any read,
    slowest rank's seconds in the exchange)."""
    if local_dir is not None:  # as a file system the hosts share: read-once is asked for
        inner: Storage = LocalStorage(location, read_once=True)
    else:
        inner = resolve_storage(location, STORAGE_OPTIONS)
    storage = CountingStorage(inner)
    target = {k: torch.zeros_like(v) for k, v in want.items()}
    if local_dir is not None:  # each rank its own host's cache (on one host, one cache for all)
        drop_page_cache([local_dir])
    dist.barrier()
    since = time.monotonic_ns() / 1000
    start = time.perf_counter()
    if way == TODAY:
        saver = _saver(None)
        work = partial(loader.load, target, storage)
        agreement_for(saver.channel).run(f"load of {location}", work, saver.options.timeout)
    else:
        ss.load(target, storage)
    seconds = time.perf_counter() - start
    mine = storage.take()
    for k, v in want.items():
        if not torch.equal(target[k], v):
            raise AssertionError(f"rank {dist.get_rank()}: {way} loaded {k} wrong from {location}")
    most = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return slowest(seconds), total(mine), int(most), slowest(exchange_seconds(since))


def run_rank(opts: argparse.Namespace, locations: dict[str, tuple[str, str | None]]) -> dict:
    want = make_state(opts.size_mib, opts.tensors)
    got: dict[str, dict[str, list]] = {where: {w: [] for w in WAYS} for where in locations}
    order = random.Random(SHUFFLE_SEED)
    for where, (location, local_dir) in locations.items():
        for way in WAYS:  # warm-up: first group, first connections
            load_once(way, location, local_dir, want)
        for _ in range(opts.repeats):
            ways = list(WAYS)
            order.shuffle(ways)
            for way in ways:
                got[where][way].append(load_once(way, location, local_dir, want))
    return got


def worker(
    rank: int,
    opts: argparse.Namespace,
    port: int,
    env: dict,
    locations,
    hosts: tuple[Path, Path] | None,
    workdir: Path,
    queue,
) -> None:
    with contextlib.ExitStack() as stack:
        if hosts is not None:  # first, before this rank starts threads: this rank's host mount
            stack.enter_context(emulated_hosts.host(*hosts))
        os.environ.update(env)
        torch.set_num_threads(1)
        tracing.start(workdir / f"trace.{rank}.json")  # the exchange's spans, read back per load
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=opts.ranks
        )
        try:
            got = run_rank(opts, locations)
            if rank == 0:
                queue.put(got)
        finally:
            dist.destroy_process_group()


def wait_for_result(queue, procs) -> dict:
    """Rank 0's result, or an error as soon as a rank exited without one coming."""
    import queue as queues

    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"ranks {failed} failed (their tracebacks are above)") from None
    raise RuntimeError(f"no result within {RESULT_TIMEOUT_S} s")


def run(opts: argparse.Namespace, workdir: Path) -> tuple[dict, int]:
    import torch.multiprocessing as mp
    from dist_utils import free_port

    state = make_state(opts.size_mib, opts.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    locations: dict[str, tuple[str, str | None]] = {}
    env: dict[str, str] = {}
    hosts = None
    with contextlib.ExitStack() as stack:
        if "s3" in opts.where:
            import boto3

            spool = "/dev/shm" if os.path.isdir("/dev/shm") else None
            log = stack.enter_context(open(workdir / "moto.log", "wb"))
            endpoint = stack.enter_context(moto_server(log, spool))
            env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
            for k in UNSET:
                os.environ.pop(k, None)
            os.environ.update(env)
            boto3.client("s3").create_bucket(Bucket=BUCKET)
            s3 = f"s3://{BUCKET}/ckpt"
            ss.save(state, s3)
            locations[S3] = (s3, None)
        if "local" in opts.where:
            disk = str(workdir / "ckpt")
            ss.save(state, disk)
            locations[LOCAL] = (disk, disk)
        if "hosts" in opts.where:  # saved into the image; each rank mounts it as its host's
            hosts = (workdir / "shared_fs.img", workdir / "shared_fs")
            stack.enter_context(emulated_hosts.released(hosts[0]))  # after the ranks' joins
            emulated_hosts.make_image(hosts[0], emulated_hosts.image_bytes(nbytes))
            with emulated_hosts.writable(*hosts) as mountpoint:
                ss.save(state, str(mountpoint / "ckpt"))
            shared = str(hosts[1] / "ckpt")
            locations[hosts_name(opts.ranks)] = (shared, shared)
        del state
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=worker, args=(r, opts, port, env, locations, hosts, workdir, queue))
            for r in range(opts.ranks)
        ]
        for p in procs:
            p.start()
        try:
            return wait_for_result(queue, procs), nbytes
        finally:
            join_all(procs)


FLOORS = {"s3": 2.5, "local": 2.0, "hosts": 2.0}


def report(opts: argparse.Namespace, got: dict, nbytes: int) -> Result:
    result = Result(
        "read_once",
        f"Read-once loads: {opts.ranks} data-parallel replicas loading one checkpoint, every "
        "rank reading all of it (today) or each a part, exchanged over gloo",
    )
    hosts = hosts_name(opts.ranks)
    names = {S3: "s3", LOCAL: "local", hosts: "hosts"}
    result.setup = {
        "ranks": opts.ranks,
        "checkpoint MiB": round(nbytes / MIB),
        "tensors": opts.tensors,
        "repeats (interleaved, after one warm-up of each)": opts.repeats,
        "S3": "moto server (tests/storage_server.py) on 127.0.0.1",
        "local disk": "page cache dropped (POSIX_FADV_DONTNEED) before every load",
        "shared file system (emulated)": (
            "an ext4 image file on the local disk; each rank in its own mount namespace mounts "
            "it read-only (ro,noload) through its own loop device with direct I/O, all at one "
            "path; every rank drops its own mount's page cache before every load"
        ),
        "process groups": "the job's gloo on 127.0.0.1; slipstream's own gloo group exchanges",
    }
    for where, runs in got.items():
        table = Table(
            f"{where}: {round(nbytes / MIB)} MiB checkpoint, {opts.ranks} replicas",
            [
                "way",
                "load s (slowest rank)",
                "of which exchange s",
                "read from storage (x checkpoint)",
                "most one rank read (x)",
            ],
        )
        medians = {}
        for way in WAYS:
            seconds = median([r[0] for r in runs[way]])
            read = median([r[1] for r in runs[way]]) / nbytes
            most = median([r[2] for r in runs[way]]) / nbytes
            moving = median([r[3] for r in runs[way]])
            medians[way] = (seconds, read, moving)
            table.rows.append([way, fmt(seconds), fmt(moving), fmt(read), fmt(most)])
        result.tables.append(table)
        speedup = medians[TODAY][0] / medians[READ_ONCE][0]
        read = medians[READ_ONCE][1]
        result.floor(
            f"{where}: bytes read from storage / checkpoint size", read, "<= 1.05", read <= 1.05
        )
        floor = FLOORS[names[where]]
        result.floor(
            f"{where}: load time, today / read-once", speedup, f">= {floor}", speedup >= floor
        )
        seconds, _, moving = medians[READ_ONCE]
        result.notes.append(
            f"{where}: read-once took {fmt(seconds)} s, {fmt(moving)} s of it in the exchange "
            f"({fmt(moving / seconds * 100)}%), the rest its reads and its three agreement "
            f"rounds; today's took {fmt(medians[TODAY][0])} s."
        )
    result.notes.append(
        "Bytes read are counted by a wrapper of the storage backend in every rank (on S3: the "
        "bodies of the GETs the server answered), metadata and index included."
    )
    if LOCAL in got:
        result.notes.append(
            "On the local disk the replicas are processes of one host: they share its page "
            "cache, so today's four reads of a page fetch it from the disk once and the others "
            "copy it from memory, while read-once moves three quarters of the bytes through "
            "loopback TCP (gloo) on the same cores. The local-disk case where read-once pays is "
            "replicas on several hosts reading one file system (each host's cache its own), "
            "which one host cannot measure as it is (the emulated case stands in for it): so a "
            "local path splits reads only when asked (LocalStorage(path, read_once=True), as "
            "here); by default its replicas read as today's do."
        )
    if hosts in got:
        result.notes.append(
            f"{hosts}: what it emulates is each host's own page cache and own block device "
            "(its own mount of one ext4 image, through its own direct-I/O loop device, so a "
            "page one host read is not in another's cache and every cold read goes to the "
            "disk), and that the bytes all come from one disk: the storage bandwidth the hosts "
            "of a shared file system share. What it does not: the exchange still runs over "
            "loopback TCP on this machine's cores, which the ranks' reads and copies share (a "
            "cluster's exchange would cross its interconnect, each host with its own cores); "
            "there is no network file system protocol, server or its cache between the hosts "
            "and the disk; and the disk is this machine's, not a parallel file system's."
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--where",
        nargs="+",
        choices=WHERE,
        default=list(WHERE),
        help="where the checkpoint is: s3 (moto), local (disk, one host), hosts (a shared "
        "file system of --ranks hosts, emulated; needs root); all by default",
    )
    p.add_argument("--workdir", default="/tmp/slipstream-bench/read_once")
    p.add_argument("--out", default="benchmarks/results/read_once.json")
    opts = p.parse_args()
    if "hosts" in opts.where and os.geteuid() != 0:
        p.error("--where hosts needs root (loop devices, mounts, a mount namespace per rank)")
    with scratch(opts.workdir) as workdir:
        result_start = Result("read_once", "")
        result_start.note_load("start")
        got, nbytes = run(opts, workdir)
    result = report(opts, got, nbytes)
    result.setup.update(result_start.setup)
    result.note_load("end")
    result.write(opts.out)
    for f in result.floors:
        print(f"{'ok ' if f.passed else 'LOW'} {f.claim}: {f.measured} (floor {f.floor})")


if __name__ == "__main__":
    main()
