"""The bucket plan: which bytes of which tensor travel in which bucket, from which trainer.

Tensors every trainer holds whole are laid out one after another in a virtual byte stream,
each starting on an ``ALIGN`` boundary; bucket ``g`` is the stream range ``[g *
bucket_bytes, (g + 1) * bucket_bytes)``, so a tensor larger than a bucket is simply cut into
slices at bucket boundaries. Bucket ``g`` is owned (packed and sent) by ``trainer_ranks[g %
len(trainer_ranks)]``.

When trainers hold tensors in shards (``holders``: per tensor, the :class:`Part` each
trainer holds and sends, from a DTensor's placements: :mod:`.holders`), each trainer lays its
own parts out in a stream of its own, cut into buckets the same way; bucket ``g`` of the plan
is then the next bucket of the trainers' streams taken in turn, so no trainer sends a byte it
does not hold. A part held by columns (a ``Shard(1)`` shard's band of each row) is a run per
row, each a slice of its own starting on an ``ALIGN`` boundary: the sender packs the band,
and every slice stays one range of the tensor's bytes; a stream's bucket takes at most
``MAX_SLICES`` slices (its header's room), the next starting the next bucket. A tensor every
trainer holds whole goes, a bucket's worth at a time, to the trainer whose stream is
shortest.

A bucket travels as a header (payload size, then one byte per slice: 1 if its bytes are in
the payload) and a payload holding the included slices back to back, each on an ``ALIGN``
boundary. When every slice is included, the payload is byte for byte the bucket's range of
the stream.

A tensor published under several names (aliases: the same storage, offset, shape and stride)
is laid out once, under its first name; its spec lists the others (``TensorSpec.aliases``),
and they are part of the layout, so of the plan id.

Invariant: every rank that builds a plan from the same specs, bucket size, trainer ranks and
holders gets the same plan, with the same ``plan_id``; nothing else is exchanged per publish.
"""

from __future__ import annotations

import collections
import dataclasses
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
#: The most slices a bucket may hold (one byte of its header each).
MAX_SLICES = HEADER_CAP - HEADER_PREFIX

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
class Part:
    """Bytes ``[start, stop)`` of a tensor, sent by trainer rank ``owner`` (which holds them);
    with ``count`` > 1, that run and the ``count - 1`` after it, each ``stride`` bytes on
    from the last (the rows of a band of columns a ``Shard(1)`` shard holds: a strided box,
    the :class:`.runs.Runs` of :meth:`.runs.Runs.of_box`)."""

    owner: int
    start: int
    stop: int
    stride: int = 0
    count: int = 1

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.count

    def run_starts(self) -> range:
        """Where each of its runs starts in the tensor's bytes."""
        return range(self.start, self.start + self.count * max(self.stride, 1), max(self.stride, 1))


#: Per tensor, the parts its trainers send (``None``: every trainer holds it whole).
Holders = tuple[tuple[Part, ...] | None, ...]


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
    holders: Holders | None = None

    @classmethod
    def build(
        cls,
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        trainer_ranks: Sequence[int],
        holders: Holders | None = None,
    ) -> BucketPlan:
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}")
        if holders is not None and all(h is None for h in holders):
            holders = None
        meta = layout_json(specs, bucket_bytes, trainer_ranks, holders)
        plan_id = f"{checksum(meta.encode()):016x}"
        if holders is not None:
            slices, owners = _cut_held(specs, bucket_bytes, trainer_ranks, holders)
            return cls.assemble(
                specs, slices, bucket_bytes, trainer_ranks, plan_id, owners, holders
            )
        slices = []
        cursor = 0
        for i, spec in enumerate(specs):
            cursor = cut_tensor(i, spec, cursor, bucket_bytes, slices)
        return cls.assemble(specs, slices, bucket_bytes, trainer_ranks, plan_id)

    @classmethod
    def assemble(
        cls,
        specs: Sequence[TensorSpec],
        slices: Sequence[Slice],
        bucket_bytes: int,
        trainer_ranks: Sequence[int],
        plan_id: str,
        bucket_owners: Sequence[int] | None = None,
        holders: Holders | None = None,
    ) -> BucketPlan:
        """The plan of ``specs`` cut into ``slices`` (by :func:`cut_tensor`, in bucket
        order), under ``plan_id``; bucket ``g`` is owned by ``bucket_owners[g]``, else by the
        trainers in turn."""
        owners = tuple(trainer_ranks)
        num_buckets = slices[-1].bucket + 1 if slices else 0
        buckets: list[Bucket] = []
        j = 0
        for g in range(num_buckets):
            first = j
            while j < len(slices) and slices[j].bucket == g:
                j += 1
            nbytes = max((s.bucket_offset + s.nbytes for s in slices[first:j]), default=0)
            owner = bucket_owners[g] if bucket_owners is not None else owners[g % len(owners)]
            buckets.append(Bucket(g, owner, first, j - first, nbytes))
        return cls(
            tuple(specs), tuple(slices), tuple(buckets), bucket_bytes, owners, plan_id, holders
        )

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

    def parts_of(self, i: int, rank: int) -> tuple[Part, ...]:
        """The parts of tensor ``i`` trainer ``rank`` sends (every trainer holds a tensor
        with no holders whole, and may send any of its bytes)."""
        held = self.holders[i] if self.holders is not None else None
        if held is None:
            return (Part(rank, 0, self.specs[i].nbytes),)
        return tuple(p for p in held if p.owner == rank)

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
    specs: Sequence[TensorSpec],
    bucket_bytes: int,
    trainer_ranks: Sequence[int],
    holders: Holders | None = None,
) -> str:
    """The metadata that crosses the store once per layout."""
    meta: dict[str, object] = {
        "specs": [
            [s.name, list(s.shape), s.dtype, *([list(s.aliases)] if s.aliases else [])]
            for s in specs
        ],
        "bucket_bytes": bucket_bytes,
        "trainer_ranks": list(trainer_ranks),
    }
    if holders is not None:
        meta["holders"] = [
            None if parts is None else [_part_json(p) for p in parts] for parts in holders
        ]
    return json.dumps(meta)


