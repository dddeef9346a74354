"""Reading a checkpoint without a model: what it holds, whether it verifies, full tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...core.dtypes import dtype_name
from ...core.shapes import numel
from ..format.safe_types import Trust, Trusted
from ..storage import Location
from .loader import load
from .reader import CheckpointReader


@dataclass(frozen=True)
class EntrySummary:
    """One key of a checkpoint: a tensor (dtype, global shape, chunks) or a plain value."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    chunks: int
    nbytes: int


def summarize(
    checkpoint_id: Location, *, trusted: Trusted = None
) -> tuple[list[EntrySummary], bool]:
    """The entries of a committed checkpoint and whether it carries slipstream checksums."""
    reader = CheckpointReader(checkpoint_id, trust=Trust.of(trusted))
    try:
        entries = []
        for key, md in reader.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                entries.append(
                    EntrySummary(
                        key,
                        "tensor",
                        dtype_name(dtype),
                        tuple(md.size),
                        len(md.chunks),
                        numel(md.size) * dtype.itemsize,
                    )
                )
            else:
                entries.append(EntrySummary(key, "value", "", (), 1, 0))
        return entries, reader.index is not None
    finally:
        reader.close()


def read_all(
    checkpoint_id: Location,
    keys: list[str] | None = None,
    *,
    trusted: Trusted = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Every entry (or ``keys``) as full CPU tensors / values, flat-keyed; verifies checksums.

    ``progress(nbytes)`` is called as tensor bytes are read (see :func:`tensor_bytes`)."""
    reader = CheckpointReader(checkpoint_id, trust=Trust.of(trusted))
    try:
        wanted = keys if keys is not None else list(reader.metadata.state_dict_metadata)
        target: dict[str, Any] = {}
        for key in wanted:
            md = reader.metadata.state_dict_metadata.get(key)
            if isinstance(md, TensorStorageMetadata):
                target[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                target[key] = None
    finally:
        reader.close()
    load(target, checkpoint_id, strict=keys is None, trusted=trusted, progress=progress)
    return target


def tensor_bytes(checkpoint_id: Location, *, trusted: Trusted = None) -> int:
    """The bytes of tensor data :func:`read_all` reads for the whole checkpoint."""
    entries, _ = summarize(checkpoint_id, trusted=trusted)
    return sum(e.nbytes for e in entries)


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` read and what it could check it against."""

    files: int
    """Data files the checkpoint's metadata refers to."""
    file_bytes: int
    """Their total size."""
    tensor_bytes: int
    """Tensor data read (every byte of every record)."""
    entries: int
    """Keys read: tensors and plain values."""
    checksummed_blocks: int
    """Blocks of tensor data verified against slipstream's checksums."""
    checksummed_values: int
    """Plain values verified against slipstream's checksums."""

    @property
    def checksummed(self) -> bool:
        """Whether the checkpoint carried checksums (written by slipstream, index intact);
        without them, only its structure and sizes could be checked."""
        return self.checksummed_blocks + self.checksummed_values > 0


def verify(
    checkpoint_id: Location,
    *,
    trusted: Trusted = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Read every byte of a committed checkpoint, checking every checksum it carries.

    Raises on a missing or truncated file, a checksum mismatch, or an unreadable record.
    Every checksum is checked: each record read whole covers all of its blocks."""
    reader = CheckpointReader(checkpoint_id, trust=Trust.of(trusted))
    try:
        files = sorted({info.relative_path for info in reader.metadata.storage_data.values()})
        file_bytes = sum(reader.storage.size(name) for name in files)
        index = reader.index
    finally:
        reader.close()
    entries = read_all(checkpoint_id, trusted=trusted, progress=progress)
    blocks = values = 0
    if index is not None:
        blocks = sum(
            len(record.blocks) for records in index.records.values() for record in records.values()
        )
        values = len(index.values)
    nbytes = sum(
        v.numel() * v.element_size() for v in entries.values() if isinstance(v, torch.Tensor)
    )
    return VerifyReport(len(files), file_bytes, nbytes, len(entries), blocks, values)
