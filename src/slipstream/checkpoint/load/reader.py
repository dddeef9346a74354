"""Reading a committed checkpoint: its metadata and index, and its records' bytes.

:class:`CheckpointReader` opens a checkpoint through its storage backend; :func:`read_all`
carries out the reads a load planned (see :mod:`.loader`), each straight into its
destination, verifying the block checksums of slipstream's index on every byte.

Where small reads are cheap (a local file) every read is its own ``preadv``, block by
block. On an object store, where every request is a round trip (and is billed), reads of
one object are coalesced into spans of up to :data:`SPAN_BYTES`: one ranged GET each,
fetched in parallel and copied out, without the GIL, into the destinations.

Invariant: a destination byte is written only from bytes whose checksum block has been
verified (or from a checkpoint without checksums); a read of part of a block fetches and
verifies the whole block.

A record DCP wrote through stream extensions (``FileSystemWriter(_extensions=...)``: its
``.metadata`` lists their descriptors) is read whole and decoded through the extensions
of an ``ExtensionRegistry``, in the order DCP's own reader applies them; a descriptor the
registry cannot decode is an error naming the record and the extension, before any byte
of the state dict is written.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ...core import streams, tracing
from ...core.checksum import checksum
from ...core.copy import copy_bytes
from ...core.shapes import numel
from ...errors import CheckpointError, CorruptCheckpointError
from ..format.index import CheckpointIndex
from ..format.names import METADATA_FILE, check_inside, generation_of, index_file
from ..format.records import TensorLayout, locate_tensor_data
from ..format.safe_pickle import load_metadata, load_value
from ..format.safe_types import DEFAULT_TRUST, Trust
from ..storage import Location, resolve_storage
from . import bounce

SPAN_BYTES = 64 * 1024 * 1024
"""Most bytes one ranged GET of an object store fetches for several reads."""
SPAN_GAP_BYTES = 1024 * 1024
"""Reads of one object at most this far apart share a GET (the bytes between are dropped)."""


@dataclass(frozen=True)
class SourceRecord:
    """Where one saved chunk's raw bytes are, and how to verify them."""

    file: str
    data_offset: int
    nbytes: int
    blocks: list[int] | None
    block_bytes: int


