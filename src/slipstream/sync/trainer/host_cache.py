"""The trainer's host cache (``cached`` mode), and the base of delta publishes.

:class:`HostCache` holds this rank's buckets of the last version snapshotted, laid out as the
plan lays out a bucket with every slice included, in one reused host buffer; it is
rewritten only under its lock, sent from by :mod:`.sending` and served again by
:mod:`.refetch`.

Invariant: the cache's ``version`` is set only while every byte of that version is in it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ...core import tracing
from ...core.buffers import StagingPool
from ...core.copy import copy_in_slices
from ...errors import PeerTimeoutError
from ..layout.delta import WORD, BucketDelta, DeltaStats, Differ, words_of
from ..layout.plan import BucketPlan, Slice
from .packing import Sources

Unchanged = Callable[[int, int | None], bool]


class HostCache:
    """This rank's buckets of one version in a reused host buffer (see the module doc).

    It is also the *base* of delta publishes: the bytes the rollouts hold, bucket by
    bucket (each bucket padded to whole 8-byte words), with each bucket's token
    (:mod:`..layout.delta`). :meth:`update` brings a bucket to the new version, diffing it against
    what the cache held when that was the previous version of the same plan.
    """

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self.lock = threading.Lock()
        self.version: int | None = None
        self.plan: BucketPlan | None = None
        self.buffer: torch.Tensor | None = None
        self.offsets: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        """Each owned bucket's token, as the rollouts that hold :attr:`version` record it."""
        self.base_version: int | None = None
        """The version the cache held when the update in progress started (the base its
        deltas are computed from), or ``None`` when it held no version of this plan."""
        self._pool = StagingPool(pin=torch.cuda.is_available())

    @property
    def nbytes(self) -> int:
        return self._pool.live_bytes

    def acquire(self) -> None:
        """Take :attr:`lock` (a refetch being served holds it), within the timeout."""
        if not self.lock.acquire(timeout=self.timeout):
            raise PeerTimeoutError(
                f"trainer rank {self.rank}: a rollout that asked again held the cache for "
                f"more than {self.timeout:.1f} s"
            )

    @tracing.spanned("slipstream.sync.publish.snapshot")
    def snapshot(
        self,
        plan: BucketPlan,
        sources: Sources,
        version: int,
        differ: Differ | None = None,
    ) -> tuple[int, dict[int, BucketDelta | None], DeltaStats]:
        """Bring this rank's buckets of ``sources`` in (bucket by bucket), diffing
        them against the previous version when ``differ`` is given and the cache holds one
        of this plan. Returns the most DTensor bytes materialised at once, each owned
        bucket's delta (``None``: not diffed, or dense was smaller) and the diff stats."""
        self.acquire()
        try:
            self.begin(plan)
            deltas: dict[int, BucketDelta | None] = {}
            stats = DeltaStats()
            for bucket in plan.buckets:
                g = bucket.index
                sources.enter(g)
                if bucket.owner == self.rank:
                    deltas[g], bucket_stats = self.update(plan, g, sources.slice_bytes, differ)
                    stats.add(bucket_stats)
                sources.leave(g)
            sources.finish()
            self.finish(plan, version)
            return sources.peak_gathered_bytes, deltas, stats
        finally:
            self.lock.release()

    def begin(self, plan: BucketPlan) -> None:
        """Start bringing the cache to a new version of ``plan`` (the caller holds the
        lock): it holds no complete version until :meth:`finish`."""
        same = self.plan is not None and self.plan.plan_id == plan.plan_id
        self.base_version = self.version if same else None
        if not same:
            self.tokens = {}
            offsets: dict[int, int] = {}
            total = 0
            for g in plan.owned(self.rank):
                offsets[g] = total
                total += words_of(plan.buckets[g].nbytes) * WORD
            self.buffer = self._pool.acquire("sync-cache", max(total, 1))
            self._pool.release("sync-cache")
            self.offsets = offsets
        self.plan = plan
        self.version = None  # torn until every bucket is in

    def bucket(self, plan: BucketPlan, g: int) -> torch.Tensor:
        """Bucket ``g``'s bytes in the cache, padded to whole words."""
        assert self.buffer is not None
        start = self.offsets[g]
        return self.buffer[start : start + words_of(plan.buckets[g].nbytes) * WORD]

    def update(
        self,
        plan: BucketPlan,
        g: int,
        read: Callable[[Slice], torch.Tensor],
        differ: Differ | None,
    ) -> tuple[BucketDelta | None, DeltaStats]:
        """Bring bucket ``g`` to the new bytes ``read`` gives, diffing when ``differ`` is
        given and the cache held the previous version (else copying)."""
        slices = plan.bucket_slices(g)
        view = self.bucket(plan, g)
        if differ is not None and self.base_version is not None:
            return differ.diff_bucket(slices, read, view)
        for s in slices:
            copy_in_slices(view[s.bucket_offset : s.bucket_offset + s.nbytes], read(s))
        return None, DeltaStats()

    def finish(self, plan: BucketPlan, version: int) -> None:
        """Every owned bucket holds ``version`` now."""
        self.version, self.plan = version, plan

    def clear(self) -> None:
        self._pool.clear()
        self.buffer = None
