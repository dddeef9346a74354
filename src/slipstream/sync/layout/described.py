"""Self-describing buckets: a channel's first streamed version, laid out as it is read.

A publish needs a plan (which bytes of which tensor travel in which bucket) before its first
bucket leaves, and a plan comes from the layout: the names, shapes and dtypes. A publisher's
first publish from an iterator knows no layout, and learning it by reading the iterator
whole would hold every tensor at once. Instead the layout is learned as the iterator yields
and travels with the buckets: bucket g's header names the tensors that start in it (name,
shape, dtype) and, once the iterator has ended, how many buckets the version has.

The plan is a pure function of the layout in which bucket g holds only bytes of tensors that
start in it or before it (:func:`.plan.cut_tensor`), so the plan of the tensors seen so far
(:class:`GrowingLayout`) lays out every bucket up to the last one they start in exactly as
the whole layout's plan will. The trainers, reading the same iterator, grow the same plan;
the rollouts grow it from the headers, bucket by bucket, and learn the layout while they
receive. From the version after, publisher and rollouts use the whole plan like any other.

Such a round is a *described* round: its :class:`..round.protocol.RoundStart` names
:data:`DESCRIBED` where a plan id goes, and each of its bucket headers is
:data:`DESCRIBED_HEADER_BYTES` long: the payload size (as in every header), the length of
the description, then the description (compressed JSON: the tensors, the bucket count once
known, and a running checksum of the layout so far, so a trainer whose iterator yielded
another layout than the others is named rather than mixed in). Every slice of a described
bucket is in its payload.

Tied names: a described round finds no ties (it keeps no tensor it has sent, to compare
storages with), so a name yielded twice for one tensor carries its bytes twice; ties given
in a layout (:meth:`..publisher.WeightPublisher.set_layout`, a mapping) are sent once.

Invariant: when a bucket of a described round leaves a trainer, every tensor that starts in
it or before it has been read, and either a tensor that starts or continues after it was
read too (so a later bucket exists) or the iterator has ended (so its header gives the
count); the receiving side never asks for a bucket that does not exist.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from ...core.buffers import as_bytes
from ...core.checksum import checksum
from ...core.dtypes import dtype_name
from ...errors import SyncError
from .plan import (
    HEADER_CAP,
    HEADER_PREFIX,
    Bucket,
    BucketPlan,
    LayoutMismatch,
    Slice,
    TensorSpec,
    cut_tensor,
    is_dtensor,
)

#: The plan id a described round's start names in place of one.
DESCRIBED = "described"
#: Every header of a described round is this long (the receiver posts it before knowing
#: what it holds): the cap every receiver is built for.
DESCRIBED_HEADER_BYTES = HEADER_CAP
_LENGTH = struct.Struct("<I")


class GrowingLayout:
    """The layout of a described round as far as it is known, laid out as a plan.

    On a trainer, :meth:`add` appends each tensor as the iterator yields it and
    :meth:`end` notes that it ended. On a rollout, :meth:`learn` reads each bucket's
    header, in bucket order. It reads like a :class:`.plan.BucketPlan` (``specs``,
    ``slices``, ``buckets``, ``bucket_slices``, ``first_bucket``, ``last_bucket``; its
    ``plan_id`` is :data:`DESCRIBED`), grown in place, each tensor cut once: every bucket
    whose tensors are all known is laid out as in the whole layout's plan (:meth:`final`)."""

    plan_id = DESCRIBED

    def __init__(self, bucket_bytes: int, trainer_ranks: Sequence[int]) -> None:
        self.bucket_bytes = bucket_bytes
        self.trainer_ranks = tuple(trainer_ranks)
        self.specs: list[TensorSpec] = []
        self.slices: list[Slice] = []
        self.buckets: list[Bucket] = []
        self.first_bucket: list[int] = []
        self.last_bucket: list[int] = []
        self.total: int | None = None
        """How many buckets the version has, once the iterator ended."""
        self.learned = -1
        """The last bucket whose header was read (a rollout's side)."""
        self._cursor = 0
        self._names: set[str] = set()
        self._digest = 0
        self._described = 0  # specs[:_described] were named in descriptions already

    def bucket_slices(self, g: int) -> Sequence[Slice]:
        b = self.buckets[g]
        return self.slices[b.first_slice : b.first_slice + b.num_slices]

    def owned(self, rank: int) -> list[int]:
        return [b.index for b in self.buckets if b.owner == rank]

    def as_plan(self) -> BucketPlan:
        """This layout where a plan is read (it has a plan's reading interface)."""
        return cast(BucketPlan, self)

    def final(self) -> BucketPlan:
        """The whole layout's plan, under its own id (as :meth:`BucketPlan.build` gives)."""
        return BucketPlan.build(self.specs, self.bucket_bytes, self.trainer_ranks)

    def owner(self, g: int) -> int:
        return self.trainer_ranks[g % len(self.trainer_ranks)]

    # ------------------------------------------------------------------ the trainer's side
    def add(self, spec: TensorSpec) -> int:
        """Append the next tensor (as yielded, or as a header names it); return its index."""
        if spec.name in self._names:
            raise LayoutMismatch(f"{spec.name!r} was yielded twice")
        self._names.add(spec.name)
        i = len(self.specs)
        self.specs.append(spec)
        before = len(self.slices)
        self._cursor = cut_tensor(i, spec, self._cursor, self.bucket_bytes, self.slices)
        for j in range(before, len(self.slices)):
            s = self.slices[j]
            if s.bucket == len(self.buckets):
                self.buckets.append(Bucket(s.bucket, self.owner(s.bucket), j, 0, 0))
            b = self.buckets[s.bucket]
            nbytes = max(b.nbytes, s.bucket_offset + s.nbytes)
            self.buckets[s.bucket] = dataclasses.replace(
                b, num_slices=b.num_slices + 1, nbytes=nbytes
            )
        self.first_bucket.append(self.slices[before].bucket)
        self.last_bucket.append(self.slices[-1].bucket)
        return i

    def end(self) -> None:
        """The iterator ended: the count of buckets is known."""
        self.total = len(self.buckets)

    def covers(self, g: int) -> bool:
        """Whether every tensor that starts in bucket ``g`` is known, and whether a later
        bucket exists is too: the iterator ended, or a known tensor lies past bucket g."""
        return self.total is not None or self._cursor > (g + 1) * self.bucket_bytes

    def describe(self, g: int) -> bytes:
        """Bucket ``g``'s description: the tensors that start in it (every one before them
        was described with an earlier bucket). Every trainer describes every bucket, in
        order, whichever sends it: the running checksum goes through them all."""
        first = self.first_bucket
        new = [i for i in range(self._described, len(self.specs)) if first[i] == g]
        specs = [self.specs[i] for i in new]
        self._described += len(new)
        self._digest = _chain(self._digest, specs)
        body = {"t": [[s.name, list(s.shape), s.dtype] for s in specs], "n": self.total}
        body["h"] = self._digest
        description = zlib.compress(json.dumps(body).encode(), 1)
        room = DESCRIBED_HEADER_BYTES - HEADER_PREFIX - _LENGTH.size
        if len(description) > room:
            raise SyncError(
                f"bucket {g} names {len(specs)} tensors in {len(description)} bytes, more "
                f"than a bucket header holds ({room}); use a smaller bucket_bytes, or give "
                "the layout before the first publish (set_layout)"
            )
        return description

    # ------------------------------------------------------------------ the rollout's side
    def learn(self, g: int, header: torch.Tensor, owner: int) -> bool:
        """Read bucket ``g``'s header (sent by trainer rank ``owner``) unless it was read
        already; return whether it was new. Headers must come in bucket order."""
        if g <= self.learned:
            return False
        if g != self.learned + 1:
            raise AssertionError(f"bucket {g}'s header read before bucket {self.learned + 1}'s")
        raw = bytes(header[: HEADER_PREFIX + _LENGTH.size].tolist())
        (length,) = _LENGTH.unpack(raw[HEADER_PREFIX:])
        start = HEADER_PREFIX + _LENGTH.size
        try:
            body = json.loads(zlib.decompress(bytes(header[start : start + length].tolist())))
            specs = [TensorSpec(n, tuple(shape), dt) for n, shape, dt in body["t"]]
        except (ValueError, KeyError, TypeError, zlib.error) as exc:
            raise SyncError(
                f"bucket {g} from trainer rank {owner} has no layout in its header: {exc}"
            ) from exc
        digest = _chain(self._digest, specs)
        if body["h"] != digest:
            raise SyncError(
                f"bucket {g} from trainer rank {owner} describes another layout than the "
                "buckets before it (from the other trainers): the trainers' iterators "
                "yielded different names, shapes or dtypes"
            )
        self._digest = digest
        for spec in specs:
            self.add(spec)
        self.learned = g
        if body["n"] is not None:
            self.total = int(body["n"])
        return True

    def exists(self, g: int) -> bool | None:
        """Whether bucket ``g`` exists, as far as the headers read tell (``None``: the
        header of a bucket before it must be read first)."""
        if self.total is not None:
            return g < self.total
        if g <= self.learned + 1 or g < len(self.buckets):
            return True  # a header without the count promises the bucket after it
        return None


