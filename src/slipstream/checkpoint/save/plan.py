"""The save plan: which rank writes which chunk, where in which file.

Every rank derives the same :class:`SavePlan` from the layouts of all ranks, so no plan
is ever sent around. Replicated chunks (plain tensors, replicated DTensor shards) are
written once, by the holder with the fewest bytes assigned so far, so writing is spread
over ranks. Records are 64-byte aligned in each rank's file, and a rank's tensor records
come first, so its staging buffer is byte for byte the head of its file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from ...core.buffers import byte_view
from ...core.dtypes import dtype_from_name
from ...core.flatten import Containers, KeyTypes, Path
from ...errors import CheckpointError
from ..format.names import data_file_name
from ..format.records import tensor_frame
from .layout import ChunkSpec
from .messages import LayoutDescription, PlanView

RECORD_ALIGN = 64


@dataclass(frozen=True)
class RecordPlan:
    """One tensor record: ``length`` bytes at ``offset`` in ``file``, data at ``data_offset``."""

    chunk: ChunkSpec
    file: str
    offset: int
    length: int
    data_offset: int
    nbytes: int


@dataclass
class SavePlan:
    """The global plan, identical on every rank, plus the view of one rank."""

    rank: int
    world_size: int
    fingerprints: list[str]
    records_by_rank: list[list[RecordPlan]]
    image_bytes_by_rank: list[int]
    value_owner: dict[str, int]
    tensor_meta: dict[str, tuple[str, tuple[int, ...], list[ChunkSpec]]]
    paths: dict[str, Path]
    key_types: KeyTypes = field(default_factory=dict)
    """The types of the state dict's non-string keys, every rank's (recorded in the index)."""
    containers: Containers = field(default_factory=dict)
    """The state dict's empty and non-``dict`` mappings, every rank's (recorded in the index)."""

    @property
    def records(self) -> list[RecordPlan]:
        return self.records_by_rank[self.rank]

    @cached_property
    def data_bytes(self) -> int:
        """Tensor bytes this rank writes (its records' data, framing aside)."""
        return sum(rec.nbytes for rec in self.records)

    @property
    def image_bytes(self) -> int:
        return self.image_bytes_by_rank[self.rank]

    @property
    def file(self) -> str:
        return data_file_name(self.rank)

    def write_frames(self, image: torch.Tensor) -> None:
        """Put this rank's every record's constant zip bytes in place around its (still
        empty) data, in ``image`` (a host ``uint8`` buffer of :attr:`image_bytes`)."""
        view = byte_view(image)
        for rec in self.records:
            frame = tensor_frame(dtype_from_name(rec.chunk.dtype), rec.chunk.sizes)
            view[rec.offset : rec.offset + len(frame.prefix)] = frame.prefix
            end = rec.data_offset + rec.nbytes
            view[end : end + len(frame.suffix)] = frame.suffix

    def my_values(self) -> list[str]:
        return [fqn for fqn, owner in self.value_owner.items() if owner == self.rank]

    def view_of(self, rank: int) -> PlanView:
        """What ``rank`` needs of this plan to write its part (see :func:`plan_from_view`)."""
        records = [
            [
                r.chunk.fqn,
                r.chunk.dtype,
                list(r.chunk.global_shape),
                list(r.chunk.offsets),
                list(r.chunk.sizes),
                r.chunk.replicated,
                r.offset,
                r.length,
                r.data_offset,
                r.nbytes,
            ]
            for r in self.records_by_rank[rank]
        ]
        values = [fqn for fqn, owner in self.value_owner.items() if owner == rank]
        return PlanView(
            self.world_size,
            self.fingerprints[rank],
            self.image_bytes_by_rank[rank],
            records,
            values,
        )


def plan_from_view(rank: int, view: PlanView) -> SavePlan:
    """``rank``'s plan from rank 0's :class:`PlanView`: its own records, file size, values
    and fingerprint, exactly as in rank 0's plan; the other ranks' parts empty (only rank 0
    commits, from its own whole plan)."""
    others: list[RecordPlan] = []  # one empty list for every other rank: never appended to
    records_by_rank = [others] * view.world_size
    image_bytes = [0] * view.world_size
    fingerprints = [""] * view.world_size
    records_by_rank[rank] = [
        RecordPlan(
            chunk=ChunkSpec(
                str(fqn), str(dtype), tuple(shape), tuple(offsets), tuple(sizes), bool(replicated)
            ),
            file=data_file_name(rank),
            offset=int(offset),
            length=int(length),
            data_offset=int(data_offset),
            nbytes=int(nbytes),
        )
        for fqn, dtype, shape, offsets, sizes, replicated, offset, length, data_offset, nbytes in (
            view.records
        )
    ]
    image_bytes[rank] = view.image_bytes
    fingerprints[rank] = view.fingerprint
    return SavePlan(
        rank=rank,
        world_size=view.world_size,
        fingerprints=fingerprints,
        records_by_rank=records_by_rank,
        image_bytes_by_rank=image_bytes,
        value_owner=dict.fromkeys(view.values, rank),
        tensor_meta={},
        paths={},
    )


def _align(n: int) -> int:
    return (n + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def make_save_plan(
    rank: int, descriptions: list[LayoutDescription], fingerprints: list[str]
) -> SavePlan:
    """Build the plan from every rank's :class:`LayoutDescription` (index = rank)."""
    world_size = len(descriptions)
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    specs: dict[tuple[str, tuple[int, ...], tuple[int, ...]], ChunkSpec] = {}
    tensor_meta: dict[str, tuple[str, tuple[int, ...], list[ChunkSpec]]] = {}
    value_holders: dict[str, list[int]] = {}
    paths: dict[str, Path] = {}
    key_types: KeyTypes = {}
    containers: Containers = {}
    for r, desc in enumerate(descriptions):
        paths.update(desc.paths)
        key_types.update(desc.key_types)
        containers.update(desc.containers)
        for c in desc.chunks:
            seen = tensor_meta.get(c.fqn)
            if seen is not None and (seen[0], seen[1]) != (c.dtype, c.global_shape):
                raise CheckpointError(
                    f"ranks disagree on tensor {c.fqn!r}: dtype/shape {seen[0]}{list(seen[1])} "
                    f"on one rank, {c.dtype}{list(c.global_shape)} on rank {r}"
                )
            if seen is None:
                tensor_meta[c.fqn] = (c.dtype, c.global_shape, [])
            key = (c.fqn, c.offsets, c.sizes)
            if key not in specs:
                specs[key] = c
                tensor_meta[c.fqn][2].append(c)
            holders.setdefault(key, []).append(r)
        for fqn in desc.values:
            value_holders.setdefault(fqn, []).append(r)
    clash = sorted(set(tensor_meta) & set(value_holders))
    if clash:
        raise CheckpointError(
            f"keys hold a tensor on some ranks and a plain value on others: {clash}"
        )

    assigned = [0] * world_size
    owner: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    for key in sorted(specs, key=lambda k: (-specs[k].nbytes, k)):
        rank_choice = min(holders[key], key=lambda r: (assigned[r], r))
        owner[key] = rank_choice
        assigned[rank_choice] += specs[key].nbytes

    records_by_rank: list[list[RecordPlan]] = [[] for _ in range(world_size)]
    image_bytes = [0] * world_size
    for r, desc in enumerate(descriptions):
        cursor = 0
        for c in desc.chunks:
            key = (c.fqn, c.offsets, c.sizes)
            if owner.get(key) != r:
                continue
            owner.pop(key)
            frame = tensor_frame(dtype_from_name(c.dtype), c.sizes)
            records_by_rank[r].append(
                RecordPlan(
                    chunk=c,
                    file=data_file_name(r),
                    offset=cursor,
                    length=frame.length,
                    data_offset=cursor + frame.data_offset,
                    nbytes=frame.nbytes,
                )
            )
            cursor = _align(cursor + frame.length)
        image_bytes[r] = cursor
    value_owner = {fqn: min(rs) for fqn, rs in value_holders.items()}
    return SavePlan(
        rank=rank,
        world_size=world_size,
        fingerprints=list(fingerprints),
        records_by_rank=records_by_rank,
        image_bytes_by_rank=image_bytes,
        value_owner=value_owner,
        tensor_meta=tensor_meta,
        paths=paths,
        key_types=key_types,
        containers=containers,
    )
