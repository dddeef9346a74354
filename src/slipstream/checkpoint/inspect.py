"""Reading a checkpoint without a model: what it holds, whether it verifies, full tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.dtypes import dtype_name
from ..core.shapes import numel
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


def summarize(checkpoint_id: str | os.PathLike[str]) -> tuple[list[EntrySummary], bool]:
    """The entries of a committed checkpoint and whether it carries slipstream checksums."""
    reader = CheckpointReader(checkpoint_id)
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
    checkpoint_id: str | os.PathLike[str], keys: list[str] | None = None
) -> dict[str, Any]:
    """Every entry (or ``keys``) as full CPU tensors / values, flat-keyed; verifies checksums."""
    reader = CheckpointReader(checkpoint_id)
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
    load(target, checkpoint_id, strict=keys is None)
    return target