def described_header(payload_bytes: int, description: bytes) -> torch.Tensor:
    """A described bucket's header: its payload size, then its description's length and
    bytes, in :data:`DESCRIBED_HEADER_BYTES`."""
    raw = struct.pack("<q", payload_bytes) + _LENGTH.pack(len(description)) + description
    out = torch.zeros(DESCRIBED_HEADER_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _chain(digest: int, specs: Sequence[TensorSpec]) -> int:
    """The running checksum of a layout after ``specs`` are added."""
    text = json.dumps([digest, [[s.name, list(s.shape), s.dtype] for s in specs]])
    return checksum(text.encode())


class DescribedSources:
    """The tensors a described round's bucket ``g`` reads, pulled from ``items`` as it
    yields while :attr:`layout` grows (:class:`..trainer.packing.Sources`' interface).

    Entering bucket g pulls until :meth:`GrowingLayout.covers` it; a tensor this rank packs
    no byte of is dropped as soon as it is laid out, the others once the bucket holding
    their last slice was left. So the yielded tensors alive at once are those of the bucket
    being packed and the first of a later one, never the whole model."""

    def __init__(
        self,
        layout: GrowingLayout,
        items: Iterator[tuple[str, torch.Tensor]],
        rank: int,
    ) -> None:
        self.layout = layout
        self.items = items
        self.rank = rank
        self._live: dict[int, torch.Tensor] = {}
        self.peak_gathered_bytes = 0

    def enter(self, g: int) -> None:
        while not self.layout.covers(g):
            item = next(self.items, None)
            if item is None:
                self.layout.end()
            else:
                self._take(*item)

    def _take(self, name: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        spec = TensorSpec(name, tuple(t.shape), dtype_name(t.dtype))
        layout = self.layout
        i = layout.add(spec)
        if is_dtensor(t):
            t = cast(Any, t).full_tensor()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, spec.nbytes)
        first, last = layout.first_bucket[i], layout.last_bucket[i]
        if any(layout.owner(b) == self.rank for b in range(first, last + 1)):
            self._live[i] = t.detach().contiguous()

    def leave(self, g: int) -> None:
        layout = self.layout
        for s in layout.bucket_slices(g):
            if layout.last_bucket[s.tensor] == g:
                self._live.pop(s.tensor, None)

    def slice_bytes(self, s: Slice) -> torch.Tensor:
        return as_bytes(self._live[s.tensor])[s.tensor_offset : s.tensor_offset + s.nbytes]

    def finish(self) -> None:
        """The iterator ended before the last bucket was sent: nothing is left to read."""


def nonempty(
    items: Iterator[tuple[str, torch.Tensor]],
) -> tuple[bool, Iterator[tuple[str, torch.Tensor]]]:
    """Whether ``items`` yields anything, and ``items`` from its start. The first item is
    held only until it is yielded again (a gathered tensor may be the model's largest)."""
    first = next(items, None)
    if first is None:
        return False, iter(())
    held = [first]
    del first

    def chained() -> Iterator[tuple[str, torch.Tensor]]:
        yield held.pop()
        yield from items

    return True, chained()
