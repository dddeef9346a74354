"""Loading in place, resharding, straight from the bytes each rank needs.

For every tensor (or DTensor shard) in the target state dict, the saved chunks that
overlap it are found from the metadata and only the overlapping byte ranges are read,
with ``preadv`` straight into the destination tensor's memory whenever the range is
contiguous on both sides (the usual case, including ``Shard(0)`` resharding). Reads go
through the storage backend (see :mod:`.storage`): ``preadv`` on the local disk, parallel
ranged GETs on an object store. No collective runs: each rank reads what it needs, so
N -> M ranks costs no planning.

Checks that need no data (missing/unexpected keys, dtype, global shape, committed
metadata, truncated files) all run before the first byte lands in the state dict. Block
checksums from slipstream's index are verified on every read; a reader of part of a
record reads the surrounding blocks whole so that it can verify them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from ..core import streams
from ..core.buffers import as_bytes, byte_view
from ..core.checksum import checksum
from ..core.flatten import flatten, set_path
from ..core.threads import usable_cores
from ..errors import CheckpointError, CorruptCheckpointError
from . import bounce
from .commit import METADATA_FILE
from .generations import generation_of, index_file
from .layout import is_stateful, resolve_stateful
from .records import TensorLayout, locate_tensor_data
from .safe_pickle import load_metadata, load_value
from .shards import local_chunks
from .storage import Location, resolve_storage

logger = logging.getLogger(__name__)

READ_PIECE_BYTES = 64 * 1024 * 1024
MAX_IO_THREADS = 16
OBJECT_STORE_IO_THREADS = 16
"""Parallel ranged reads from an object store, where each waits on a round trip."""


@dataclass(frozen=True)
class SourceRecord:
    """Where one saved chunk's raw bytes are, and how to verify them."""

    file: str
    data_offset: int
    nbytes: int
    blocks: list[int] | None
    block_bytes: int


@dataclass
class _Read:
    source: SourceRecord
    key: str
    start: int
    end: int
    out: memoryview | None
    device_out: torch.Tensor | None = None
    """For a destination on an accelerator: its bytes as a flat ``uint8`` device tensor,
    filled through a pinned buffer (``out`` is then ``None``)."""