@dataclass
class ReadRequest:
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
        self,
        checkpoint_id: Location,
        storage_options: dict[str, Any] | None = None,
        trust: Trust = DEFAULT_TRUST,
        extensions: ExtensionRegistry | None = None,
    ) -> None:
        self.storage = resolve_storage(checkpoint_id, storage_options)
        self.path = self.storage.url
        self.trust = trust
        self.extensions = extensions
        meta_path = self.file_path(METADATA_FILE)
        data = self.storage.get(METADATA_FILE)
        if data is None:
            raise CheckpointError(
                f"{self.path} is not a committed checkpoint: it has no {METADATA_FILE} "
                "(the save never finished, or this is not a checkpoint directory)"
            )
        self.metadata: Metadata = load_metadata(data, meta_path, trust)
        for index, info in self.metadata.storage_data.items():
            check_inside(info.relative_path, self.path, f"{METADATA_FILE} (for {index.fqn!r})")
        self.index = self._read_index()
        if self.index is not None:
            self._check_index_covers(self.index)
        self._layouts: dict[tuple[str, int], TensorLayout] = {}
        self._decoders: dict[tuple[str, ...], list[StreamTransformExtension]] = {}

    def decoders(self, fqn: str, info: _StorageInfo) -> list[StreamTransformExtension]:
        """The stream extensions that decode the record of ``fqn`` at ``info``, in the
        order DCP applies them (none for a record written without); an error naming the
        record and the extension where the registry cannot decode it."""
        descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
        if not descriptors:
            return []
        found = self._decoders.get(descriptors)
        if found is None:
            registry = self.extensions if self.extensions is not None else ExtensionRegistry()
            try:
                extensions = registry.from_descriptor_list(descriptors)
            except Exception as exc:
                unknown = [d for d in descriptors if d.partition("/")[0] not in registry.extensions]
                fix = (
                    "register the extension's class in an ExtensionRegistry and pass "
                    "storage_reader=FileSystemReader(path, _extension_registry=registry)"
                    if unknown
                    else "install what it needs"
                )
                raise CheckpointError(
                    f"{self.file_path(info.relative_path)}: {fqn!r} was written through DCP "
                    f"stream extensions {list(descriptors)}, which cannot be decoded here "
                    f"({exc}); {fix}"
                ) from None
            found = [e for e in extensions if isinstance(e, StreamTransformExtension)]
            self._decoders[descriptors] = found
        return found

    def _record(self, fqn: str, info: _StorageInfo) -> bytes:
        """The stored bytes of a record, decoded through its stream extensions."""
        data = self.read_bytes(info.relative_path, info.offset, info.length)
        return _decode(data, self.decoders(fqn, info))

    def _read_index(self) -> CheckpointIndex | None:
        """slipstream's index of this checkpoint, or ``None`` if it has none.

        An index left by an earlier save whose ``.metadata`` was since replaced (e.g. by
        ``dcp.save`` into the same directory) does not describe these files: ignored.
        """
        name = index_file(generation_of(self.metadata))
        path = self.file_path(name)
        data = self.storage.get(name)
        if data is None:
            return None
        index = CheckpointIndex.from_json(data, path)
        storage_meta = self.metadata.storage_meta
        if storage_meta is None or index.save_id != storage_meta.save_id:
            return None
        return index

    def _check_index_covers(self, index: CheckpointIndex) -> None:
        """Every file the index names stays inside the checkpoint, and every data file the
        metadata names is one the index covers: in a checkpoint slipstream indexed, no byte
        is read unverified (a file it does not cover was put there by someone else)."""
        name = index_file(generation_of(self.metadata))
        covered = {check_inside(f, self.path, f"{name} (records)") for f in index.records}
        for fqn, value in index.values.items():
            covered.add(check_inside(value.file, self.path, f"{name} (value {fqn!r})"))
        for md_index, info in self.metadata.storage_data.items():
            if info.relative_path not in covered:
                raise CorruptCheckpointError(
                    f"{self.path}: {METADATA_FILE} stores {md_index.fqn!r} in "
                    f"{info.relative_path!r}, a file the checkpoint's index {name} does not "
                    "cover; refused, never read unverified: the checkpoint was tampered with "
                    "or is corrupt"
                )

    def _not_indexed(self, what: str, info: _StorageInfo) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.file_path(info.relative_path)}: {METADATA_FILE} puts {what} at offset "
            f"{info.offset} (length {info.length}), where the checkpoint's index has no "
            "checksums for it; refused, never read unverified: the checkpoint was tampered "
            "with or is corrupt"
        )

    def file_path(self, relative_path: str) -> str:
        """Where ``relative_path`` of this checkpoint is, for messages."""
        return f"{self.path.rstrip('/')}/{relative_path}"

    def read_into(self, relative_path: str, offset: int, out: memoryview) -> None:
        self.storage.read_into(relative_path, offset, out)

    def read_bytes(self, relative_path: str, offset: int, n: int) -> bytes:
        return bytes(self.storage.read(relative_path, offset, n))

    def close(self) -> None:
        self.storage.close()

    def vanished(self, error: CorruptCheckpointError) -> CheckpointError | CorruptCheckpointError:
        """The error to raise for ``error``: if the checkpoint itself is gone (its
        ``.metadata`` deleted meanwhile, by retention after a newer save or by another
        process), one that says so; else ``error``, the checkpoint being corrupt."""
        if self.storage.exists(METADATA_FILE):
            return error
        return CheckpointError(
            f"{self.path} was deleted while it was being loaded (retention after a newer "
            "save, or another process): the state dict may hold part of it; load again from "
            "a committed step"
        )

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
        self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype
    ) -> SourceRecord:
        info = self.metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
        key = f"{fqn}@{','.join(map(str, offsets))}"
        if self.index is not None:
            entry = self.index.records.get(info.relative_path, {}).get(key)
            if entry is not None and entry.offset == info.offset:
                return SourceRecord(
                    info.relative_path,
                    entry.data_offset,
                    entry.nbytes,
                    entry.blocks,
                    self.index.block_bytes,
                )
            raise self._not_indexed(repr(key), info)
        nbytes = numel(sizes) * dtype.itemsize
        if self.decoders(fqn, info):  # stored encoded: read whole, decoded, and sliced
            return SourceRecord(info.relative_path, -1, nbytes, None, 0)
        layout = self._layout(info)
        if layout.dtype != dtype or layout.size != tuple(sizes) or not layout.is_compact:
            return SourceRecord(info.relative_path, -1, nbytes, None, 0)
        return SourceRecord(info.relative_path, info.offset + layout.data_offset, nbytes, None, 0)

    def _layout(self, info: _StorageInfo) -> TensorLayout:
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
        """Whole-record fallback for records whose data is not compact row-major or is
        stored through stream extensions."""
        info = self.metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
        data = self._record(fqn, info)
        tensor: torch.Tensor = torch.load(io.BytesIO(data), weights_only=True)
        return tensor

    def read_value(self, fqn: str) -> Any:
        info = self.metadata.storage_data[MetadataIndex(fqn)]
        path = self.file_path(info.relative_path)
        indexed = None if self.index is None else self.index.values.get(fqn)
        if self.index is not None and (
            indexed is None
            or (indexed.file, indexed.offset, indexed.length)
            != (info.relative_path, info.offset, info.length)
        ):
            raise self._not_indexed(f"the value {fqn!r}", info)
        data = self.read_bytes(info.relative_path, info.offset, info.length)
        if indexed is not None:
            if checksum(data) != indexed.checksum:
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch in value {fqn!r} at offset {info.offset}"
                )
        return load_value(_decode(data, self.decoders(fqn, info)), fqn, path, self.trust)


