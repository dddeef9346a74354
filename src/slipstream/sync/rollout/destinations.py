"""Where a target tensor takes the bytes of a sent one: :func:`destination`.

A sent tensor travels as slices of its bytes in row-major order. A target holds them as a
:class:`Dest`: ``count`` runs of ``length`` bytes, ``stride`` bytes apart, from byte
``start`` of the tensor, laid one after another in its own bytes:

- a plain tensor: one run, every byte;
- a DTensor's local shard placed by rows (``Shard(0)`` / ``Replicate()``: a
  tensor-parallel rollout's column-parallel weight): one run, its rows' bytes;
- a 2-D DTensor's local shard placed by columns (``Shard(1)``: a row-parallel weight): a run
  per row, its band of columns.

The bytes of a slice a destination holds are one range of its own bytes
(:meth:`Dest.local_range`), since a slice is a range of the tensor's and the runs are laid
in the tensor's order; that is all a receive needs to count, stage or replay them.

Invariant: a destination writes only the bytes of a slice that fall in its runs, each at its
place in its own bytes, and never through a pointer other than its own tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from ...core.buffers import as_bytes
from ...core.copy import copy_in_slices, copy_to_address
from ..layout.holders import local_offset, local_start, row_placement, shard_placement
from ..layout.plan import Slice, TensorSpec, is_dtensor


@dataclass(frozen=True)
class Dest:
    """``count`` runs of ``length`` bytes each, ``stride`` apart from byte ``start`` of a
    sent tensor of ``total`` bytes, held one after another in ``data``."""

    data: torch.Tensor
    start: int
    length: int
    stride: int
    count: int
    total: int

    @classmethod
    def run(cls, data: torch.Tensor, start: int, length: int, total: int) -> Dest:
        """One run: bytes ``[start, start + length)`` of a tensor of ``total`` bytes."""
        return cls(data, start, length, max(length, 1), 1, total)

    @property
    def whole(self) -> bool:
        """Whether it holds every byte of the tensor, in the tensor's order."""
        return (
            self.start == 0
            and self.length * self.count == self.total
            and (self.count <= 1 or self.stride == self.length)
        )

    def _kept_before(self, x: int) -> int:
        """How many of its bytes lie before byte ``x`` of the tensor."""
        if not self.length or x <= self.start:
            return 0
        run, into = divmod(x - self.start, self.stride)
        if run >= self.count:
            return self.count * self.length
        return run * self.length + min(into, self.length)

    def local_range(self, s: Slice) -> tuple[int, int]:
        """The range of its own bytes that holds the bytes of slice ``s`` it keeps."""
        return self._kept_before(s.tensor_offset), self._kept_before(s.tensor_offset + s.nbytes)

    def kept(self, s: Slice) -> int:
        """How many bytes of slice ``s`` it keeps."""
        lo, hi = self.local_range(s)
        return hi - lo

    def view(self, s: Slice) -> torch.Tensor | None:
        """The bytes slice ``s`` lands in, when it keeps all of them in one run."""
        lo, hi = self.local_range(s)
        if hi - lo != s.nbytes or (s.nbytes and self._run_of(s) is None):
            return None
        return self.data[lo:hi]

    def _run_of(self, s: Slice) -> int | None:
        """The one run holding every byte of slice ``s``, if one does."""
        run = (s.tensor_offset - self.start) // self.stride if self.stride else 0
        lo = self.start + run * self.stride
        inside = lo <= s.tensor_offset and s.tensor_offset + s.nbytes <= lo + self.length
        return run if inside and 0 <= run < self.count else None

    def on(self, data: torch.Tensor) -> Dest:
        """The same runs, held in ``data`` (a buffer of its size) instead."""
        return replace(self, data=data)

    def copy(self, s: Slice, data: torch.Tensor) -> None:
        """Write the bytes of slice ``s`` (``data``) it keeps: runs cut by the slice's ends
        one by one, the runs between as one strided copy."""
        if not self.kept(s):
            return
        if self.count == 1:
            lo = max(s.tensor_offset, self.start)
            hi = min(s.tensor_offset + s.nbytes, self.start + self.length)
            _copy(self.data, lo - self.start, data[lo - s.tensor_offset : hi - s.tensor_offset])
            return
        first, last, inner = self._runs_in(s)
        for run in sorted({first, last} - set(inner)):
            self._copy_run_part(run, s, data)
        if inner:
            begin = self.start + inner.start * self.stride - s.tensor_offset
            rows = data[begin : begin + len(inner) * self.stride].view(len(inner), self.stride)
            local = self.data[: self.count * self.length].view(self.count, self.length)
            local[inner.start : inner.stop].copy_(rows[:, : self.length])

    def _runs_in(self, s: Slice) -> tuple[int, int, range]:
        """The first and last run slice ``s`` touches, and the runs whose whole stride it
        covers (a strided copy of those reads only inside the slice)."""
        lo, hi = s.tensor_offset - self.start, s.tensor_offset + s.nbytes - self.start
        first = max(0, lo // self.stride)
        last = min(self.count - 1, (hi - 1) // self.stride)
        inner_from = first if lo <= first * self.stride else first + 1
        inner_to = min(last + 1, hi // self.stride)
        return first, last, range(inner_from, max(inner_from, inner_to))

    def _copy_run_part(self, run: int, s: Slice, data: torch.Tensor) -> None:
        at = self.start + run * self.stride
        lo, hi = max(s.tensor_offset, at), min(s.tensor_offset + s.nbytes, at + self.length)
        if hi > lo:
            local = run * self.length + lo - at
            _copy(self.data, local, data[lo - s.tensor_offset : hi - s.tensor_offset])


def _copy(dest: torch.Tensor, at: int, src: torch.Tensor) -> None:
    if dest.device.type == "cpu" and copy_to_address(dest.data_ptr() + at, src):
        return
    copy_in_slices(dest[at : at + src.numel()], src)


def placed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor whose local shard a destination here can hold: a run of
    whole rows (``Shard(0)`` / ``Replicate()``), or of a 2-D tensor a band of columns
    (``Shard(1)`` / ``Replicate()``)."""
    if not is_dtensor(t):
        return False
    placements = cast(Any, t).placements
    return all(row_placement(p) for p in placements) or (
        t.dim() == 2 and all(shard_placement(p, 1) for p in placements)
    )


def destination(t: torch.Tensor, local: torch.Tensor, spec: TensorSpec) -> Dest:
    """Where target ``t`` (its bytes, or its local shard's, ``local``: contiguous) takes the
    bytes of the sent tensor ``spec``."""
    data = as_bytes(local.detach())
    if not is_dtensor(t) or all(row_placement(p) for p in cast(Any, t).placements):
        start = local_start(t, spec) if is_dtensor(t) else 0
        return Dest.run(data, start, data.numel(), spec.nbytes)
    itemsize = spec.torch_dtype.itemsize
    row = spec.shape[1] * itemsize
    band = local.shape[1] * itemsize
    rows = spec.shape[0] if band else 0
    return Dest(data, local_offset(t, spec)[1] * itemsize, band, row, rows, spec.nbytes)
