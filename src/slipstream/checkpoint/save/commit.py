"""Commit: turn the ranks' write results into DCP metadata and publish it last, atomically.

A checkpoint location is committed exactly when its ``.metadata`` exists. Everything it
points to is written and made durable first (fsync'd files; completed multipart uploads);
slipstream's own index (raw data offsets and block checksums) is put next; ``.metadata``
is put last, atomically (a rename and a directory fsync on the local disk, one PUT on an
object store). A crash at any point leaves either the old state or the new one.
"""

from __future__ import annotations

import pickle
import uuid
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ...core.dtypes import dtype_from_name
from ...core.flatten import Path
from ..format.index import CheckpointIndex, IndexRecord
from ..format.names import GENERATIONS, METADATA_FILE, data_file, index_file
from ..storage import Storage
from .messages import WriteReport
from .plan import SavePlan

DCP_VERSION = "1.0.0"


@dataclass
class CommitTemplate:
    """The DCP metadata entries of a plan's tensor records, made once per plan.

    They depend on the plan alone, so every commit of the plan shares them and makes only
    the entries of its plain values. That keeps a steady-state commit from creating
    thousands of objects that live through it. In a training process holding hundreds of
    thousands of Python objects, such a burst on a background thread sets off full garbage
    collections that hold the GIL (measured in docs/save-cost.md).
    """

    tensors: dict[str, TensorStorageMetadata]
    records: dict[MetadataIndex, _StorageInfo]
    paths: dict[str, Path]

    @classmethod
    def for_plan(cls, plan: SavePlan, generation: int) -> CommitTemplate:
        """The template of ``plan`` written in ``generation`` (see :mod:`..format.names`)."""
        tensors = {
            fqn: dcp_metadata.TensorStorageMetadata(
                properties=dcp_metadata.TensorProperties(dtype=dtype_from_name(dtype)),
                size=torch.Size(shape),
                chunks=[
                    dcp_metadata.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                    for c in chunks
                ],
            )
            for fqn, (dtype, shape, chunks) in plan.tensor_meta.items()
        }
        records = {
            dcp_metadata.MetadataIndex(
                rec.chunk.fqn, torch.Size(rec.chunk.offsets), i
            ): _StorageInfo(data_file(rec.file, generation), rec.offset, rec.length)
            for recs in plan.records_by_rank
            for i, rec in enumerate(recs)
        }
        return cls(tensors, records, dict(plan.paths))


def build_metadata(
    template: CommitTemplate,
    done: list[WriteReport],
    checkpoint_id: str,
    storage_meta: dcp_metadata.StorageMeta | None = None,
) -> Metadata:
    """DCP metadata for a save of ``template``'s plan whose ranks reported ``done`` (index =
    rank): the template's tensor entries, shared, and the entries of this save's values.
    Its ``storage_meta`` is ``storage_meta`` (a DCP writer's, as DCP records it), else a
    new ``save_id`` at ``checkpoint_id``."""
    state_dict_metadata: dict[str, STORAGE_TYPES] = dict(template.tensors)
    storage_data: dict[MetadataIndex, _StorageInfo] = dict(template.records)
    for report in done:
        for fqn, value in report.values.items():
            state_dict_metadata[fqn] = dcp_metadata.BytesStorageMetadata()
            storage_data[dcp_metadata.MetadataIndex(fqn)] = _StorageInfo(
                value.file, value.offset, value.length
            )
    return dcp_metadata.Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=template.paths,
        storage_data=storage_data,
        storage_meta=storage_meta
        or dcp_metadata.StorageMeta(checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4())),
        version=DCP_VERSION,
    )


def build_index(plan: SavePlan, done: list[WriteReport], generation: int) -> CheckpointIndex:
    """slipstream's own index: where raw tensor bytes start and their block checksums."""
    records: dict[str, dict[str, IndexRecord]] = {}
    for rank, recs in enumerate(plan.records_by_rank):
        blocks = done[rank].records
        for rec in recs:
            records.setdefault(data_file(rec.file, generation), {})[rec.chunk.record_key] = (
                IndexRecord(
                    rec.offset,
                    rec.length,
                    rec.data_offset,
                    rec.nbytes,
                    blocks[rec.chunk.record_key],
                )
            )
    values = {fqn: value for report in done for fqn, value in report.values.items()}
    return CheckpointIndex(
        records, values, key_types=plan.key_types or None, containers=plan.containers or None
    )


def publish(storage: Storage, metadata: Metadata, index: CheckpointIndex, generation: int) -> None:
    """Write the index of ``generation``, then ``.metadata`` (the commit point), each
    atomically.

    The index carries the metadata's ``save_id``: a reader trusts it only for the
    ``.metadata`` it was written with, not for one another tool (``dcp.save`` into the
    same directory) wrote later.
    """
    assert metadata.storage_meta is not None, "build_metadata always sets storage_meta"
    index.save_id = metadata.storage_meta.save_id
    storage.put_atomic(index_file(generation), index.to_json())
    storage.put_atomic(METADATA_FILE, pickle.dumps(metadata))


def uncommit(storage: Storage) -> None:
    """Make the checkpoint at this location invisible (before it is deleted)."""
    storage.delete(METADATA_FILE)
    for generation in range(GENERATIONS):
        storage.delete(index_file(generation))