class CheckpointReader:
    """A committed checkpoint opened for reading (metadata, index, the storage backend)."""

    def __init__(
        self, checkpoint_id: Location, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.storage = resolve_storage(checkpoint_id, storage_options)
        self.path = self.storage.url
        meta_path = self.file_path(METADATA_FILE)
        data = self.storage.get(METADATA_FILE)
        if data is None:
            raise CheckpointError(
                f"{self.path} is not a committed checkpoint: it has no {METADATA_FILE} "
                "(the save never finished, or this is not a checkpoint directory)"
            )
        self.metadata: Metadata = load_metadata(data, meta_path)
        self.index = self._read_index()
        self._layouts: dict[tuple[str, int], TensorLayout] = {}

    def _read_index(self) -> dict | None:
        """slipstream's index of this checkpoint, or ``None`` if it has none.

        An index left by an earlier save whose ``.metadata`` was since replaced (e.g. by
        ``dcp.save`` into the same directory) does not describe these files: ignored.
        """
        name = index_file(generation_of(self.metadata))
        path = self.file_path(name)
        data = self.storage.get(name)
        if data is None:
            return None
        try:
            index = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{path} is not valid JSON ({exc})") from exc
        if index.get("format") != "slipstream-index":
            raise CorruptCheckpointError(f"{path} is not a slipstream index")
        storage_meta = self.metadata.storage_meta
        if storage_meta is None or index.get("save_id") != storage_meta.save_id:
            return None
        return index

    def file_path(self, relative_path: str) -> str:
        """Where ``relative_path`` of this checkpoint is, for messages."""
        return f"{self.path.rstrip('/')}/{relative_path}"

    def read_into(self, relative_path: str, offset: int, out: memoryview) -> None:
        self.storage.read_into(relative_path, offset, out)

    def read_bytes(self, relative_path: str, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.storage.read_into(relative_path, offset, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        self.storage.close()

    def check_file_sizes(self) -> None:
        """Fail early if a data file is shorter than the metadata says.

        The error names the file, its size and the first record (key and offset) that
        runs past its end.
        """
        sizes: dict[str, int] = {}
        cut: tuple[int, int, str, str] | None = None
        for index, info in self.metadata.storage_data.items():
            rel = info.relative_path
            if rel not in sizes:
                sizes[rel] = self.storage.size(rel)
            end = info.offset + info.length
            if end > sizes[rel] and (cut is None or (rel, info.offset) < (cut[2], cut[0])):
                cut = (info.offset, end, rel, index.fqn)
        if cut is not None:
            offset, end, rel, fqn = cut
            raise CorruptCheckpointError(
                f"{self.file_path(rel)} is truncated: {sizes[rel]} bytes, but {fqn!r} is "
                f"stored at offset {offset} up to {end}"
            )

    def source(
        self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype
    ) -> SourceRecord:
        info = self.metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
        key = f"{fqn}@{','.join(map(str, offsets))}"
        if self.index is not None:
            entry = self.index["records"].get(info.relative_path, {}).get(key)
            if entry is not None and entry["offset"] == info.offset:
                return SourceRecord(
                    info.relative_path,
                    entry["data_offset"],
                    entry["nbytes"],
                    entry["blocks"],
                    self.index["block_bytes"],
                )
        layout = self._layout(info)
        nbytes = _numel(sizes) * dtype.itemsize
        if layout.dtype != dtype or layout.size != tuple(sizes) or not layout.is_compact:
            return SourceRecord(info.relative_path, -1, nbytes, None, 0)
        return SourceRecord(info.relative_path, info.offset + layout.data_offset, nbytes, None, 0)

    def _layout(self, info) -> TensorLayout:
        cache_key = (info.relative_path, info.offset)
        layout = self._layouts.get(cache_key)
        if layout is None:
            path = self.file_path(info.relative_path)

            def read(offset: int, n: int) -> bytes:
                n = max(0, min(n, info.length - offset))
                return self.read_bytes(info.relative_path, info.offset + offset, n)

            layout = locate_tensor_data(read, info.length, f"{path} at offset {info.offset}")
            self._layouts[cache_key] = layout
        return layout

    def read_record_tensor(self, fqn: str, offsets: tuple[int, ...]) -> torch.Tensor:
        """Whole-record fallback for records whose data is not compact row-major."""
        import io

        info = self.metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
        data = self.read_bytes(info.relative_path, info.offset, info.length)
        return torch.load(io.BytesIO(data), weights_only=True)

    def read_value(self, fqn: str) -> Any:
        info = self.metadata.storage_data[MetadataIndex(fqn)]
        path = self.file_path(info.relative_path)
        data = self.read_bytes(info.relative_path, info.offset, info.length)
        if self.index is not None and fqn in self.index["values"]:
            if checksum(data) != self.index["values"][fqn]["checksum"]:
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch in value {fqn!r} at offset {info.offset}"
                )
        return load_value(data, fqn, path)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _row_major_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _raw_bytes_are_values(tensor: torch.Tensor) -> bool:
    """True when writing the saved bytes into ``tensor``'s memory sets its values.

    That takes a contiguous tensor without a lazy conjugate or negative bit (a view such as
    ``x.conj()`` reads its memory through that bit, so it is filled with ``copy_``).
    """
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _target_chunks(
    value: torch.Tensor,
) -> list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    if isinstance(value, DTensor):
        local = value.to_local().detach()
        chunks = local_chunks(value, tuple(local.shape))
        return [(local, offsets, sizes) for offsets, sizes in chunks]
    return [(value.detach(), (0,) * value.dim(), tuple(value.shape))]


def _check_keys(flat: Mapping[str, Any], metadata: Metadata, strict: bool, where: str) -> None:
    saved = metadata.state_dict_metadata
    missing = [k for k in flat if k not in saved]
    if missing:
        raise CheckpointError(f"{where}: keys missing from the checkpoint: {missing}")
    if strict:
        unexpected = [k for k in saved if k not in flat]
        if unexpected:
            raise CheckpointError(
                f"{where}: unexpected keys in the checkpoint (not in the state dict): "
                f"{unexpected}; pass strict=False to load only the keys you ask for"
            )
    for fqn, value in flat.items():
        md = saved[fqn]
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"{where}: {fqn!r} is a tensor in the state dict but a plain value "
                    "in the checkpoint"
                )
            if md.properties.dtype != value.dtype:
                raise CheckpointError(
                    f"{where}: dtype mismatch for {fqn!r}: checkpoint has {md.properties.dtype}, "
                    f"state dict has {value.dtype}"
                )
            if tuple(md.size) != tuple(value.shape):
                raise CheckpointError(
                    f"{where}: shape mismatch for {fqn!r}: checkpoint has {list(md.size)}, "
                    f"state dict has {list(value.shape)}"
                )
        elif isinstance(md, TensorStorageMetadata):
            raise CheckpointError(
                f"{where}: {fqn!r} is a tensor of shape {list(md.size)} in the checkpoint but a "
                f"{type(value).__name__} in the state dict; put a tensor there to load into"
            )
        elif not isinstance(md, BytesStorageMetadata):
            raise CorruptCheckpointError(f"{where}: unknown metadata kind for {fqn!r}")


def _plan_reads(
    reader: CheckpointReader,
    fqn: str,
    value: torch.Tensor,
    md: TensorStorageMetadata,
    reads: list,
    copies: list,
) -> None:
    """Queue the reads (and copies) that fill ``value`` from the saved chunks of ``fqn``.

    Saved chunks tile their tensor without overlap, so the elements they share with a
    target chunk add up to the whole target chunk; when they do not, the checkpoint is
    missing part of the tensor and this raises before any byte is read.
    """
    dtype = value.dtype
    itemsize = dtype.itemsize
    for dest, t_off, t_size in _target_chunks(value):
        if _numel(t_size) == 0:
            continue
        covered = 0
        for chunk in md.chunks:
            s_off, s_size = tuple(chunk.offsets), tuple(chunk.sizes)
            lo = [max(a, b) for a, b in zip(t_off, s_off, strict=True)]
            hi = [
                min(a + n, b + m) for a, n, b, m in zip(t_off, t_size, s_off, s_size, strict=True)
            ]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            covered += _numel([h - low for low, h in zip(lo, hi, strict=True)])
            src = reader.source(fqn, s_off, s_size, dtype)
            box = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, t_off, strict=True))
            extent = tuple(h - low for low, h in zip(lo, hi, strict=True))
            dest_view = dest if extent == t_size else dest[box]
            if src.data_offset < 0:
                src_box = tuple(
                    slice(low - o, h - o) for low, h, o in zip(lo, hi, s_off, strict=True)
                )
                copies.append((dest_view, None, (fqn, s_off, src_box)))
                continue
            strides = _row_major_strides(s_size)
            first = sum((low - o) * st for low, o, st in zip(lo, s_off, strides, strict=True))
            last = sum((h - 1 - o) * st for h, o, st in zip(hi, s_off, strides, strict=True))
            count = last - first + 1
            start, end = first * itemsize, (last + 1) * itemsize
            if count == _numel(extent) and _raw_bytes_are_values(dest_view):
                on_host = dest_view.device.type == "cpu"
                out = byte_view(dest_view) if on_host else as_bytes(dest_view)
                step = READ_PIECE_BYTES if on_host else bounce.SLOT_BYTES
                for piece in range(start, end, step):
                    piece_end = min(end, piece + step)
                    part = out[piece - start : piece_end - start]
                    reads.append(
                        _Read(src, fqn, piece, piece_end, part)
                        if on_host
                        else _Read(src, fqn, piece, piece_end, None, part)
                    )
            else:
                scratch = torch.empty(count, dtype=dtype)
                reads.append(_Read(src, fqn, start, end, byte_view(scratch)))
                copies.append((dest_view, scratch.as_strided(extent, strides), None))
        if covered != _numel(t_size):
            raise CorruptCheckpointError(
                f"{reader.path}: the saved chunks of {fqn!r} hold {covered} of the "
                f"{_numel(t_size)} elements at offsets {list(t_off)}, size {list(t_size)}; "
                "the checkpoint is missing part of this tensor"
            )