def _part_json(p: Part) -> list[int]:
    contiguous = [p.owner, p.start, p.stop]
    return contiguous if p.count == 1 else [*contiguous, p.stride, p.count]


def plan_from_json(meta: str) -> BucketPlan:
    obj = json.loads(meta)
    specs = [
        TensorSpec(n, tuple(shape), dt, tuple(aliases[0]) if aliases else ())
        for n, shape, dt, *aliases in obj["specs"]
    ]
    held = obj.get("holders")
    holders = (
        None
        if held is None
        else tuple(None if ps is None else tuple(Part(*p) for p in ps) for ps in held)
    )
    return BucketPlan.build(specs, obj["bucket_bytes"], obj["trainer_ranks"], holders)


def _cut_held(
    specs: Sequence[TensorSpec],
    bucket_bytes: int,
    trainer_ranks: Sequence[int],
    holders: Holders,
) -> tuple[list[Slice], list[int]]:
    """The slices of ``specs`` laid out in a stream per trainer (see the module doc), each
    numbered with its bucket in the plan, in bucket order; and each bucket's owner."""
    streams: dict[int, list[Slice]] = {t: [] for t in trainer_ranks}
    cursors = dict.fromkeys(trainer_ranks, 0)
    filled: dict[tuple[int, int], int] = collections.defaultdict(int)  # slices per bucket
    for i, spec in enumerate(specs):
        parts = holders[i]
        if parts is None:
            parts = _spread(spec.nbytes, bucket_bytes, cursors)
        for part in parts:
            cursor = cursors[part.owner]
            cursors[part.owner] = _cut_part(i, part, cursor, bucket_bytes, streams, filled)
    counts = {t: max((s.bucket + 1 for s in own), default=0) for t, own in streams.items()}
    numbering: dict[tuple[int, int], int] = {}
    owners: list[int] = []
    for k in range(max(counts.values(), default=0)):
        for t in trainer_ranks:
            if k < counts[t]:
                numbering[(t, k)] = len(owners)
                owners.append(t)
    slices = [
        dataclasses.replace(s, bucket=numbering[(t, s.bucket)])
        for t, own in streams.items()
        for s in own
    ]
    slices.sort(key=lambda s: (s.bucket, s.bucket_offset))
    return slices, owners


def _spread(nbytes: int, bucket_bytes: int, cursors: dict[int, int]) -> tuple[Part, ...]:
    """Parts of a tensor every trainer holds whole: a bucket's worth at a time, each to the
    trainer whose stream is shortest then (a zero-byte tensor: one empty part)."""
    lengths = dict(cursors)
    parts, start = [], 0
    while True:
        owner = min(lengths, key=lambda t: (lengths[t], t))
        stop = min(nbytes, start + bucket_bytes)
        parts.append(Part(owner, start, stop))
        lengths[owner] = align(lengths[owner]) + stop - start
        start = stop
        if start >= nbytes:
            return tuple(parts)


def _cut_part(
    i: int,
    part: Part,
    cursor: int,
    bucket_bytes: int,
    streams: dict[int, list[Slice]],
    counts: dict[tuple[int, int], int],
) -> int:
    """Lay ``part`` of tensor ``i`` out in its owner's stream from ``cursor``, each of its
    runs from an ``ALIGN`` boundary, cut at that stream's bucket boundaries (so every slice
    is one range of the tensor's bytes, as a rollout places it, and starts aligned, as a
    payload packs it); return where it ends. A bucket that holds ``MAX_SLICES`` slices
    (``counts``: per owner and bucket) is full: the next slice starts the next bucket (the
    rows of a narrow band of columns are a slice each). A slice's bucket is the owner's own
    bucket number here (renumbered in the plan by :func:`_cut_held`)."""
    out = streams[part.owner]
    pos = align(cursor)
    if part.nbytes == 0:
        pos = _room(part.owner, pos, bucket_bytes, counts)
        out.append(Slice(i, part.start, 0, pos // bucket_bytes, pos % bucket_bytes))
        counts[(part.owner, pos // bucket_bytes)] += 1
        return pos
    length = part.stop - part.start
    for run in part.run_starts():
        pos = align(pos)
        done = 0
        while done < length:
            pos = _room(part.owner, pos, bucket_bytes, counts)
            g = pos // bucket_bytes
            n = min(length - done, (g + 1) * bucket_bytes - pos)
            out.append(Slice(i, run + done, n, g, pos - g * bucket_bytes))
            counts[(part.owner, g)] += 1
            pos += n
            done += n
    return pos


def _room(owner: int, pos: int, bucket_bytes: int, counts: dict[tuple[int, int], int]) -> int:
    """Where the next slice of ``owner``'s stream goes: ``pos``, or the start of the next
    bucket when ``pos``'s is full."""
    g = pos // bucket_bytes
    return (g + 1) * bucket_bytes if counts[(owner, g)] >= MAX_SLICES else pos
