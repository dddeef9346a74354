"""Loading in place, resharding, straight from the bytes each rank needs.

For every tensor (or DTensor shard) in the target state dict, the saved chunks that
overlap it are found from the metadata and only the overlapping byte ranges are planned
as reads, each straight into the destination tensor's memory whenever the range is
contiguous on both sides (the usual case, including ``Shard(0)`` resharding);
:mod:`.reader` carries them out through the storage backend. This module runs no
collective: each rank plans what it needs alone, so N -> M ranks costs no planning. Where
several ranks of a collective load need the same bytes, :mod:`..collective_load` splits those
reads among them.

Checks that need no data (missing/unexpected keys, dtype, global shape, committed
metadata, truncated files) all run before the first byte lands in the state dict. Block
checksums from slipstream's index are verified on every read.

A tensor saved in another dtype is refused unless the load casts (``cast=True``, what
``slipstream.dcp.load`` passes, as DCP casts): its bytes are then read in the saved dtype
and converted once, by ``copy_``, into the destination (exact where the destination's
dtype holds every saved value; rounded as ``copy_`` rounds where it does not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from ...core import tracing
from ...core.buffers import as_bytes, byte_view
from ...core.flatten import Path, flatten, is_stateful, resolve_stateful, set_path
from ...core.shapes import numel, row_major_strides
from ...core.threads import usable_cores
from ...errors import CheckpointError, CorruptCheckpointError
from ..format.safe_types import Trust, Trusted
from ..format.shards import local_chunks
from ..storage import Location
from . import bounce
from .reader import CheckpointReader, ReadRequest, fetched_range, read_all

logger = logging.getLogger(__name__)

READ_PIECE_BYTES = 64 * 1024 * 1024
MAX_IO_THREADS = 16
OBJECT_STORE_IO_THREADS = 16
"""Parallel ranged reads from an object store, where each waits on a round trip."""

_Fallback = tuple[str, tuple[int, ...], tuple[slice, ...]]
"""A record read whole and sliced: its key, its chunk's offsets, the box to copy out."""
_Copy = tuple[torch.Tensor, torch.Tensor | None, _Fallback | None]
"""A copy into a destination view after the reads: from scratch memory the reads filled,
or (source ``None``) from the box of a record read whole."""


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
    if isinstance(value, ShardedTensor):
        return [
            (
                shard.tensor.detach(),
                tuple(shard.metadata.shard_offsets),
                tuple(shard.metadata.shard_sizes),
            )
            for shard in value.local_shards()
        ]
    return [(value.detach(), (0,) * value.dim(), tuple(value.shape))]


