"""The object-storage section of the checkpoint benchmark (``checkpoint.py --sections
object_store``): slipstream against DCP through fsspec (s3fs, fsspec's memory filesystem),
torchsnapshot's S3 plugin and raw boto3 transfers of the same bytes.

On S3 every peer talks to one moto server this module starts (``python -m moto.server`` on
127.0.0.1, a free port, owned and terminated here) and configures only through the
environment (``AWS_ENDPOINT_URL`` and test credentials), as a user would. Saves, then loads,
run side by side, interleaved in a new seeded order each round after a warm-up (see
``checkpoint.SHUFFLE_SEED``); medians of ``--repeats``. The floors are a raw multipart upload
(boto3 ``upload_fileobj``, 8 threads, 16 MiB parts) and a raw ranged download (boto3, 8
threads, 16 MiB ranges into a preallocated buffer) of the state's bytes as one object. Then
the same state on ``memory://``: slipstream's own in-process store against DCP on fsspec's
memory filesystem, no server.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from checkpoint import (
    GIB,
    MIB,
    SHUFFLE_SEED,
    Stamp,
    _status_mib,
    child_json,
    empty_like_state,
    make_state,
    memcpy_runner,
    per_round,
    ratio,
    reset_peak_rss,
    state_bytes,
)
from common import Result, Table, interleave, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from storage_server import CREDENTIALS, UNSET, moto_server  # noqa: E402

from slipstream.core.buffers import byte_view

BUCKET = "slipstream-bench"
RAW_THREADS = 8
RAW_PART = 16 * MIB

SS_ASYNC = "ss.async_save"
SS_SAVE = "ss.save"
DCP_SAVE = "dcp.save (FsspecWriter, s3fs)"
DCP_ASYNC = "dcp.async_save (FsspecWriter, s3fs)"
TS_TAKE = "torchsnapshot.take (S3 plugin, aiobotocore)"
RAW_UPLOAD = f"raw multipart upload (boto3 upload_fileobj, {RAW_THREADS} threads, 16 MiB parts)"
SS_LOAD = "ss.load"
DCP_LOAD = "dcp.load (FsspecReader, s3fs)"
TS_RESTORE = "torchsnapshot restore (S3 plugin, aiobotocore)"
RAW_DOWNLOAD = f"raw ranged download (boto3, {RAW_THREADS} threads, 16 MiB ranges)"
S3_SAVES = [SS_ASYNC, SS_SAVE, DCP_SAVE, DCP_ASYNC, TS_TAKE, RAW_UPLOAD]
S3_LOADS = [SS_LOAD, DCP_LOAD, TS_RESTORE, RAW_DOWNLOAD]
OPTIONAL = {DCP_ASYNC, TS_TAKE, TS_RESTORE}
"""Peers that may not run against the endpoint: a failure drops them, with the reason noted."""
PREFIX = {
    SS_ASYNC: "ss.async_save",
    SS_SAVE: "ss.save",
    DCP_SAVE: "dcp.save",
    DCP_ASYNC: "dcp.async_save",
    TS_TAKE: "torchsnapshot.take",
    RAW_UPLOAD: "raw",
}
"""Each save's prefix in the bucket; a load reads what the save named here left."""
LOAD_SOURCE = {SS_LOAD: SS_SAVE, DCP_LOAD: DCP_SAVE, TS_RESTORE: TS_TAKE, RAW_DOWNLOAD: RAW_UPLOAD}
RSS_PEERS = {"save": [SS_SAVE, DCP_SAVE], "load": [SS_LOAD, DCP_LOAD]}
"""Peak RSS is measured for these, each in a fresh process (``--skip memory`` leaves it out)."""
MEM_SS = "ss.save / ss.load (memory://, slipstream's in-process store)"
MEM_SS_ASYNC = "ss.async_save (memory://), durable"
MEM_DCP = "dcp.save / dcp.load (FsspecWriter / FsspecReader, fsspec memory://)"
MEMCPY = "warm memcpy, faster of two (reference)"


# ---------------------------------------------------------------------------------------
# The server