def _decode(data: bytes, decoders: Sequence[StreamTransformExtension]) -> bytes:
    """``data`` read back through ``decoders``, chained as DCP's reader chains them."""
    if not decoders:
        return data
    stream: Any = io.BytesIO(data)
    for extension in decoders:
        stream = extension.transform_from(stream)
    return bytes(stream.read())


def _check_block(job: ReadRequest, i: int, got: int, path: str) -> None:
    src = job.source
    assert src.blocks is not None, "only records with block checksums are checked"
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


def _read_partial_block(reader: CheckpointReader, job: ReadRequest, i: int) -> None:
    """Read block ``i`` whole into scratch memory, verify it, copy out the part needed."""
    src, a, b, out = job.source, job.start, job.end, job.out
    assert out is not None, "a host read (a device read is given a pinned view)"
    path = reader.file_path(src.file)
    bs, be = i * src.block_bytes, min((i + 1) * src.block_bytes, src.nbytes)
    lo, hi = max(bs, a), min(be, b)
    whole = _scratch_view(be - bs)
    reader.read_into(src.file, src.data_offset + bs, whole)
    _check_block(job, i, checksum(whole), path)
    out[lo - a : hi - a] = whole[lo - bs : hi - bs]


def _read(
    reader: CheckpointReader, job: ReadRequest, device_ready: dict[torch.device, Any]
) -> None:
    """Carry out one read: straight into host memory, or through a pinned buffer."""
    if job.device_out is None:
        _read_verified(reader, job)
        return

    def into(view: memoryview) -> None:
        _read_verified(reader, replace(job, out=view))

    bounce.read_to_device(into, job.device_out, device_ready[job.device_out.device])


def _read_verified(reader: CheckpointReader, job: ReadRequest) -> None:
    """Read ``job``'s bytes into its destination, verifying every block they touch.

    Blocks the read covers whole land straight in the destination. Where small reads are
    cheap (a local file) each is read on its own and hashed right away, while it is still
    in this core's cache: hashing re-reads every byte, and from cache that pass costs about
    half what it does from memory. On an object store, where every read is a round trip,
    they are read in one request and hashed after. A block the read covers only in part
    is read whole into scratch memory, verified, and the part needed copied out.
    """
    src, a, b, out = job.source, job.start, job.end, job.out
    assert out is not None, "a host read (a device read is given a pinned view)"
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


