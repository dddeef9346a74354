"""One flat, padded, evenly sharded buffer for a unit's parameters of one dtype.

Layout (the plan is a :class:`FlatLayout`): the global flat buffer is ``world_size`` rank
segments of ``segment_numel`` elements. Segment ``r`` holds, for every parameter in order,
the dim-0 rows rank ``r`` owns under ``torch.chunk`` semantics (the rows ``DTensor``'s
``Shard(0)`` gives rank ``r``), padded to ``rows_per_rank`` rows. So:

- a rank's shard is one contiguous segment, and each parameter's local rows inside it are a
  valid ``Shard(0)`` local tensor (a view, no copy);
- an all-gather of the segments is rank-major; :meth:`FlatShardedBuffer.copy_out` fills the
  unsharded, parameter-major storage from it with one strided copy per parameter;
- a reduce-scatter input is filled by :meth:`FlatShardedBuffer.copy_in` (the inverse), and
  its output lands in this rank's segment layout, i.e. straight in the sharded gradients.

Invariant: the unsharded parameters are views of one storage that is released (resized to 0)
and re-allocated in place, so the tensor objects autograd saved for backward stay valid; the
storage is written only through ``.data`` aliases, so refilling it never bumps the version
counter autograd checks.
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


def _rank_rows(buffer: torch.Tensor, layout: FlatLayout, slot: ParamSlot) -> torch.Tensor:
    """``(world_size, rows_per_rank, row_numel)`` strided view of ``slot`` in a gathered buffer."""
    segment = buffer.view(layout.world_size, layout.segment_numel)
    rows = segment[:, slot.offset : slot.offset + slot.padded_numel]
    return rows.view(layout.world_size, slot.rows_per_rank, slot.row_numel)


def _copy_rows(rank_major: torch.Tensor, rows: torch.Tensor, slot: ParamSlot, out: bool) -> None:
    """Copy between a ``_rank_rows`` view and a ``(dim0, row_numel)`` tensor.

    ``out=True`` copies rank-major -> rows (copy-out), else rows -> rank-major (copy-in).
    Padding rows of the rank-major side are not touched.
    """
    full = slot.shape[0] // slot.rows_per_rank
    head = full * slot.rows_per_rank
    rest = slot.shape[0] - head
    dense = rows[:head].view(full, slot.rows_per_rank, slot.row_numel)
    if out:
        dense.copy_(rank_major[:full])
        if rest:
            rows[head:].copy_(rank_major[full, :rest])
    else:
        rank_major[:full].copy_(dense)
        if rest:
            rank_major[full, :rest].copy_(rows[head:])


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

        The storage is released again before returning; views stay valid for later refills.
        """
        self.compute_dtype = dtype
        self.unsharded = torch.empty(self.layout.total_numel, dtype=dtype, device=self.main.device)
        views = []
        offset = 0
        for slot in self.layout.slots:
            views.append(self.unsharded[offset : offset + slot.numel].view(slot.shape))
            offset += slot.numel
        release_storage(self.unsharded)
        return views

    @property
    def unsharded_nbytes(self) -> int:
        return self.layout.total_numel * self.unsharded.element_size()

    def is_unsharded(self) -> bool:
        return not storage_is_released(self.unsharded)

    def reallocate(self) -> None:
        reallocate_storage(self.unsharded, self.unsharded_nbytes)

    def release(self) -> None:
        release_storage(self.unsharded)

    def send_buffer(self, staging: torch.Tensor | None) -> torch.Tensor:
        """The all-gather input: the main shard, cast into ``staging`` when dtypes differ."""
        if staging is None or self.compute_dtype == self.layout.dtype:
            return self.main
        send = staging[: self.layout.segment_numel]
        send.copy_(self.main)
        return send

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill the (re-allocated) unsharded storage from a rank-major gathered buffer."""
        target = self.unsharded.data
        offset = 0
        for slot in self.layout.slots:
            rows = target[offset : offset + slot.numel].view(slot.shape[0], slot.row_numel)
            _copy_rows(_rank_rows(gathered, self.layout, slot), rows, slot, out=True)
            offset += slot.numel

    def copy_in(self, grads: list[torch.Tensor | None], reduce_input: torch.Tensor) -> None:
        """Lay unsharded gradients out rank-major in ``reduce_input`` (casting as needed).

        A ``None`` gradient (frozen or unused parameter) contributes zeros.
        """
        for slot, grad in zip(self.layout.slots, grads, strict=True):
            dst = _rank_rows(reduce_input, self.layout, slot)
            if grad is None:
                dst.zero_()
            else:
                _copy_rows(dst, grad.reshape(slot.shape[0], slot.row_numel), slot, out=False)
