"""A publish's one pipeline: plan -> sources -> stage -> send, bucket by bucket.

:func:`walk` takes every trainer rank through a plan's buckets in order, entering and leaving
each in the round's sources (:class:`.packing.Sources`: a gathered DTensor is read by every
rank alike, so its collectives match), and hands each bucket this rank owns to the round's
:class:`Stage`, the strategy of its mode:

- :class:`Pack` (``direct``): packs the bucket's changed slices from the sources into the
  sender's next buffer and sends it; slices sent on their own go straight from the tensors;
- :class:`Refresh` (``direct`` with deltas): brings the bucket of the kept copy (the host
  cache) to the new bytes, diffing it when every member holds its base, and sends it from
  there, as a delta where that is smaller;
- :class:`Snapshot` (``cached``): brings the host cache's bucket in, diffing it; nothing is
  sent, the round later sends from the cache (:func:`serve_cached`).

Each strategy keeps what the round records: the slices' checksums (the next round leaves out
what every rollout holds), the deltas and their stats.

Invariant: every rank walks the same buckets in the same order and reads a bucket's sources
only between entering and leaving it; a stage reads no byte of a bucket this rank does not
own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from ..layout.delta import BucketDelta, DeltaStats, Differ
from ..layout.described import DescribedSources, GrowingLayout, described_header
from ..layout.plan import BucketPlan, Slice
from ..layout.runs import Routes
from ..transport.network import Sender
from .host_cache import HostCache, Unchanged
from .packing import NO_BYTES, Sources, pack_slices, packs_any
from .sending import send_bucket, send_cached_bucket, send_cached_delta

Read = Callable[[Slice], torch.Tensor]


class Stage(Protocol):
    def bucket(self, plan: BucketPlan, g: int, read: Read) -> None:
        """Stage (and send) bucket ``g``, which this rank owns, reading its slices' bytes
        with ``read``."""
        ...


def walk(plan: BucketPlan, sources: Sources, rank: int, stage: Stage) -> int:
    """Walk ``plan``'s buckets through ``sources``, staging those ``rank`` owns; returns the
    most DTensor bytes the sources held gathered at once."""
    for bucket in plan.buckets:
        g = bucket.index
        sources.enter(g)
        if bucket.owner == rank:
            stage.bucket(plan, g, sources.slice_bytes)
        sources.leave(g)
    sources.finish()
    return sources.peak_gathered_bytes


def walk_described(layout: GrowingLayout, sources: DescribedSources, rank: int, stage: Pack) -> int:
    """:func:`walk` for a described round (:mod:`..layout.described`): the buckets are known
    only as ``sources`` grows ``layout``, and each leaves with its description in its header
    (described on every rank: the description's checksum runs through all of them)."""
    plan = layout.as_plan()
    g = 0
    while True:
        sources.enter(g)
        if layout.total is not None and g >= layout.total:
            break
        description = layout.describe(g)
        if layout.buckets[g].owner == rank:
            header_of = functools.partial(described_header, description=description)
            stage.bucket(plan, g, sources.slice_bytes, header_of)
        sources.leave(g)
        g += 1
    sources.finish()
    return sources.peak_gathered_bytes


class Pack:
    """``direct``: pack each bucket from the caller's tensors and send it (``sender``
    ``None``: this rank has no member to send to, and reads nothing)."""

    def __init__(self, sender: Sender | None, routes: Routes | None, unchanged: Unchanged) -> None:
        self.sender = sender
        self.routes = routes
        self.unchanged = unchanged
        self.sums: dict[int, int] = {}
        self.sent_from_tensors = False
        """Whether a slice went straight from the caller's tensors (the sends must be
        flushed before the caller may change them)."""

    def bucket(
        self,
        plan: BucketPlan,
        g: int,
        read: Read,
        header_of: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """As :meth:`Stage.bucket`; ``header_of(payload_bytes)``: the bucket's header when
        it is not the plan's (a described round's)."""
        sender = self.sender
        if sender is None:
            return
        slices = plan.bucket_slices(g)
        separate_min = sender.separate_min
        out = sender.next_buffer() if packs_any(slices, separate_min) else NO_BYTES
        first = plan.buckets[g].first_slice
        mask, nbytes, sums, separate = pack_slices(
            slices, read, out, self.unchanged, first, separate_min
        )
        self.sums.update(sums)
        self.sent_from_tensors |= bool(separate)
        header = None if header_of is None else header_of(nbytes)
        send_bucket(sender, plan, g, mask, nbytes, out, separate, header, self.routes)


class Snapshot:
    """``cached``: bring each bucket into ``cache`` (whose lock the caller holds), diffing
    it with ``differ`` when the cache holds the previous version of the plan."""

    def __init__(self, cache: HostCache, differ: Differ | None) -> None:
        self.cache = cache
        self.differ = differ
        self.deltas: dict[int, BucketDelta | None] = {}
        self.stats = DeltaStats()

    def bucket(self, plan: BucketPlan, g: int, read: Read) -> None:
        self.deltas[g], stats = self.cache.update(plan, g, read, self.differ)
        self.stats.add(stats)


class Refresh(Snapshot):
    """``direct`` with deltas: bring each bucket of the kept copy to the new bytes (diffing
    it when ``differ`` is given) and send it before reading the next, as its delta where
    that is smaller, else from the copy."""

    def __init__(
        self,
        cache: HostCache,
        differ: Differ | None,
        sender: Sender | None,
        routes: Routes | None,
        unchanged: Unchanged,
        device: torch.device,
        version: int,
    ) -> None:
        super().__init__(cache, differ)
        self.sender = sender
        self.routes = routes
        self.unchanged = unchanged
        self.device = device
        self.version = version
        self.sums: dict[int, int] = {}

    def bucket(self, plan: BucketPlan, g: int, read: Read) -> None:
        super().bucket(plan, g, read)
        if self.sender is not None:
            self.sums.update(
                send_from_cache(
                    self.cache,
                    self.sender,
                    plan,
                    g,
                    self.deltas[g],
                    self.unchanged,
                    self.device,
                    self.version,
                    self.routes,
                )
            )


def send_from_cache(
    cache: HostCache,
    sender: Sender,
    plan: BucketPlan,
    g: int,
    delta: BucketDelta | None,
    unchanged: Unchanged,
    device: torch.device,
    version: int,
    routes: Routes | None,
) -> dict[int, int]:
    """Send bucket ``g`` from ``cache``: as ``delta`` when one is given, else its bytes
    (leaving out what ``unchanged`` names); returns the checksums of the slices sent dense."""
    if delta is not None:
        send_cached_delta(cache, sender, plan, g, delta)
        return {}
    return send_cached_bucket(cache, sender, plan, g, device, unchanged, version, routes)


def serve_cached(
    cache: HostCache,
    sender: Sender,
    plan: BucketPlan,
    rank: int,
    deltas: dict[int, BucketDelta | None] | None,
    unchanged: Unchanged,
    device: torch.device,
    version: int,
    routes: Routes | None,
) -> dict[int, int]:
    """``cached``: send every bucket ``rank`` owns from ``cache`` (whose lock the caller
    holds), as the delta the snapshot found where ``deltas`` holds one; returns the
    checksums of the slices sent dense."""
    sums: dict[int, int] = {}
    for g in plan.owned(rank):
        delta = deltas.get(g) if deltas is not None else None
        sums.update(
            send_from_cache(cache, sender, plan, g, delta, unchanged, device, version, routes)
        )
    return sums
