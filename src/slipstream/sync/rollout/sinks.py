"""Where a receive puts each bucket's bytes: one :class:`Sink` per round.

- :class:`TargetSink`: into the target as each bucket lands (a module in place; a
  ``load_weights`` callable gets whole tensors after each bucket);
- :class:`StreamSink`: into a host buffer holding the plan's tensors whole, applied to the
  target only once every byte is in (``atomic=True``); :class:`BucketsSink` does the same
  for a described round (:mod:`..layout.described`), whose size is known only at its end, in a
  buffer per bucket;
- :class:`DrainSink`: nowhere (a round this rank refused, received to its end so every
  other member stays in step).

The receive pipeline (:mod:`..subscriber`) asks a sink where a slice sent on its own may land
(:meth:`Sink.land`), hands it every slice of every bucket (:meth:`Sink.take`), tells it when
a bucket is done and, at the end, when the round is (:meth:`Sink.finish`).

Invariant: a sink writes the target only from bytes of the round it belongs to, and a
buffered sink writes nothing to it before :meth:`Sink.finish`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...core.buffers import StagingPool
from ...core.copy import copy_in_slices
from ..layout.plan import BucketPlan, Slice, align
from .apply import CallableTarget, ModuleTarget
from .destinations import Dest


class Sink(Protocol):
    buffered: bool
    """Whether the target is written only at :meth:`finish` (every byte in first)."""

    def kept(self, g: int, s: Slice) -> int:
        """How many bytes of slice ``s`` of bucket ``g`` it takes (reads, where a payload is
        read where it lies)."""
        ...

    def land(self, g: int, s: Slice) -> torch.Tensor | None:
        """Where slice ``s`` of bucket ``g`` may be received straight away (``None``: into
        the bucket's payload)."""
        ...

    def take(self, g: int, s: Slice, data: torch.Tensor | None, landed: bool) -> None:
        """Slice ``s`` of bucket ``g`` arrived: ``data`` its bytes in the payload (``None``:
        left out as unchanged), or ``landed`` where :meth:`land` put it."""
        ...

    def land_kept(self, g: int, s: Slice) -> torch.Tensor | None:
        """Where the bytes this rank keeps of slice ``s`` (of a tensor it keeps in part) may
        be received straight away, in a routed round (``None``: into the payload)."""
        ...

    def take_kept(self, g: int, s: Slice, data: torch.Tensor, landed: bool) -> None:
        """The bytes this rank keeps of slice ``s`` arrived (a routed round): ``data``, in
        their order, or ``landed`` where :meth:`land_kept` put them."""
        ...

    def bucket_done(self, g: int) -> None:
        """Every slice of bucket ``g`` was taken."""
        ...

    def finish(self) -> None:
        """Every bucket of the round was taken."""
        ...


class TargetSink:
    """Applies each slice to ``target`` as its bucket lands."""

    buffered = False

    def __init__(self, plan: BucketPlan, target: ModuleTarget | CallableTarget) -> None:
        self.plan = plan
        self.target = target
        self.dirty: set[int] = set()
        self._whole: dict[int, torch.Tensor] = {}
        self._runs = {i: d.runs for i, d in target.stages(plan).items()}

    def kept(self, g: int, s: Slice) -> int:
        return self.target.kept(s)

    def land(self, g: int, s: Slice) -> torch.Tensor | None:
        return self.target.direct_view(s)

    def take(self, g: int, s: Slice, data: torch.Tensor | None, landed: bool) -> None:
        plan, target = self.plan, self.target
        spec = plan.specs[s.tensor]
        if data is not None:
            self.dirty.add(s.tensor)
            if landed:
                target.landed(s)
            else:
                target.write(s, data)
            if isinstance(target, CallableTarget):
                if s.nbytes == spec.nbytes == target.kept(s):
                    self._whole[s.tensor] = data
                else:
                    target.assemble(s, spec, data)
        self._done_if_last(g, s)

    def _done_if_last(self, g: int, s: Slice) -> None:
        """Tell the target a tensor with new bytes is whole, at its last bucket."""
        if s.tensor in self.dirty and self.plan.last_bucket[s.tensor] == g:
            spec = self.plan.specs[s.tensor]
            self.target.tensor_done(s.tensor, spec, self._whole.get(s.tensor))

    def land_kept(self, g: int, s: Slice) -> torch.Tensor | None:
        return self.target.kept_view(s)

    def take_kept(self, g: int, s: Slice, data: torch.Tensor, landed: bool) -> None:
        self.dirty.add(s.tensor)
        self.target.write_kept(s, self._runs[s.tensor], data, landed)
        self._done_if_last(g, s)

    def bucket_done(self, g: int) -> None:
        self.target.flush()
        self._whole = {}

    def finish(self) -> None:
        return None


class StreamSink:
    """Gathers the round in a host buffer holding, one after another, the bytes the target
    keeps of each tensor it takes (:meth:`.ModuleTarget.stages`: a DTensor target's shard,
    else the tensor whole); applies it to ``target`` at :meth:`finish`."""

    buffered = True

    def __init__(
        self, plan: BucketPlan, target: ModuleTarget | CallableTarget, pool: StagingPool
    ) -> None:
        self.plan = plan
        self.target = target
        runs = target.stages(plan)
        starts, total = {}, 0
        for i, r in sorted(runs.items()):  # each on an ALIGN boundary: a view as its dtype
            starts[i] = align(total)
            total = starts[i] + r.runs.nbytes
        stream = pool.acquire("sync-atomic", max(total, 1))
        pool.release("sync-atomic")
        self.stages: dict[int, Dest] = {
            i: r.on(stream[starts[i] : starts[i] + r.runs.nbytes]) for i, r in runs.items()
        }
        self.dirty: set[int] = set()
        self.slices: list[tuple[int, Slice]] = []

    def kept(self, g: int, s: Slice) -> int:
        stage = self.stages.get(s.tensor)
        return 0 if stage is None else stage.kept(s)

    def land(self, g: int, s: Slice) -> torch.Tensor | None:
        stage = self.stages.get(s.tensor)
        return None if stage is None else stage.view(s)

    def take(self, g: int, s: Slice, data: torch.Tensor | None, landed: bool) -> None:
        stage = self.stages.get(s.tensor)
        if data is None or stage is None:
            return
        self.dirty.add(s.tensor)
        if not landed:
            stage.copy(s, data)
        self.slices.append((g, s))

    def land_kept(self, g: int, s: Slice) -> torch.Tensor | None:
        stage = self.stages[s.tensor]
        lo, hi = stage.local_range(s)
        return stage.data[lo:hi]

    def take_kept(self, g: int, s: Slice, data: torch.Tensor, landed: bool) -> None:
        stage = self.stages[s.tensor]
        self.dirty.add(s.tensor)
        if not landed:
            lo, hi = stage.local_range(s)
            copy_in_slices(stage.data[lo:hi], data)
        self.slices.append((g, s))

    def bucket_done(self, g: int) -> None:
        return None

    def finish(self) -> None:
        """Apply what the round gathered: every slice, then every tensor with new bytes."""
        plan, target = self.plan, self.target
        for _, s in self.slices:
            target.replay(s, self.stages[s.tensor])
        for i in sorted(self.dirty):
            target.tensor_done(i, plan.specs[i], self.stages[i].data)
        target.flush()


class BucketsSink:
    """Gathers a described round (its size known only at its end) in a host buffer per
    bucket; applies it to ``target`` at :meth:`finish`."""

    buffered = True

    def __init__(self, plan: BucketPlan, target: ModuleTarget | CallableTarget) -> None:
        self.plan = plan
        self.target = target
        self.buckets: dict[int, torch.Tensor] = {}
        self.slices: list[tuple[int, Slice]] = []

    def _bytes(self, g: int, s: Slice) -> torch.Tensor:
        buf = self.buckets.get(g)
        if buf is None:
            buf = self.buckets[g] = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8)
        return buf[s.bucket_offset : s.bucket_offset + s.nbytes]

    def kept(self, g: int, s: Slice) -> int:
        return s.nbytes

    def land(self, g: int, s: Slice) -> torch.Tensor | None:
        return self._bytes(g, s)

    def take(self, g: int, s: Slice, data: torch.Tensor | None, landed: bool) -> None:
        if data is None:
            return
        if not landed:
            copy_in_slices(self._bytes(g, s), data)
        self.slices.append((g, s))

    def land_kept(self, g: int, s: Slice) -> torch.Tensor | None:
        return None

    def take_kept(self, g: int, s: Slice, data: torch.Tensor, landed: bool) -> None:
        """Never called: a described round is never routed (its layout is unknown when the
        rollouts ask)."""
        raise AssertionError("a described round is never routed")

    def bucket_done(self, g: int) -> None:
        return None

    def finish(self) -> None:
        """Apply what the round gathered: every slice, then every tensor with new bytes
        (a callable target gets each whole, put together from its slices)."""
        plan, target = self.plan, self.target
        pieces: dict[int, list[tuple[Slice, torch.Tensor]]] = {}
        for g, s in self.slices:
            data = self._bytes(g, s)
            target.write(s, data)
            pieces.setdefault(s.tensor, []).append((s, data))
        for i in sorted(pieces):
            spec = plan.specs[i]
            whole = None
            if isinstance(target, CallableTarget):
                for s, data in pieces[i]:
                    target.assemble(s, spec, data)
                whole = target.assembly(i, spec)
            target.tensor_done(i, spec, whole)
        target.flush()
        self.buckets = {}


class DrainSink:
    """Receives and discards."""

    buffered = False

    def kept(self, g: int, s: Slice) -> int:
        return 0

    def land(self, g: int, s: Slice) -> torch.Tensor | None:
        return None

    def take(self, g: int, s: Slice, data: torch.Tensor | None, landed: bool) -> None:
        return None

    def land_kept(self, g: int, s: Slice) -> torch.Tensor | None:
        return None

    def take_kept(self, g: int, s: Slice, data: torch.Tensor, landed: bool) -> None:
        return None

    def bucket_done(self, g: int) -> None:
        return None

    def finish(self) -> None:
        return None