def _check_block(job: _Read, i: int, got: int, path: str) -> None:
    src = job.source
    if i >= len(src.blocks) or got != src.blocks[i]:
        start = src.data_offset + i * src.block_bytes
        end = src.data_offset + min((i + 1) * src.block_bytes, src.nbytes)
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in {job.key!r} (bytes {start}-{end} of the file); "
            "the checkpoint is corrupted"
        )


_scratch = threading.local()


def _scratch_view(nbytes: int) -> memoryview:
    """This thread's scratch memory, at least ``nbytes``, reused across blocks: a fresh
    buffer per block would be zeroed and page-faulted in every time."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch.buf = bytearray(nbytes)
    return memoryview(buf)[:nbytes]


def _read_partial_block(reader: CheckpointReader, job: _Read, i: int) -> None:
    """Read block ``i`` whole into scratch memory, verify it, copy out the part needed."""
    src, a, b, out = job.source, job.start, job.end, job.out
    path = reader.file_path(src.file)
    bs, be = i * src.block_bytes, min((i + 1) * src.block_bytes, src.nbytes)
    lo, hi = max(bs, a), min(be, b)
    whole = _scratch_view(be - bs)
    reader.read_into(src.file, src.data_offset + bs, whole)
    _check_block(job, i, checksum(whole), path)
    out[lo - a : hi - a] = whole[lo - bs : hi - bs]


def _read(reader: CheckpointReader, job: _Read, device_ready: dict[torch.device, Any]) -> None:
    """Carry out one read: straight into host memory, or through a pinned buffer."""
    if job.device_out is None:
        _read_verified(reader, job)
        return

    def into(view: memoryview) -> None:
        _read_verified(reader, replace(job, out=view))

    bounce.read_to_device(into, job.device_out, device_ready[job.device_out.device])


def _read_verified(reader: CheckpointReader, job: _Read) -> None:
    """Read ``job``'s bytes into its destination, verifying every block they touch.

    Blocks the read covers whole land straight in the destination. Where small reads are
    cheap (a local file) each is read on its own and hashed right away, while it is still
    in this core's cache: hashing re-reads every byte, and from cache that pass costs about
    half what it does from memory. On an object store, where every read is a round trip,
    they are read in one request and hashed after. A block the read covers only in part
    is read whole into scratch memory, verified, and the part needed copied out.
    """
    src, a, b, out = job.source, job.start, job.end, job.out
    path = reader.file_path(src.file)
    if b <= a:
        return
    if src.blocks is None:
        reader.read_into(src.file, src.data_offset + a, out)
        return
    block = src.block_bytes
    whole = []
    for i in range(a // block, (b - 1) // block + 1):
        bs, be = i * block, min((i + 1) * block, src.nbytes)
        if bs < a or be > b:
            _read_partial_block(reader, job, i)
        elif reader.storage.small_reads_are_cheap:
            piece = out[bs - a : be - a]
            reader.read_into(src.file, src.data_offset + bs, piece)
            _check_block(job, i, checksum(piece), path)
        else:
            whole.append((i, bs, be))
    if whole:
        lo, hi = whole[0][1], whole[-1][2]
        reader.read_into(src.file, src.data_offset + lo, out[lo - a : hi - a])
        for i, bs, be in whole:
            _check_block(job, i, checksum(out[bs - a : be - a]), path)


def _caller_events(reads: list[_Read]) -> dict[torch.device, Any]:
    """Per device the reads go to, an event at the tail of the caller's stream there."""
    devices = {r.device_out.device for r in reads if r.device_out is not None}
    return {d: streams.record_event(streams.current_stream(d)) for d in devices}


