"""Where a target tensor takes the bytes of a sent one: :func:`destination`.

A target holds the bytes of a sent tensor it keeps as :class:`~..layout.runs.Runs` laid one
after another in its own bytes (a :class:`Dest`):

- a plain tensor: one run, every byte;
- a DTensor's local shard placed by rows (``Shard(0)`` / ``Replicate()``: a
  tensor-parallel rollout's column-parallel weight): one run, its rows' bytes;
- a DTensor's local shard placed by a later dimension (``Shard(1)``: a row-parallel
  weight; ``Shard(k)`` of a head or expert dimension; with rows too on a 2-D mesh): a run
  per step of the dimensions before it, its band of that dimension
  (:meth:`..layout.runs.Runs.of_box`, the geometry the trainers' shards are cut by too).

Invariant: a destination writes only the bytes of a slice that fall in its runs, each at its
place in its own bytes, and never through a pointer other than its own tensor's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...core.buffers import as_bytes
from ...core.copy import copy_in_slices, copy_to_address
from ..layout.holders import box_placements, local_runs
from ..layout.plan import Slice, TensorSpec, is_dtensor
from ..layout.runs import Runs, rows_of


@dataclass(frozen=True)
class Dest:
    """The bytes ``runs`` keep of a sent tensor, held one after another in ``data``."""

    data: torch.Tensor
    runs: Runs

    @property
    def whole(self) -> bool:
        return self.runs.whole

    def local_range(self, s: Slice) -> tuple[int, int]:
        return self.runs.local_range(s)

    def kept(self, s: Slice) -> int:
        return self.runs.kept(s)

    def view(self, s: Slice) -> torch.Tensor | None:
        """The bytes slice ``s`` lands in, when it keeps every one of them."""
        lo, hi = self.runs.local_range(s)
        return self.data[lo:hi] if hi - lo == s.nbytes else None

    def on(self, data: torch.Tensor) -> Dest:
        """The same runs, held in ``data`` (a buffer of their size) instead."""
        return replace(self, data=data)

    def copy(self, s: Slice, data: torch.Tensor) -> None:
        """Write the bytes of slice ``s`` (``data``) it keeps: a run cut by the slice's ends
        at a time, the runs it covers whole as one strided copy."""
        for p in self.runs.pieces(s):
            if p.rows == 1:
                _copy(self.data, p.local, data[p.at : p.at + p.nbytes])
            else:
                local = self.data[p.local : p.local + p.rows * p.nbytes].view(p.rows, p.nbytes)
                local.copy_(rows_of(p, data))


def _copy(dest: torch.Tensor, at: int, src: torch.Tensor) -> None:
    if dest.device.type == "cpu" and copy_to_address(dest.data_ptr() + at, src):
        return
    copy_in_slices(dest[at : at + src.numel()], src)


def placed(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor whose local shard a destination here can hold: a box
    (:func:`..layout.holders.box_placements`: a band of rows by a band of one other
    dimension)."""
    if not is_dtensor(t):
        return False
    d: Any = t
    return box_placements(d.placements, t.dim(), tuple(d.device_mesh.mesh.shape))


def destination(t: torch.Tensor, local: torch.Tensor, spec: TensorSpec) -> Dest:
    """Where target ``t`` (its bytes, or its local shard's, ``local``: contiguous) takes the
    bytes of the sent tensor ``spec``."""
    data = as_bytes(local.detach())
    if not is_dtensor(t):
        return Dest(data, Runs.one(0, data.numel(), spec.nbytes))
    return Dest(data, local_runs(t, spec))