@contextlib.contextmanager
def moto_server_logged(log_path: Path) -> Iterator[str]:
    """The tests' moto server (``tests/storage_server.py``), its request log in
    ``log_path``. Objects it spools to files go to ``/dev/shm`` where there is one, so the
    server writes nothing to the host's disk (DCP's fallback for an fsspec stream without a
    file descriptor is ``os.sync()``, which would otherwise flush the server's files)."""
    spool = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with open(log_path, "wb") as log, moto_server(log, spool) as endpoint:
        yield endpoint


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """Point every client of this process (and of children started meanwhile) at
    ``endpoint`` through the environment alone, restoring it afterwards."""
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL", *UNSET]}
    for k in UNSET:
        os.environ.pop(k, None)
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) /([^ ?]+)')


class RequestLog:
    """Object requests (to ``/bucket/key``, not listings) in the server's log, per prefix."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def since_last(self) -> dict[str, Counter]:
        """Prefix -> method -> requests logged since the previous call."""
        time.sleep(0.5)  # the server logs a request once it has answered it
        start = self.offset
        with open(self.path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
            self.offset = f.tell()
        counts: dict[str, Counter] = {}
        for m in _REQUEST.finditer(text):
            parts = m.group(2).split("/")
            if len(parts) >= 3 and parts[0] == BUCKET:
                counts.setdefault(parts[1], Counter())[m.group(1)] += 1
        if not counts and start:
            print(
                f"object store: no object requests in {self.path} from byte {start} to "
                f"{self.offset}; the requests columns stay empty",
                file=sys.stderr,
            )
        return counts


def per_run(counts: Counter | None, runs: int, methods: tuple[str, ...]) -> str:
    """``"35 PUT, 4 POST"``: requests of one run (the phase's total over its runs)."""
    if not counts:
        return ""
    out = []
    for method in methods:
        n = counts.get(method, 0) / runs
        if n:
            out.append(f"{n:.0f} {method}" if n == int(n) else f"{n:.1f} {method}")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------
# S3 savers and loaders


def _s3_client():
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=2 * RAW_THREADS))


def _invalidate_fsspec(url: str) -> None:
    """Drop fsspec's listing cache of the filesystem serving ``url`` (objects were deleted
    or written behind its back)."""
    from fsspec.core import url_to_fs

    url_to_fs(url)[0].invalidate_cache()