def _check_keys(
    flat: Mapping[str, Any], metadata: Metadata, strict: bool, where: str, cast: bool
) -> None:
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
            if md.properties.dtype != value.dtype and not cast:
                raise CheckpointError(
                    f"{where}: dtype mismatch for {fqn!r}: checkpoint has {md.properties.dtype}, "
                    f"state dict has {value.dtype}; pass cast=True to cast it as "
                    "torch.distributed.checkpoint.load does"
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


def read_and_copy(
    reader: CheckpointReader,
    reads: list[ReadRequest],
    copies: list[_Copy],
    io_threads: int | Callable[[int], int],
    progress: Callable[[int], None] | None = None,
) -> int:
    """Carry out planned ``reads`` in file order, then the ``copies`` they feed; returns
    the bytes read. ``io_threads`` may be a function of those bytes."""
    reads.sort(key=lambda r: (r.source.file, r.source.data_offset + r.start))
    nbytes = sum(r.end - r.start for r in reads)
    threads = io_threads(nbytes) if callable(io_threads) else io_threads
    read_all(reader, reads, threads, progress)
    for dest_view, src, fallback in copies:
        if src is None:
            assert fallback is not None, "a copy without a source names its record"
            fqn, s_off, src_box = fallback
            whole = reader.read_record_tensor(fqn, s_off)
            src = whole[src_box] if src_box else whole
        dest_view.copy_(src)
    return nbytes


def plan_reads(
    reader: CheckpointReader,
    fqn: str,
    value: torch.Tensor,
    md: TensorStorageMetadata,
    reads: list[ReadRequest],
    copies: list[_Copy],
) -> None:
    """Queue the reads (and copies) that fill ``value`` from the saved chunks of ``fqn``.

    Saved chunks tile their tensor without overlap, so the elements they share with a
    target chunk add up to the whole target chunk; when they do not, the checkpoint is
    missing part of the tensor and this raises before any byte is read. Bytes are read in
    the saved dtype; where it is not ``value``'s, they land in scratch memory and the copy
    casts them.
    """
    dtype = md.properties.dtype
    itemsize = dtype.itemsize
    same_dtype = dtype == value.dtype
    for dest, t_off, t_size in _target_chunks(value):
        if numel(t_size) == 0:
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
            covered += numel([h - low for low, h in zip(lo, hi, strict=True)])
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
            strides = row_major_strides(s_size)
            first = sum((low - o) * st for low, o, st in zip(lo, s_off, strides, strict=True))
            last = sum((h - 1 - o) * st for h, o, st in zip(hi, s_off, strides, strict=True))
            count = last - first + 1
            start, end = first * itemsize, (last + 1) * itemsize
            if count == numel(extent) and same_dtype and _raw_bytes_are_values(dest_view):
                if dest_view.device.type == "cpu":
                    host = byte_view(dest_view)
                    for piece in range(start, end, READ_PIECE_BYTES):
                        piece_end = min(end, piece + READ_PIECE_BYTES)
                        part = host[piece - start : piece_end - start]
                        reads.append(ReadRequest(src, fqn, piece, piece_end, part))
                else:
                    device = as_bytes(dest_view)
                    for piece in range(start, end, bounce.SLOT_BYTES):
                        piece_end = min(end, piece + bounce.SLOT_BYTES)
                        on_device = device[piece - start : piece_end - start]
                        reads.append(ReadRequest(src, fqn, piece, piece_end, None, on_device))
            else:
                scratch = torch.empty(count, dtype=dtype)
                reads.append(ReadRequest(src, fqn, start, end, byte_view(scratch)))
                copies.append((dest_view, scratch.as_strided(extent, strides), None))
        if covered != numel(t_size):
            raise CorruptCheckpointError(
                f"{reader.path}: the saved chunks of {fqn!r} hold {covered} of the "
                f"{numel(t_size)} elements at offsets {list(t_off)}, size {list(t_size)}; "
                "the checkpoint is missing part of this tensor"
            )


def load(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    *,
    strict: bool = True,
    io_threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
    trusted: Trusted = None,
    progress: Callable[[int], None] | None = None,
    cast: bool = False,
    extensions: ExtensionRegistry | None = None,
) -> None:
    """Load a committed checkpoint into ``state_dict`` in place (see the module docstring).

    ``io_threads`` defaults, on the local disk, to one more than the usable cores, at most
    ``MAX_IO_THREADS``: reading from the page cache is bound by the cores (a copy and a
    hash per byte), and the extra thread keeps a request queued when reads wait on the
    disk. On an object store it is ``OBJECT_STORE_IO_THREADS``.

    ``trusted``: globals the checkpoint's pickles may name beyond the plain data of
    :mod:`..format.safe_types` (classes, functions or ``"module.Name"``), or ``True`` to unpickle
    anything, running what it names (what ``dcp.load`` does). ``progress(nbytes)`` is
    called as tensor bytes land (the ``slipstream`` command's progress bar). ``cast``: a
    tensor saved in another dtype is cast (see the module docstring). ``extensions``: the
    stream extensions records written through DCP's ``FileSystemWriter(_extensions=...)``
    are decoded with (DCP's default registry when ``None``).
    """
    reader = CheckpointReader(checkpoint_id, storage_options, Trust.of(trusted), extensions)
    load_from(
        reader, state_dict, strict=strict, io_threads=io_threads, progress=progress, cast=cast
    )


def open_plan(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    *,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    trusted: Trusted = None,
    cast: bool = False,
    extensions: ExtensionRegistry | None = None,
) -> PlannedLoad:
    """:func:`load`'s checks and plan, nothing read into ``state_dict`` yet: the caller
    carries it out (:mod:`..collective_load`) and closes its reader; arguments as for
    :func:`load`."""
    reader = CheckpointReader(checkpoint_id, storage_options, Trust.of(trusted), extensions)
    try:
        return plan_load(reader, state_dict, strict=strict, cast=cast)
    except CorruptCheckpointError as exc:
        gone = reader.vanished(exc)
        reader.close()
        if gone is exc:
            raise
        raise gone from exc
    except BaseException:
        reader.close()
        raise


def load_from(
    reader: CheckpointReader,
    state_dict: dict[str, Any],
    *,
    strict: bool = True,
    io_threads: int | None = None,
    progress: Callable[[int], None] | None = None,
    cast: bool = False,
) -> None:
    """:func:`load` from a checkpoint already opened; closes ``reader``."""
    started = time.perf_counter()
    try:
        with tracing.span("slipstream.load", url=reader.path):
            planned = plan_load(reader, state_dict, strict=strict, cast=cast, io_threads=io_threads)
            nbytes = planned.read(progress)
            planned.finish()
    except CorruptCheckpointError as exc:
        gone = reader.vanished(exc)
        if gone is exc:
            raise
        raise gone from exc
    finally:
        reader.close()
    log_loaded(reader.path, nbytes, time.perf_counter() - started)


def log_loaded(path: str, nbytes: int, seconds: float) -> None:
    """The one log line of a finished load."""
    logger.info(
        "loaded %s: %.3f GiB read and verified in %.3f s (%.2f GiB/s)",
        path,
        nbytes / 2**30,
        seconds,
        nbytes / 2**30 / max(seconds, 1e-9),
    )


@dataclass
class PlannedLoad:
    """A load checked and planned on this rank, before any byte lands in its state dict.

    ``reads`` are in file order (the same list on every rank that plans the same load);
    :meth:`read` carries them out with the whole-record reads and the plain values, and
    :meth:`finish` then copies what landed in scratch memory into place and hands the
    values and ``Stateful`` entries their state: the state dict is written only once
    every byte of it has been read and verified.
    """

    reader: CheckpointReader
    state_dict: dict[str, Any]
    resolved: dict[str, Any]
    paths: dict[str, Path]
    reads: list[ReadRequest]
    copies: list[_Copy]
    value_keys: list[str]
    io_threads: int
    values: dict[str, Any] = field(default_factory=dict)

    def read(
        self,
        progress: Callable[[int], None] | None = None,
        reads: list[ReadRequest] | None = None,
    ) -> int:
        """Carry out ``reads`` (default: every planned read), the whole-record reads and
        the values' reads; returns the tensor bytes read."""
        todo = self.reads if reads is None else reads
        read_all(self.reader, todo, self.io_threads, progress)
        for i, (dest_view, src, fallback) in enumerate(self.copies):
            if src is None:
                assert fallback is not None, "a copy without a source names its record"
                fqn, s_off, src_box = fallback
                whole = self.reader.read_record_tensor(fqn, s_off)
                self.copies[i] = (dest_view, whole[src_box] if src_box else whole, None)
        for fqn in self.value_keys:
            self.values[fqn] = self.reader.read_value(fqn)
        return sum(r.end - r.start for r in todo)

    def byte_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """Per file, the byte ranges :meth:`read` reads from storage (each read widened to
        its whole checksum blocks, each whole record and value), sorted and merged."""
        found: dict[str, list[tuple[int, int]]] = {}
        for r in self.reads:
            found.setdefault(r.source.file, []).append(fetched_range(r))
        storage_data = self.reader.metadata.storage_data
        indices = [
            MetadataIndex(fallback[0], torch.Size(fallback[1]))
            for _, src, fallback in self.copies
            if src is None and fallback is not None
        ]
        indices += [MetadataIndex(fqn) for fqn in self.value_keys]
        for index in indices:
            info = storage_data[index]
            found.setdefault(info.relative_path, []).append(
                (info.offset, info.offset + info.length)
            )
        return {file: _merged(spans) for file, spans in found.items()}

    def finish(self) -> None:
        """Copy every read into place and give each value and ``Stateful`` its state."""
        for dest_view, src, _ in self.copies:
            assert src is not None, "read() fetched every whole record"
            dest_view.copy_(src)
        for fqn, value in self.values.items():
            set_path(self.resolved, self.paths[fqn], value, match_typed_keys=True)
        for key, value in self.state_dict.items():
            if is_stateful(value):
                value.load_state_dict(self.resolved[key])
            elif key in self.resolved and self.resolved[key] is not value:
                self.state_dict[key] = self.resolved[key]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def default_io_threads(reader: CheckpointReader) -> int:
    """See :func:`load`."""
    if reader.storage.small_reads_are_cheap:
        return min(MAX_IO_THREADS, usable_cores() + 1)
    return OBJECT_STORE_IO_THREADS


def plan_load(
    reader: CheckpointReader,
    state_dict: dict[str, Any],
    *,
    strict: bool,
    cast: bool,
    io_threads: int | None = None,
) -> PlannedLoad:
    """Check ``state_dict`` against the checkpoint and plan the reads that fill it."""
    resolved = resolve_stateful(state_dict)
    flat, paths = flatten(resolved)
    _check_keys(flat, reader.metadata, strict, reader.path, cast)
    reader.check_file_sizes()
    reads: list[ReadRequest] = []
    copies: list[_Copy] = []
    value_keys: list[str] = []
    for fqn, value in flat.items():
        md = reader.metadata.state_dict_metadata[fqn]
        if isinstance(value, torch.Tensor):
            assert isinstance(md, TensorStorageMetadata), "checked by _check_keys"
            plan_reads(reader, fqn, value, md, reads, copies)
        else:
            value_keys.append(fqn)
    reads.sort(key=lambda r: (r.source.file, r.source.data_offset + r.start))
    threads = default_io_threads(reader) if io_threads is None else io_threads
    return PlannedLoad(reader, state_dict, resolved, paths, reads, copies, value_keys, threads)
