"""Commit: turn the ranks' write results into DCP metadata and publish it last, atomically.

A checkpoint directory is committed exactly when its ``.metadata`` exists. Everything it
points to is written and fsync'd first; slipstream's own index (raw data offsets and
block checksums) is written next; ``.metadata`` is renamed into place last and the
directory fsync'd. A crash at any point leaves either the old state or the new one.
"""

from __future__ import annotations

import json
import os
import pickle
import uuid

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..core.checksum import ALGORITHM, BLOCK_BYTES
from .files import write_atomic
from .layout import dtype_from_name
from .plan import SavePlan

METADATA_FILE = ".metadata"
INDEX_FILE = ".slipstream.json"
DCP_VERSION = "1.0.0"


def build_metadata(plan: SavePlan, done: list[dict], checkpoint_id: str) -> Metadata:
    """DCP metadata for a save whose ranks reported ``done`` (index = rank)."""
    state_dict_metadata: dict = {}
    storage_data: dict = {}
    for fqn, (dtype, shape, chunks) in plan.tensor_meta.items():
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(dtype)),
            size=torch.Size(shape),
            chunks=[
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks
            ],
        )
    for records in plan.records_by_rank:
        for i, rec in enumerate(records):
            index = MetadataIndex(rec.chunk.fqn, torch.Size(rec.chunk.offsets), i)
            storage_data[index] = _StorageInfo(rec.file, rec.offset, rec.length)
    for msg in done:
        for fqn, (file, offset, length, _checksum) in msg["values"].items():
            state_dict_metadata[fqn] = BytesStorageMetadata()
            storage_data[MetadataIndex(fqn)] = _StorageInfo(file, offset, length)
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=dict(plan.paths),
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
        version=DCP_VERSION,
    )


def build_index(plan: SavePlan, done: list[dict]) -> dict:
    """slipstream's own index: where raw tensor bytes start and their block checksums."""
    records: dict[str, dict] = {}
    for rank, recs in enumerate(plan.records_by_rank):
        blocks = done[rank]["records"]
        for rec in recs:
            records.setdefault(rec.file, {})[rec.chunk.record_key] = {
                "offset": rec.offset,
                "length": rec.length,
                "data_offset": rec.data_offset,
                "nbytes": rec.nbytes,
                "blocks": blocks[rec.chunk.record_key],
            }
    values = {}
    for msg in done:
        for fqn, (file, offset, length, checksum) in msg["values"].items():
            values[fqn] = {"file": file, "offset": offset, "length": length, "checksum": checksum}
    return {
        "format": "slipstream-index",
        "version": 1,
        "checksum": ALGORITHM,
        "block_bytes": BLOCK_BYTES,
        "records": records,
        "values": values,
    }


def publish(checkpoint_dir: str, metadata: Metadata, index: dict) -> None:
    """Write the index, then ``.metadata`` (the commit point), each atomically.

    The index carries the metadata's ``save_id``: a reader trusts it only for the
    ``.metadata`` it was written with, not for one another tool (``dcp.save`` into the
    same directory) wrote later.
    """
    index = {**index, "save_id": metadata.storage_meta.save_id}
    write_atomic(os.path.join(checkpoint_dir, INDEX_FILE), json.dumps(index).encode())
    write_atomic(os.path.join(checkpoint_dir, METADATA_FILE), pickle.dumps(metadata))


def uncommit(checkpoint_dir: str) -> None:
    """Make an existing checkpoint at this path invisible before it is overwritten."""
    for name in (METADATA_FILE, INDEX_FILE):
        try:
            os.remove(os.path.join(checkpoint_dir, name))
        except FileNotFoundError:
            pass
