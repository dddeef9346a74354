"""One flat, padded, evenly sharded buffer for a unit's parameters of one dtype.

Layout (the plan is a :class:`FlatLayout`): the global flat buffer is ``world_size`` rank
segments of ``segment_numel`` elements. Segment ``r`` holds, for every parameter in order,
the dim-0 rows rank ``r`` owns under ``torch.chunk`` semantics (the rows ``DTensor``'s
``Shard(0)`` gives rank ``r``), padded to ``rows_per_rank`` rows. So:

- a rank's shard is one contiguous segment, and each parameter's local rows inside it are a
  valid ``Shard(0)`` local tensor (a view, no copy);
- the unsharded storage is parameter-major with each parameter padded to
  ``world_size * rows_per_rank`` rows, so parameter ``i``'s region viewed as
  ``(world_size, padded_numel)`` is column block ``i`` of the rank-major gathered buffer
  viewed as ``(world_size, segment_numel)``: :meth:`FlatShardedBuffer.copy_out` is one
  ``split_with_sizes_copy`` into views made once;
- a reduce-scatter input is filled by :meth:`FlatShardedBuffer.copy_in` (the inverse, one
  ``_chunk_cat`` of the gradients), and its output lands in this rank's segment layout, i.e.
  straight in the sharded gradients.

Invariant: the unsharded parameters (and the copy-out targets) are views of one storage that
is released (resized to 0) and re-allocated in place, so the tensor objects autograd saved for
backward stay valid and no view is rebuilt per step; the storage is written only through
``.data`` aliases, so refilling it never bumps the version counter autograd checks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..core.buffers import reallocate_storage, release_storage, storage_is_released
from ..core.shapes import numel


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in every rank segment."""

    name: str
    shape: tuple[int, ...]
    rows_per_rank: int
    row_numel: int
    offset: int

    @property
    def padded_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    @property
    def numel(self) -> int:
        return self.shape[0] * self.row_numel

    def local_rows(self, rank: int) -> int:
        """Rows ``rank`` owns (``torch.chunk`` semantics: trailing ranks may own none)."""
        return max(0, min(self.shape[0] - rank * self.rows_per_rank, self.rows_per_rank))