class S3Peers:
    """Savers and loaders against the bucket; each save peer writes under its own prefix
    (below ``root``), cleared before the clock starts."""

    def __init__(self, state: dict[str, torch.Tensor], root: str = "") -> None:
        self.state = state
        self.root = root
        self.client = _s3_client()
        self._payload: bytes | None = None

    def prefix(self, peer: str) -> str:
        return f"{self.root}{PREFIX[peer]}"

    def url(self, peer: str) -> str:
        return f"s3://{BUCKET}/{self.prefix(peer)}"

    def payload(self) -> bytes:
        """The state's bytes as one contiguous buffer (the raw transfers' object)."""
        if self._payload is None:
            flat = torch.cat([t.reshape(-1) for t in self.state.values()])
            self._payload = bytes(byte_view(flat))
        return self._payload

    def keys(self, peer: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=self.prefix(peer) + "/"
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def clear(self, peer: str) -> None:
        keys = self.keys(peer)
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
            )
        _invalidate_fsspec(self.url(peer))

    def save(self, peer: str) -> dict[str, float]:
        self.clear(peer)
        if peer == RAW_UPLOAD:
            self.payload()
        url = self.url(peer)
        if peer == SS_ASYNC:
            import slipstream as ss

            start = time.perf_counter()
            resp = ss.async_save(self.state, url)
            blocked = time.perf_counter() - start
            staged = Stamp(resp.staging_completion, start)
            durable = Stamp(resp.upload_completion, start)
            got = {"blocked": blocked, "staged": staged.wait(), "durable": durable.wait()}
            got["timings.blocked"] = resp.timings.blocked
            return got
        if peer == DCP_ASYNC:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            start = time.perf_counter()
            resp = dcp.async_save(self.state, storage_writer=FsspecWriter(url))
            blocked = time.perf_counter() - start
            upload = getattr(resp, "upload_completion", resp)
            durable = Stamp(upload, start).wait()
            return {"blocked": blocked, "staged": blocked, "durable": durable}
        start = time.perf_counter()
        self._save_sync(peer, url)
        total = time.perf_counter() - start
        return {"blocked": total, "staged": total, "durable": total}

    def _save_sync(self, peer: str, url: str) -> None:
        if peer == SS_SAVE:
            import slipstream as ss

            ss.save(self.state, url)
        elif peer == DCP_SAVE:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            dcp.save(self.state, storage_writer=FsspecWriter(url))
        elif peer == TS_TAKE:
            from torchsnapshot import Snapshot, StateDict

            Snapshot.take(url, {"state": StateDict(**self.state)})
        elif peer == RAW_UPLOAD:
            from boto3.s3.transfer import TransferConfig

            config = TransferConfig(
                multipart_threshold=RAW_PART,
                multipart_chunksize=RAW_PART,
                max_concurrency=RAW_THREADS,
            )
            key = f"{self.prefix(peer)}/data"
            self.client.upload_fileobj(io.BytesIO(self.payload()), BUCKET, key, Config=config)
        else:
            raise ValueError(peer)

    def load(self, peer: str, dest: Any) -> None:
        """Load what ``LOAD_SOURCE[peer]`` saved into ``dest`` (a state dict of existing
        tensors; for the raw download, a flat ``uint8`` tensor)."""
        url = self.url(LOAD_SOURCE[peer])
        if peer == SS_LOAD:
            import slipstream as ss

            ss.load(dest, url)
        elif peer == DCP_LOAD:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(dest, storage_reader=FsspecReader(url))
        elif peer == TS_RESTORE:
            from torchsnapshot import Snapshot, StateDict

            Snapshot(url).restore({"state": StateDict(**dest)})
        elif peer == RAW_DOWNLOAD:
            self._ranged_download(f"{self.prefix(LOAD_SOURCE[peer])}/data", dest)
        else:
            raise ValueError(peer)

    def _ranged_download(self, key: str, dest: torch.Tensor) -> None:
        view = byte_view(dest)
        n = len(view)
        if self.client.head_object(Bucket=BUCKET, Key=key)["ContentLength"] != n:
            raise AssertionError(f"{key} is not {n} bytes")

        def get(start: int) -> None:
            end = min(start + RAW_PART, n)
            body = self.client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end - 1}")
            pos = start
            for chunk in body["Body"].iter_chunks(MIB):
                view[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
            if pos != end:
                raise AssertionError(f"{key}: range {start}-{end} came back short ({pos})")

        with ThreadPoolExecutor(RAW_THREADS) as pool:
            list(pool.map(get, range(0, n, RAW_PART)))


class Fallible:
    """A runner whose first failure drops its peer: later calls return nothing."""

    def __init__(self, run: Callable[[int], dict]) -> None:
        self.run = run
        self.error: str | None = None

    def __call__(self, rep: int) -> dict[str, float]:
        if self.error is not None:
            return {}
        try:
            return self.run(rep)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            print(f"  dropped: {self.error}", file=sys.stderr)
            return {}


def measure_s3_saves(peers: S3Peers, repeats: int, errors: dict) -> dict[str, dict]:
    runners: dict[str, Callable] = {}
    for p in S3_SAVES:

        def run(_rep: int, p: str = p) -> dict[str, float]:
            return peers.save(p)

        runners[p] = Fallible(run) if p in OPTIONAL else run
    got = interleave(runners, repeats, shuffle_seed=SHUFFLE_SEED)
    out = {}
    for p, metrics in kept(got, runners, errors).items():
        out[p] = {k: median(v) for k, v in metrics.items()}
        if not peers.keys(p):
            raise AssertionError(f"{p} left no objects under s3://{BUCKET}/{peers.prefix(p)}")
    out[SS_SAVE]["durable/raw"] = per_round(got[SS_SAVE]["durable"], got[RAW_UPLOAD]["durable"])
    out[SS_ASYNC]["durable/raw"] = per_round(got[SS_ASYNC]["durable"], got[RAW_UPLOAD]["durable"])
    return out


def kept(got: dict, runners: dict, errors: dict) -> dict[str, dict]:
    """The peers of ``got`` that ran every round; each one that failed goes to ``errors``."""
    out = {}
    for p, metrics in got.items():
        error = getattr(runners[p], "error", None)
        if error is not None or not metrics:
            errors[p] = error
        else:
            out[p] = metrics
    return out


def measure_s3_loads(
    peers: S3Peers, state: dict, repeats: int, saved: dict, errors: dict
) -> dict[str, dict]:
    loaders = [p for p in S3_LOADS if LOAD_SOURCE[p] in saved]
    dests: dict[str, Any] = {p: empty_like_state(state) for p in loaders if p != RAW_DOWNLOAD}
    dests[RAW_DOWNLOAD] = torch.zeros(state_bytes(state), dtype=torch.uint8)

    def runner(p: str) -> Callable[[int], dict]:
        def run(_rep: int) -> dict[str, float]:
            if p == DCP_LOAD:
                _invalidate_fsspec(peers.url(DCP_SAVE))
            start = time.perf_counter()
            peers.load(p, dests[p])
            return {"seconds": time.perf_counter() - start}

        return Fallible(run) if p in OPTIONAL else run

    runners = {p: runner(p) for p in loaders}
    got = interleave(runners, repeats, shuffle_seed=SHUFFLE_SEED)
    out = {}
    for p, metrics in kept(got, runners, errors).items():
        out[p] = {k: median(v) for k, v in metrics.items()}
        if p == RAW_DOWNLOAD:
            flat = torch.frombuffer(bytearray(peers.payload()), dtype=torch.uint8)
            if not torch.equal(dests[p], flat):
                raise AssertionError("the raw download got the bytes wrong")
        else:
            for k, t in dests[p].items():
                if not torch.equal(t, state[k]):
                    raise AssertionError(f"{p} got {k} wrong")
    return out


# ---------------------------------------------------------------------------------------
# memory:// (no server)


class MemoryPeers:
    """slipstream on ``memory://`` (its own in-process store) and DCP on fsspec's
    memory filesystem; each saves under its own location, cleared before the clock starts."""

    SS_URL = f"memory://{BUCKET}/ss"
    SS_ASYNC_URL = f"memory://{BUCKET}/ss_async"
    DCP_URL = f"memory://{BUCKET}/dcp"

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def clear(self, peer: str) -> None:
        if peer in (MEM_SS, MEM_SS_ASYNC):
            from slipstream.checkpoint.storage import resolve_storage

            resolve_storage(self.SS_URL if peer == MEM_SS else self.SS_ASYNC_URL).delete_all()
        else:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(self.DCP_URL)
            if fs.exists(path):
                fs.rm(path, recursive=True)
            fs.invalidate_cache()

    def save(self, peer: str) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        import slipstream as ss

        self.clear(peer)
        start = time.perf_counter()
        if peer == MEM_SS_ASYNC:
            resp = ss.async_save(self.state, self.SS_ASYNC_URL)
            staged = Stamp(resp.staging_completion, start)
            durable = Stamp(resp.upload_completion, start)
            return {"staged": staged.wait(), "seconds": durable.wait()}
        if peer == MEM_SS:
            ss.save(self.state, self.SS_URL)
        else:
            dcp.save(self.state, storage_writer=FsspecWriter(self.DCP_URL))
        return {"seconds": time.perf_counter() - start}

    def load(self, peer: str, dest: dict) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        import slipstream as ss

        start = time.perf_counter()
        if peer == MEM_SS:
            ss.load(dest, self.SS_URL)
        else:
            dcp.load(dest, storage_reader=FsspecReader(self.DCP_URL))
        return {"seconds": time.perf_counter() - start}


def measure_memory(state: dict, repeats: int) -> dict[str, dict]:
    peers = MemoryPeers(state)
    runners: dict[str, Callable] = {
        p: (lambda _r, p=p: peers.save(p)) for p in (MEM_SS, MEM_SS_ASYNC, MEM_DCP)
    }
    runners[MEMCPY] = memcpy_runner(state)
    saves = interleave(runners, repeats, shuffle_seed=SHUFFLE_SEED)
    dests = {p: empty_like_state(state) for p in (MEM_SS, MEM_DCP)}
    runners = {p: (lambda _r, p=p: peers.load(p, dests[p])) for p in (MEM_SS, MEM_DCP)}
    runners[MEMCPY] = memcpy_runner(state)
    loads = interleave(runners, repeats, shuffle_seed=SHUFFLE_SEED)
    for p, dest in dests.items():
        for k, t in dest.items():
            if not torch.equal(t, state[k]):
                raise AssertionError(f"{p} got {k} wrong")
    for p in (MEM_SS, MEM_SS_ASYNC, MEM_DCP):
        peers.clear(p)
    out = {
        p: {"save": median(saves[p]["seconds"]), "load": median(loads[p]["seconds"])}
        for p in (MEM_SS, MEM_DCP, MEMCPY)
    }
    out[MEM_SS_ASYNC] = {
        "save": median(saves[MEM_SS_ASYNC]["seconds"]),
        "staged": median(saves[MEM_SS_ASYNC]["staged"]),
    }
    return out


# ---------------------------------------------------------------------------------------
# Peak memory, each peer in a fresh process


def object_store_sizes(opts) -> tuple[int, int]:
    return int(opts.object_store_gib * GIB), opts.object_store_tensors


def child_memory(kind: str, peer: str, opts) -> dict[str, float]:
    """In a fresh process (the server's address in its environment): build the state, then
    save to its own prefix twice, or load once what the parent's save of it left; report
    the peak resident memory over the resident memory once the state (and, for loads, the
    destination tensors) existed, in MiB."""
    import s3fs  # noqa: F401  (imports before the baseline, as a warm process has them)
    import torch.distributed.checkpoint  # noqa: F401

    import slipstream  # noqa: F401

    state = make_state(*object_store_sizes(opts))
    if kind == "save":
        peers = S3Peers(state, root="rss/")
        base = reset_peak_rss()
        for _ in range(2):
            peers.save(peer)
        peers.clear(peer)
    else:
        peers = S3Peers({})
        dest = empty_like_state(state)
        del state
        base = reset_peak_rss()
        peers.load(peer, dest)
    return {"growth": _status_mib("VmHWM") - base}


def memory_figures(opts) -> dict[tuple[str, str], float]:
    out = {}
    for kind, names in RSS_PEERS.items():
        for peer in names:
            try:
                out[(kind, peer)] = child_json(f"object_store:{kind}:{peer}", opts)["growth"]
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                out[(kind, peer)] = float("nan")
    return out


# ---------------------------------------------------------------------------------------
# The section


def run_section(result: Result, opts) -> None:
    """Measure everything above and add its tables, floors and notes to ``result``."""
    import moto

    nbytes, count = object_store_sizes(opts)
    workdir = Path(opts.workdir) / "object_store"
    workdir.mkdir(parents=True, exist_ok=True)
    state = make_state(nbytes, count)
    nbytes = state_bytes(state)
    sizes = sorted(t.numel() * 4 for t in state.values())
    result.setup["object store state"] = (
        f"{nbytes / GIB:.2f} GiB fp32 in {len(state)} tensors "
        f"({sizes[0] / 1024:.0f} KiB - {sizes[-1] / MIB:.0f} MiB)"
    )
    result.setup["object store server"] = (
        f"moto {moto.__version__} (python -m moto.server, 127.0.0.1), one server for every "
        "S3 peer, configured only through AWS_ENDPOINT_URL and test credentials"
    )
    result.setup["object store repetitions"] = (
        f"1 warm-up + {opts.repeats}, interleaved, saves and loads in a new order each "
        f"round (seed {SHUFFLE_SEED}), medians"
    )
    errors: dict[str, str | None] = {}
    memory: dict = {}
    started = time.perf_counter()
    log = RequestLog(workdir / "moto.log")
    with moto_server_logged(log.path) as endpoint, s3_environment(endpoint):
        peers = S3Peers(state)
        peers.client.create_bucket(Bucket=BUCKET)
        log.since_last()
        print("object store: S3 saves ...", flush=True)
        saves = measure_s3_saves(peers, opts.repeats, errors)
        save_requests = log.since_last()
        print("object store: S3 loads ...", flush=True)
        loads = measure_s3_loads(peers, state, opts.repeats, saves, errors)
        load_requests = log.since_last()
        if "memory" not in opts.skip:
            print("object store: peak memory ...", flush=True)
            memory = memory_figures(opts)
    s3_seconds = time.perf_counter() - started
    print("object store: memory:// ...", flush=True)
    mem = measure_memory(state, opts.repeats)
    runs = 1 + opts.repeats
    result.tables += [
        s3_save_table(saves, save_requests, runs, memory, nbytes),
        s3_load_table(loads, load_requests, runs, memory, nbytes),
        memory_table(mem, nbytes),
    ]
    record_floors(result, saves, loads, mem)
    result.notes += NOTES
    result.notes += measured_notes(
        saves, loads, load_requests, runs, errors, memory, mem, s3_seconds
    )


def _gibs(nbytes: int, seconds: float) -> float:
    return nbytes / GIB / seconds if seconds > 0 else float("nan")


def s3_save_table(saves: dict, requests: dict, runs: int, memory: dict, nbytes: int) -> Table:
    ref = saves[SS_SAVE]["durable"]
    rows = []
    for p in S3_SAVES:
        if p not in saves:
            continue
        m = saves[p]
        rows.append(
            [
                p + (" (reference)" if p == RAW_UPLOAD else ""),
                m["blocked"],
                m["staged"],
                m["durable"],
                _gibs(nbytes, m["durable"]),
                ratio(m["durable"], ref),
                per_run(requests.get(PREFIX[p]), runs, ("PUT", "POST", "GET", "HEAD")),
                memory.get(("save", p), ""),
            ]
        )
    return Table(
        "Saves to S3 (one moto server on 127.0.0.1; seconds, medians; GiB/s = state bytes / "
        "durable; x = durable / ss.save's; requests = object requests per save, from the "
        "server's log)",
        [
            "peer",
            "blocked s",
            "staged s",
            "durable s",
            "GiB/s",
            "durable x",
            "requests",
            "peak RSS +MiB",
        ],
        rows,
    )


def s3_load_table(loads: dict, requests: dict, runs: int, memory: dict, nbytes: int) -> Table:
    ref = loads[SS_LOAD]["seconds"]
    rows = []
    for p in S3_LOADS:
        if p not in loads:
            continue
        s = loads[p]["seconds"]
        rows.append(
            [
                p + (" (reference)" if p == RAW_DOWNLOAD else ""),
                s,
                _gibs(nbytes, s),
                ratio(s, ref),
                per_run(requests.get(PREFIX[LOAD_SOURCE[p]]), runs, ("GET", "HEAD")),
                memory.get(("load", p), ""),
            ]
        )
    return Table(
        "Loads from S3 into existing tensors (seconds, medians; x = peer / ss.load; requests "
        "= object requests per load, from the server's log)",
        ["peer", "seconds", "GiB/s", "x", "requests", "peak RSS +MiB"],
        rows,
    )


def memory_table(mem: dict, nbytes: int) -> Table:
    ss_ = mem[MEM_SS]
    rows = []
    for p in (MEM_SS, MEM_SS_ASYNC, MEM_DCP, MEMCPY):
        m = mem[p]
        load = m.get("load")
        rows.append(
            [
                p,
                m["save"],
                "" if load is None else load,
                _gibs(nbytes, m["save"]),
                "" if load is None else _gibs(nbytes, load),
                ratio(m["save"], ss_["save"]),
                "" if load is None else ratio(load, ss_["load"]),
            ]
        )
    return Table(
        "memory:// (in-process, no server; seconds, medians; x = peer / slipstream; loads "
        "into existing tensors)",
        ["peer", "save s", "load s", "save GiB/s", "load GiB/s", "save x", "load x"],
        rows,
    )


def record_floors(result: Result, saves: dict, loads: dict, mem: dict) -> None:
    blocked_ms = 1000 * saves[SS_ASYNC]["blocked"]
    result.floor("S3: ss.async_save caller blocked, ms", blocked_ms, "<= 10", blocked_ms <= 10)
    vs_dcp = ratio(saves[SS_SAVE]["durable"], saves[DCP_SAVE]["durable"])
    result.floor("S3: ss.save durable / dcp.save (s3fs) durable", vs_dcp, "<= 1", vs_dcp <= 1)
    vs_raw = saves[SS_SAVE]["durable/raw"]
    result.floor(
        f"S3: ss.save durable / raw multipart upload (boto3, {RAW_THREADS} threads), per round",
        vs_raw,
        "<= 1.3",
        vs_raw <= 1.3,
    )
    load = ratio(loads[DCP_LOAD]["seconds"], loads[SS_LOAD]["seconds"])
    result.floor("S3: dcp.load (s3fs) / ss.load", load, ">= 2", load >= 2)
    mem_save = ratio(mem[MEM_DCP]["save"], mem[MEM_SS]["save"])
    result.floor("memory://: dcp.save (fsspec memory) / ss.save", mem_save, ">= 2", mem_save >= 2)
    mem_load = ratio(mem[MEM_DCP]["load"], mem[MEM_SS]["load"])
    result.floor(
        "memory://: dcp.load (fsspec memory) / ss.load", mem_load, ">= 1.5", mem_load >= 1.5
    )


NOTES = [
    "Object storage on S3: every S3 peer runs against one moto server (pure Python: a "
    "threaded werkzeug server holding one GIL), started by the benchmark on 127.0.0.1 and "
    "configured only through AWS_ENDPOINT_URL and test credentials in the environment. "
    "slipstream (obstore), s3fs (the fsspec filesystem DCP's FsspecWriter/FsspecReader use), "
    "torchsnapshot's S3 plugin (aiobotocore) and boto3 all read the endpoint from there; each "
    "save's objects are listed in the bucket after the saves, or the run fails. moto caps "
    "every uploader near one throughput, whatever its concurrency: the saves compare what "
    "each client asks of a server, not what S3 would sustain.",
    "moto answers every ranged GET by reading the whole object and slicing it (under a lock "
    "per object), so on moto a load costs about one whole-object read per request; real S3 "
    "serves ranges natively. Load figures on moto therefore understate ranged-read designs, "
    "and penalise most the loaders that send the most requests (see the requests column).",
    "blocked: time until the call returned; staged: until the caller may mutate the state "
    "(equal to blocked for peers that stage on the caller's thread); durable: until the "
    "checkpoint is committed in the bucket. DCP runs with its defaults (one file per rank, "
    "one writer thread); its FsspecWriter's fsync of an s3fs stream falls back to os.sync() "
    "of the host, so the server spools its objects to /dev/shm and no disk write of the "
    "server's lands in a DCP save. Peak RSS +MiB: peak resident memory of a fresh process "
    "minus its resident memory once the state exists (saves: two, to a prefix of its own; "
    "loads: one, into existing tensors).",
]


def measured_notes(
    saves: dict,
    loads: dict,
    requests: dict,
    runs: int,
    errors: dict,
    memory: dict,
    mem: dict,
    s3_seconds: float,
) -> list[str]:
    notes = []
    raw = loads[RAW_DOWNLOAD]["seconds"]
    gets = requests.get(PREFIX[RAW_UPLOAD], Counter()).get("GET", 0) / runs
    if gets:
        per_get = raw / gets
        parts = []
        for p in (SS_LOAD, DCP_LOAD, TS_RESTORE):
            if p in loads:
                n = requests.get(PREFIX[LOAD_SOURCE[p]], Counter()).get("GET", 0) / runs
                parts.append(f"{p} sent {n:.0f} GETs in {loads[p]['seconds']:.2f} s")
        notes.append(
            f"On this server the raw download's {gets:.0f} ranged GETs of "
            f"{RAW_PART // MIB} MiB took {raw:.2f} s, {per_get:.3f} s per GET with "
            f"{RAW_THREADS} in flight: moto serves the GETs of one object one at a time, each "
            "reading the whole object. " + "; ".join(parts) + ". On moto a loader's time "
            "follows the number of GETs it sends times the size of the objects they read."
        )
    a = saves[SS_ASYNC]
    notes.append(
        f"ss.async_save on S3: the call returned in {1000 * a['blocked']:.1f} ms "
        f"(SaveTimings.blocked {1000 * a['timings.blocked']:.1f} ms), the state was staged "
        f"after {a['staged']:.3f} s and durable after {a['durable']:.2f} s, "
        f"{a['durable/raw']:.2f}x the raw multipart upload of the same round (median of "
        "per-round ratios)."
    )
    m = mem[MEM_SS_ASYNC]
    notes.append(
        f"ss.async_save on memory:// had the state staged (copied into its staging image) "
        f"after {m['staged']:.3f} s and was durable after {m['save']:.3f} s: the "
        f"{m['save'] - m['staged']:.3f} s between went to the block checksums, the copy of "
        "the image into the store and the commit. The warm memcpy "
        f"of the same bytes took {mem[MEMCPY]['save']:.3f} s."
    )
    for p, error in errors.items():
        notes.append(f"{p} did not run against the endpoint and is left out: {error}")
    if not memory:
        notes.append("Peak RSS on S3 was not measured (--skip memory).")
    notes.append(f"The S3 part of this section took {s3_seconds:.0f} s.")
    return notes
