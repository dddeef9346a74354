"""The bucket plan: which bytes of which tensor travel in which bucket, from which trainer.

Tensors are laid out one after another in a virtual byte stream, each starting on an
``ALIGN`` boundary; bucket ``g`` is the stream range ``[g * bucket_bytes, (g + 1) *
bucket_bytes)``, so a tensor larger than a bucket is simply cut into slices at bucket
boundaries. Bucket ``g`` is owned (packed and sent) by ``trainer_ranks[g % len(trainer_ranks)]``.

A bucket travels as a header (payload size, then one byte per slice: 1 if its bytes are in
the payload) and a payload holding the included slices back to back, each on an ``ALIGN``
boundary. When every slice is included, the payload is byte for byte the bucket's range of
the stream.

A tensor published under several names (aliases: the same storage, offset, shape and stride)
is laid out once, under its first name; its spec lists the others (``TensorSpec.aliases``),
and they are part of the layout, so of the plan id.

Invariant: every rank that builds a plan from the same specs, bucket size and trainer ranks
gets the same plan, with the same ``plan_id``; nothing else is exchanged per publish.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ...core.checksum import checksum
from ...core.dtypes import dtype_from_name
from ...core.shapes import numel

ALIGN = 64
HEADER_PREFIX = 8
#: The most bytes a bucket's header may take (prefix and mask); every receiver reserves it.
HEADER_CAP = 64 * 1024

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = ()  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> bool:
    return bool(DTensor) and isinstance(t, DTensor)


class LayoutMismatch(ValueError):
    """What an iterator yielded differs from the layout its publish was planned with."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def cut_tensor(
    i: int, spec: TensorSpec, cursor: int, bucket_bytes: int, slices: list[Slice]
) -> int:
    """Lay tensor ``i`` out in the stream from ``cursor`` (aligned up): append its slices,
    cut at bucket boundaries, to ``slices``; return where it ends."""
    start = align(cursor)
    end = start + spec.nbytes
    if spec.nbytes == 0:
        slices.append(Slice(i, 0, 0, start // bucket_bytes, start % bucket_bytes))
    pos = start
    while pos < end:
        g = pos // bucket_bytes
        stop = min(end, (g + 1) * bucket_bytes)
        slices.append(Slice(i, pos - start, stop - pos, g, pos - g * bucket_bytes))
        pos = stop
    return end


@dataclass(frozen=True)
class TensorSpec:
    """A published tensor: its name, global shape and dtype, and ``aliases``: the other names
    it was published under (tensors sharing its storage, offset, shape and stride, such as
    an ``lm_head.weight`` tied to the input embedding). Its bytes are sent once; a rollout
    applies them under every name."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the tensor goes by, its own first."""
        return (self.name, *self.aliases)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.torch_dtype.itemsize


@dataclass(frozen=True)
class Slice:
    """Bytes ``[tensor_offset, tensor_offset + nbytes)`` of tensor ``tensor``, in ``bucket``."""

    tensor: int
    tensor_offset: int
    nbytes: int
    bucket: int
    bucket_offset: int


@dataclass(frozen=True)
class Bucket:
    """Bucket ``index``: slices ``[first_slice, first_slice + num_slices)``, sent by ``owner``."""

    index: int
    owner: int
    first_slice: int
    num_slices: int
    nbytes: int

    @property
    def header_bytes(self) -> int:
        return HEADER_PREFIX + self.num_slices


@dataclass(frozen=True)
class BucketPlan:
    """The layout every rank derives from the same specs, bucket size and trainer ranks."""

    specs: tuple[TensorSpec, ...]
    slices: tuple[Slice, ...]
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    trainer_ranks: tuple[int, ...]
    plan_id: str

    @classmethod
    def build(
        cls, specs: Sequence[TensorSpec], bucket_bytes: int, trainer_ranks: Sequence[int]
    ) -> BucketPlan:
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}")
        slices: list[Slice] = []
        cursor = 0
        for i, spec in enumerate(specs):
            cursor = cut_tensor(i, spec, cursor, bucket_bytes, slices)
        meta = layout_json(specs, bucket_bytes, trainer_ranks)
        plan_id = f"{checksum(meta.encode()):016x}"
        return cls.assemble(specs, slices, bucket_bytes, trainer_ranks, plan_id)

    @classmethod
    def assemble(
        cls,
        specs: Sequence[TensorSpec],
        slices: Sequence[Slice],
        bucket_bytes: int,
        trainer_ranks: Sequence[int],
        plan_id: str,
    ) -> BucketPlan:
        """The plan of ``specs`` cut into ``slices`` (by :func:`cut_tensor`), under
        ``plan_id``."""
        owners = tuple(trainer_ranks)
        num_buckets = slices[-1].bucket + 1 if slices else 0
        buckets: list[Bucket] = []
        j = 0
        for g in range(num_buckets):
            first = j
            while j < len(slices) and slices[j].bucket == g:
                j += 1
            nbytes = max((s.bucket_offset + s.nbytes for s in slices[first:j]), default=0)
            buckets.append(Bucket(g, owners[g % len(owners)], first, j - first, nbytes))
        return cls(tuple(specs), tuple(slices), tuple(buckets), bucket_bytes, owners, plan_id)

    def bucket_slices(self, g: int) -> tuple[Slice, ...]:
        b = self.buckets[g]
        return self.slices[b.first_slice : b.first_slice + b.num_slices]

    @cached_property
    def last_bucket(self) -> tuple[int, ...]:
        """For each tensor, the bucket holding its last slice."""
        last = [0] * len(self.specs)
        for s in self.slices:
            last[s.tensor] = s.bucket
        return tuple(last)

    @cached_property
    def first_bucket(self) -> tuple[int, ...]:
        first = [-1] * len(self.specs)
        for s in self.slices:
            if first[s.tensor] < 0:
                first[s.tensor] = s.bucket
        return tuple(first)

    @cached_property
    def stream_offset(self) -> tuple[int, ...]:
        """Each tensor's start in the stream (its first slice's bucket start plus offset)."""
        out = [0] * len(self.specs)
        seen = set()
        for s in self.slices:
            if s.tensor not in seen:
                seen.add(s.tensor)
                out[s.tensor] = s.bucket * self.bucket_bytes + s.bucket_offset
        return tuple(out)

    @property
    def stream_bytes(self) -> int:
        if not self.buckets:
            return 0
        return (len(self.buckets) - 1) * self.bucket_bytes + self.buckets[-1].nbytes

    @property
    def max_header_bytes(self) -> int:
        return max((b.header_bytes for b in self.buckets), default=HEADER_PREFIX)

    def owned(self, rank: int) -> list[int]:
        return [b.index for b in self.buckets if b.owner == rank]

    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def payload_offsets(slices: Sequence[Slice], mask: Sequence[int]) -> tuple[list[int], int]:
    """Offsets in the payload of the included slices (-1 for skipped ones), and its size."""
    offsets = []
    cursor = 0
    for s, keep in zip(slices, mask, strict=True):
        if keep:
            cursor = align(cursor)
            offsets.append(cursor)
            cursor += s.nbytes
        else:
            offsets.append(-1)
    return offsets, cursor


def encode_header(out: torch.Tensor, payload_bytes: int, mask: Sequence[int]) -> torch.Tensor:
    """Write a bucket header into the uint8 tensor ``out``; return the used prefix."""
    n = HEADER_PREFIX + len(mask)
    raw = struct.pack("<q", payload_bytes) + bytes(mask)
    out[:n].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out[:n]


def decode_header(header: torch.Tensor, num_slices: int) -> tuple[int, list[int]]:
    raw = bytes(header[: HEADER_PREFIX + num_slices].tolist())
    (payload_bytes,) = struct.unpack("<q", raw[:HEADER_PREFIX])
    return payload_bytes, list(raw[HEADER_PREFIX:])


def layout_json(
    specs: Sequence[TensorSpec], bucket_bytes: int, trainer_ranks: Sequence[int]
) -> str:
    """The metadata that crosses the store once per layout."""
    return json.dumps(
        {
            "specs": [
                [s.name, list(s.shape), s.dtype, *([list(s.aliases)] if s.aliases else [])]
                for s in specs
            ],
            "bucket_bytes": bucket_bytes,
            "trainer_ranks": list(trainer_ranks),
        }
    )


def plan_from_json(meta: str) -> BucketPlan:
    obj = json.loads(meta)
    specs = [
        TensorSpec(n, tuple(shape), dt, tuple(aliases[0]) if aliases else ())
        for n, shape, dt, *aliases in obj["specs"]
    ]
    return BucketPlan.build(specs, obj["bucket_bytes"], obj["trainer_ranks"])