@dataclass(frozen=True)
class FlatLayout:
    """The sharding plan of one unit's parameters of one dtype over ``world_size`` ranks."""

    dtype: torch.dtype
    world_size: int
    slots: tuple[ParamSlot, ...]
    segment_numel: int

    @classmethod
    def plan(
        cls, named_shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, world_size: int
    ) -> FlatLayout:
        slots = []
        offset = 0
        for name, shape in named_shapes:
            rows = -(-shape[0] // world_size)
            row_numel = numel(shape[1:])
            slots.append(ParamSlot(name, tuple(shape), rows, row_numel, offset))
            offset += rows * row_numel
        return cls(dtype, world_size, tuple(slots), offset)

    @property
    def total_numel(self) -> int:
        """Elements of the unsharded parameters (no padding)."""
        return sum(s.numel for s in self.slots)

    @property
    def gathered_numel(self) -> int:
        return self.world_size * self.segment_numel

    def fingerprint(self) -> str:
        text = repr((str(self.dtype), self.world_size, self.slots))
        return hashlib.sha1(text.encode()).hexdigest()


class FlatShardedBuffer:
    """The sharded main weights and gradients of one dtype group, and its unsharded storage.

    ``main`` and ``grad`` are this rank's segment (``segment_numel``) in the main dtype and
    persist; ``unsharded`` holds every parameter in full, in ``compute_dtype``, and is
    released between uses.
    """

    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        sources: list[torch.Tensor],
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.main = torch.zeros(layout.segment_numel, dtype=layout.dtype, device=device)
        self.grad = torch.zeros(layout.segment_numel, dtype=layout.dtype, device=device)
        with torch.no_grad():
            for slot, src in zip(layout.slots, sources, strict=True):
                self.local_view(self.main, slot).copy_(self._my_rows(src.detach(), slot))
        self.compute_dtype = layout.dtype
        self.unsharded = torch.empty(0, dtype=layout.dtype, device=device)
        self._split_sizes = [slot.padded_numel for slot in layout.slots]
        self._copy_out_targets: list[torch.Tensor] = []

    def _my_rows(self, full: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        start = self.rank * slot.rows_per_rank
        return full[start : start + slot.local_rows(self.rank)]

    def local_view(self, segment: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """This rank's rows of ``slot`` inside a segment-shaped tensor (a view)."""
        rows = slot.local_rows(self.rank)
        return segment[slot.offset : slot.offset + rows * slot.row_numel].view(
            rows, *slot.shape[1:]
        )

    def set_compute_dtype(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Allocate the unsharded storage in ``dtype``; returns one full view per parameter.

        Also makes the copy-out targets (each parameter's padded region as
        ``(world_size, padded_numel)``, through ``.data``). The storage is released again
        before returning; every view stays valid for later refills.
        """
        lay = self.layout
        world = lay.world_size
        self.compute_dtype = dtype
        self.unsharded = torch.empty(lay.gathered_numel, dtype=dtype, device=self.main.device)
        alias = self.unsharded.data
        views = []
        self._copy_out_targets = []
        for slot in lay.slots:
            start = world * slot.offset
            views.append(self.unsharded[start : start + slot.numel].view(slot.shape))
            region = alias[start : start + world * slot.padded_numel]
            self._copy_out_targets.append(region.view(world, slot.padded_numel))
        release_storage(self.unsharded)
        return views

    @property
    def unsharded_nbytes(self) -> int:
        return self.layout.gathered_numel * self.unsharded.element_size()

    def is_unsharded(self) -> bool:
        return not storage_is_released(self.unsharded)

    def reallocate(self) -> None:
        reallocate_storage(self.unsharded, self.unsharded_nbytes)

    def release(self) -> None:
        release_storage(self.unsharded)

    def send_buffer(self, staging: torch.Tensor | None) -> torch.Tensor:
        """The all-gather input: the main shard, cast into ``staging`` (a segment-sized
        buffer) when dtypes differ."""
        if staging is None or self.compute_dtype == self.layout.dtype:
            return self.main
        staging.copy_(self.main)
        return staging

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill the (re-allocated) unsharded storage from a rank-major gathered buffer: one
        ``split_with_sizes_copy`` of its ``(world_size, segment_numel)`` view."""
        torch.split_with_sizes_copy(
            gathered.view(self.layout.world_size, self.layout.segment_numel),
            self._split_sizes,
            dim=1,
            out=self._copy_out_targets,
        )

    def copy_in(self, grads: list[torch.Tensor | None], reduce_input: torch.Tensor) -> None:
        """Lay unsharded gradients out rank-major in ``reduce_input`` (casting as needed).

        Padding is zero. A ``None`` gradient (frozen or unused parameter) contributes zeros:
        the input is zeroed and each run of present gradients is laid out by one
        ``_chunk_cat`` into its column block.
        """
        lay = self.layout
        rank_major = reduce_input.view(lay.world_size, lay.segment_numel)
        present = [g for g in grads if g is not None]
        if len(present) == len(grads):
            torch._chunk_cat(present, 0, lay.world_size, out=rank_major)
            return
        rank_major.zero_()
        for first, stop in _runs(grads):
            begin = lay.slots[first].offset
            last = lay.slots[stop - 1]
            block = rank_major[:, begin : last.offset + last.padded_numel]
            torch._chunk_cat(grads[first:stop], 0, lay.world_size, out=block)  # type: ignore[arg-type]


def _runs(items: list[torch.Tensor | None]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of the consecutive non-``None`` items."""
    runs = []
    start = None
    for i, item in enumerate(items + [None]):
        if item is not None and start is None:
            start = i
        elif item is None and start is not None:
            runs.append((start, i))
            start = None
    return runs
