"""The trainer's host cache (``cached`` mode), and the base of delta publishes.

:class:`HostCache` holds this rank's buckets of the last version snapshotted, laid out as the
plan lays out a bucket with every slice included, in a :class:`Generation` (one reused host
buffer). The current generation is rewritten only under the cache's lock and sent from by
:mod:`.sending`. A refetch (:mod:`.refetch`) takes the lock only to take a *hold* on the
current generation, then serves from it without the lock until the rollout acknowledged, so
a publish's snapshot never waits for a rollout: one that finds the current generation held
writes the new version into another buffer (a delta publish diffs against the held bytes,
which it only reads) and makes that current once every bucket is in. A generation no
longer current is freed with its last hold, so the cache holds a second buffer only while
a refetch of the older version is in flight.

Invariants: the cache's ``version`` is set only while every byte of that version is in it;
a held generation's buffer is neither written nor freed until its last hold is let go.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...core.buffers import StagingPool
from ...core.copy import copy_in_slices
from ...errors import PeerTimeoutError
from ..layout.delta import WORD, BucketDelta, DeltaStats, Differ, words_of
from ..layout.plan import BucketPlan, Slice

Unchanged = Callable[[int, int | None], bool]


@dataclass(eq=False)
class Generation:
    """One version of this rank's buckets in one buffer: bucket ``g`` at ``offsets[g]``
    (the buckets this rank owns, in order), padded to whole words. ``version`` is ``None``
    while the buffer is being written; ``holds`` counts the refetches serving from it
    (changed only under the cache's hold lock)."""

    key: int
    """The buffer's key in the cache's pool."""
    plan: BucketPlan
    buffer: torch.Tensor
    offsets: dict[int, int]
    version: int | None = None
    holds: int = 0

    def bucket(self, g: int) -> torch.Tensor:
        """Bucket ``g``'s bytes, padded to whole words."""
        start = self.offsets[g]
        return self.buffer[start : start + words_of(self.plan.buckets[g].nbytes) * WORD]


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
        """Held while a version is written into the current generation or sent from it; a
        refetch takes it only to take a hold (:meth:`hold`)."""
        self.tokens: dict[int, int] = {}
        """Each owned bucket's token, as the rollouts that hold :attr:`version` record it."""
        self.base_version: int | None = None
        """The version the cache held when the update in progress started (the base its
        deltas are computed from), or ``None`` when it held no version of this plan."""
        self._current: Generation | None = None
        self._base: Generation | None = None
        """While an update writes a new generation because a refetch holds the current
        one: that held generation, whose bytes the update diffs against (only reading)."""
        self._retired: list[Generation] = []
        """Generations no longer current that a refetch still holds."""
        self._holds = threading.Lock()
        """Guards every generation's ``holds`` and :attr:`_retired` (a hold is let go
        without :attr:`lock`, so a refetch never waits for a snapshot either)."""
        self._keys = itertools.count()
        self._pool = StagingPool(pin=torch.cuda.is_available())

    @property
    def nbytes(self) -> int:
        return self._pool.live_bytes

    @property
    def version(self) -> int | None:
        """The version every byte of the current generation holds (``None``: none)."""
        return None if self._current is None else self._current.version

    @version.setter
    def version(self, version: int | None) -> None:
        if self._current is not None:
            self._current.version = version

    def acquire(self) -> None:
        """Take :attr:`lock` within the timeout (a refetch holds it only to take a hold)."""
        if not self.lock.acquire(timeout=self.timeout):
            raise PeerTimeoutError(
                f"trainer rank {self.rank}: the host cache stayed locked for more than "
                f"{self.timeout:.1f} s"
            )

    def hold(self) -> Generation | None:
        """Hold the current generation for a refetch (the caller holds :attr:`lock`): its
        buffer stays alive and unchanged until :meth:`release`. ``None`` while the cache
        holds no complete version."""
        gen = self._current
        if gen is None or gen.version is None:
            return None
        with self._holds:
            gen.holds += 1
        return gen

    def release(self, gen: Generation) -> None:
        """End a refetch's hold on ``gen``; one no longer current goes with its last hold."""
        with self._holds:
            gen.holds -= 1
            if gen.holds == 0 and gen in self._retired:
                self._retired.remove(gen)
                self._pool.drop(gen.key)

    def begin(self, plan: BucketPlan) -> None:
        """Start bringing the cache to a new version of ``plan`` (the caller holds the
        lock): it holds no complete version until :meth:`finish`. A generation a refetch
        holds is left as it is: the new version goes into a buffer of its own."""
        cur = self._current
        same = cur is not None and cur.plan.plan_id == plan.plan_id
        self.base_version = cur.version if cur is not None and same else None
        if not same:
            self.tokens = {}
        self._base = None
        if cur is None:
            cur = self._allocate(next(self._keys), plan)
        else:
            with self._holds:
                held = cur.holds > 0
                if held:
                    self._retired.append(cur)
            if held:
                self._base = cur if self.base_version is not None else None
                cur = self._allocate(next(self._keys), plan)
            elif not same:
                cur = self._allocate(cur.key, plan)
        cur.plan, cur.version = plan, None  # torn until every bucket is in
        self._current = cur

    def _allocate(self, key: int, plan: BucketPlan) -> Generation:
        """A generation laid out by ``plan`` in the pool's buffer ``key``."""
        offsets: dict[int, int] = {}
        total = 0
        for g in plan.owned(self.rank):
            offsets[g] = total
            total += words_of(plan.buckets[g].nbytes) * WORD
        buffer = self._pool.acquire(key, max(total, 1))
        self._pool.release(key)
        return Generation(key, plan, buffer, offsets)

    def bucket(self, g: int) -> torch.Tensor:
        """Bucket ``g``'s bytes in the current generation, padded to whole words."""
        assert self._current is not None
        return self._current.bucket(g)

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
        view = self.bucket(g)
        if differ is not None and self.base_version is not None:
            if self._base is not None:  # the base is held by a refetch: diff against a copy
                view.copy_(self._base.bucket(g))
            return differ.diff_bucket(slices, read, view)
        for s in slices:
            copy_in_slices(view[s.bucket_offset : s.bucket_offset + s.nbytes], read(s))
        return None, DeltaStats()

    def finish(self, plan: BucketPlan, version: int) -> None:
        """Every owned bucket holds ``version`` now."""
        assert self._current is not None
        self._current.version, self._current.plan = version, plan
        self._base = None

    def clear(self) -> None:
        """Free every buffer (no refetch holds one: the worker that serves them ended)."""
        self._pool.clear()
        self._current = self._base = None
        self._retired.clear()