def load(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    *,
    strict: bool = True,
    io_threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Load a committed checkpoint into ``state_dict`` in place (see the module docstring).

    ``io_threads`` defaults, on the local disk, to one more than the usable cores, at most
    ``MAX_IO_THREADS``: reading from the page cache is bound by the cores (a copy and a
    hash per byte), and the extra thread keeps a request queued when reads wait on the
    disk. On an object store it is ``OBJECT_STORE_IO_THREADS``.
    """
    started = time.perf_counter()
    reader = CheckpointReader(checkpoint_id, storage_options)
    if io_threads is None:
        io_threads = (
            min(MAX_IO_THREADS, usable_cores() + 1)
            if reader.storage.small_reads_are_cheap
            else OBJECT_STORE_IO_THREADS
        )
    try:
        resolved = resolve_stateful(state_dict)
        flat, paths = flatten(resolved)
        _check_keys(flat, reader.metadata, strict, reader.path)
        reader.check_file_sizes()
        reads: list[_Read] = []
        copies: list = []
        values: dict[str, Any] = {}
        for fqn, value in flat.items():
            md = reader.metadata.state_dict_metadata[fqn]
            if isinstance(value, torch.Tensor):
                _plan_reads(reader, fqn, value, md, reads, copies)
            else:
                values[fqn] = reader.read_value(fqn)
        reads.sort(key=lambda r: (r.source.file, r.source.data_offset + r.start))
        device_ready = _caller_events(reads)
        with ThreadPoolExecutor(io_threads, thread_name_prefix="slipstream-read") as pool:
            try:
                for fut in [pool.submit(_read, reader, r, device_ready) for r in reads]:
                    fut.result()
            except CorruptCheckpointError as exc:
                if not reader.storage.exists(METADATA_FILE):
                    raise CheckpointError(
                        f"{reader.path} was deleted while it was being loaded (retention "
                        "after a newer save, or another process): the state dict holds part "
                        "of it; load again from a committed step"
                    ) from exc
                raise
        nbytes = sum(r.end - r.start for r in reads)
        for dest_view, src, fallback in copies:
            if src is None:
                fqn, s_off, src_box = fallback
                whole = reader.read_record_tensor(fqn, s_off)
                src = whole[src_box] if src_box else whole
            dest_view.copy_(src)
        for fqn, value in values.items():
            set_path(resolved, paths[fqn], value)
        for key, value in state_dict.items():
            if is_stateful(value):
                value.load_state_dict(resolved[key])
            elif key in resolved and resolved[key] is not value:
                state_dict[key] = resolved[key]
    finally:
        reader.close()
    seconds = time.perf_counter() - started
    logger.info(
        "loaded %s: %.3f GiB read and verified in %.3f s (%.2f GiB/s)",
        reader.path,
        nbytes / 2**30,
        seconds,
        nbytes / 2**30 / max(seconds, 1e-9),
    )