def _caller_events(reads: list[ReadRequest]) -> dict[torch.device, Any]:
    """Per device the reads go to, an event at the tail of the caller's stream there."""
    devices = {r.device_out.device for r in reads if r.device_out is not None}
    return {d: streams.record_event(streams.current_stream(d)) for d in devices}


@dataclass
class _Span:
    """Bytes ``[start, end)`` of one object, fetched in one request for several reads."""

    file: str
    start: int
    end: int
    reads: list[ReadRequest]


def fetched_range(job: ReadRequest) -> tuple[int, int]:
    """The bytes of its file a read needs: its own, widened to whole checksum blocks."""
    src, a, b = job.source, job.start, job.end
    if src.blocks is not None:
        a = a // src.block_bytes * src.block_bytes
        b = min(-(-b // src.block_bytes) * src.block_bytes, src.nbytes)
    return src.data_offset + a, src.data_offset + b


def _spans(reads: list[ReadRequest]) -> list[_Span]:
    """``reads`` (host destinations) coalesced: reads of one file at most
    :data:`SPAN_GAP_BYTES` apart share a span of at most :data:`SPAN_BYTES` (a read larger
    than that has a span of its own)."""
    spans: list[_Span] = []
    for job in sorted(reads, key=lambda r: (r.source.file, fetched_range(r))):
        lo, hi = fetched_range(job)
        if hi <= lo:
            continue
        last = spans[-1] if spans else None
        if (
            last is not None
            and last.file == job.source.file
            and lo - last.end <= SPAN_GAP_BYTES
            and max(hi, last.end) - last.start <= SPAN_BYTES
        ):
            last.end = max(last.end, hi)
            last.reads.append(job)
        else:
            spans.append(_Span(job.source.file, lo, hi, [job]))
    return spans


def _read_span(reader: CheckpointReader, span: _Span) -> None:
    """Fetch ``span`` in one request, verify the blocks of each of its reads, copy out."""
    data = reader.storage.read(span.file, span.start, span.end - span.start)
    path = reader.file_path(span.file)
    for job in span.reads:
        src = job.source
        lo, hi = fetched_range(job)
        fetched = data[lo - span.start : hi - span.start]
        first = lo - src.data_offset
        if src.blocks is not None:
            for i in range(first // src.block_bytes, -(-(hi - src.data_offset) // src.block_bytes)):
                bs = i * src.block_bytes - first
                be = min((i + 1) * src.block_bytes, src.nbytes) - first
                _check_block(job, i, checksum(fetched[bs:be]), path)
        assert job.out is not None, "spans are made of host reads only"
        copy_bytes(job.out, fetched[job.start - first : job.end - first])


def read_all(
    reader: CheckpointReader,
    reads: list[ReadRequest],
    io_threads: int,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Carry out ``reads`` on ``io_threads`` threads (see the module docstring);
    ``progress(nbytes)`` is called on the caller's thread as each batch of reads lands."""
    device_ready = _caller_events(reads)
    tasks: list[tuple[Callable[[], None], int]]
    if reader.storage.small_reads_are_cheap:
        tasks = [(partial(_read, reader, r, device_ready), r.end - r.start) for r in reads]
    else:
        host = [r for r in reads if r.device_out is None]
        tasks = [
            (partial(_read_span, reader, span), sum(r.end - r.start for r in span.reads))
            for span in _spans(host)
        ]
        tasks += [
            (partial(_read, reader, r, device_ready), r.end - r.start)
            for r in reads
            if r.out is None
        ]
    read = "slipstream.load.read_piece"
    with tracing.span("slipstream.load.read", requests=len(reads)):
        if io_threads <= 1 or len(tasks) <= 1:
            for task, nbytes in tasks:  # in the caller: no thread to start for one stream
                tracing.traced(read, task)()
                if progress is not None:
                    progress(nbytes)
            return
        with ThreadPoolExecutor(io_threads, thread_name_prefix="slipstream-read") as pool:
            for fut, nbytes in [(pool.submit(tracing.traced(read, task)), n) for task, n in tasks]:
                fut.result()
                if progress is not None:
                    progress(nbytes)
