"""The bytes of a sent tensor that one rollout rank keeps: :class:`Runs`.

A tensor travels as slices of its bytes in row-major order. A rank keeps ``count`` runs of
``length`` bytes, ``stride`` bytes apart, from byte ``start``, and lays them one after
another in its own bytes: a plain tensor keeps one run of every byte, a shard of rows one
run of its rows' bytes, a 2-D shard of columns a run per row (its band). The same geometry
tells a rollout where the bytes of a slice it keeps go (:meth:`Runs.local_range`,
:meth:`Runs.pieces`) and a trainer which bytes of a slice to send it (:func:`gather`).

Invariant: the bytes of a slice a rank keeps are one range of its own bytes, since a slice is
a range of the tensor's and the runs are laid in the tensor's order; :func:`gather` gives
them in that order, so what a trainer sends is what the rollout lands there, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from .plan import Slice


@dataclass(frozen=True)
class Narrow:
    """The part of a tensor ``tensor.narrow(dim, start, length)`` is: what a reader that
    keeps one range of one dimension (a tensor-parallel worker's loader) reads."""

    dim: int
    start: int
    length: int

    def check(self, name: str, shape: tuple[int, ...]) -> str | None:
        """What is wrong with it for tensor ``name`` of ``shape`` (``None``: nothing)."""
        if not 0 <= self.dim < len(shape):
            return f"{name}: dim {self.dim} of a {len(shape)}-d tensor {list(shape)}"
        if self.start < 0 or self.length < 0 or self.start + self.length > shape[self.dim]:
            return (
                f"{name}: [{self.start}, {self.start + self.length}) of dim {self.dim}, "
                f"which has {shape[self.dim]}"
            )
        return None


@dataclass(frozen=True)
class Piece:
    """``rows`` runs of ``nbytes`` bytes each, from byte ``at`` of a slice's bytes (``stride``
    apart there), back to back from byte ``local`` of the keeper's own."""

    at: int
    local: int
    nbytes: int
    rows: int
    stride: int


@dataclass(frozen=True)
class Runs:
    """``count`` runs of ``length`` bytes, ``stride`` apart from byte ``start`` of a tensor of
    ``total`` bytes."""

    start: int
    length: int
    stride: int
    count: int
    total: int

    @classmethod
    def one(cls, start: int, length: int, total: int) -> Runs:
        """Bytes ``[start, start + length)`` of a tensor of ``total`` bytes."""
        return cls(start, length, max(length, 1), 1, total)

    @property
    def nbytes(self) -> int:
        return self.length * self.count

    @property
    def whole(self) -> bool:
        """Whether they are every byte of the tensor, in the tensor's order."""
        in_order = self.count <= 1 or self.stride == self.length
        return self.start == 0 and self.nbytes == self.total and in_order

    def _kept_before(self, x: int) -> int:
        """How many of the kept bytes lie before byte ``x`` of the tensor."""
        if not self.length or x <= self.start:
            return 0
        run, into = divmod(x - self.start, self.stride)
        if run >= self.count:
            return self.nbytes
        return run * self.length + min(into, self.length)

    def local_range(self, s: Slice) -> tuple[int, int]:
        """The range of the keeper's bytes that holds the bytes of slice ``s`` it keeps."""
        return self._kept_before(s.tensor_offset), self._kept_before(s.tensor_offset + s.nbytes)

    def kept(self, s: Slice) -> int:
        """How many bytes of slice ``s`` are kept."""
        lo, hi = self.local_range(s)
        return hi - lo

    def pieces(self, s: Slice) -> list[Piece]:
        """The kept bytes of slice ``s``: a run cut by the slice's start, the runs it covers
        whole (one strided piece), a run cut by its end; in the tensor's order."""
        a, b = s.tensor_offset, s.tensor_offset + s.nbytes
        if not self.kept(s):
            return []
        first = max(0, (a - self.start) // self.stride)
        last = min(self.count - 1, (b - 1 - self.start) // self.stride)
        spans = {k: self._span(k, a, b) for k in {first, last}}
        whole = {k for k, (lo, hi) in spans.items() if hi - lo == self.length}
        out = []
        if first not in whole:
            out.append(self._piece(first, *spans[first], a))
        inner_from = first if first in whole else first + 1
        inner_to = last + 1 if last in whole else last
        if inner_to > inner_from:
            at = self.start + inner_from * self.stride
            rows = inner_to - inner_from
            out.append(Piece(at - a, inner_from * self.length, self.length, rows, self.stride))
        if last != first and last not in whole:
            out.append(self._piece(last, *spans[last], a))
        return [p for p in out if p.nbytes]

    def _span(self, k: int, a: int, b: int) -> tuple[int, int]:
        """The bytes of run ``k`` inside ``[a, b)`` (tensor offsets)."""
        at = self.start + k * self.stride
        return max(a, at), max(max(a, at), min(b, at + self.length))

    def _piece(self, k: int, lo: int, hi: int, a: int) -> Piece:
        local = k * self.length + lo - (self.start + k * self.stride)
        return Piece(lo - a, local, hi - lo, 1, self.stride)

    @classmethod
    def of_narrow(cls, shape: tuple[int, ...], itemsize: int, narrow: Narrow) -> Runs:
        """The bytes of ``tensor.narrow(narrow.dim, narrow.start, narrow.length)`` of a
        tensor of ``shape`` (row-major, ``itemsize`` bytes an element)."""
        inner = itemsize
        for n in shape[narrow.dim + 1 :]:
            inner *= n
        count = 1
        for n in shape[: narrow.dim]:
            count *= n
        total = count * shape[narrow.dim] * inner
        if count == 1 or narrow.length == shape[narrow.dim]:
            start = narrow.start * inner
            return cls.one(start, narrow.length * inner * count, total)
        return cls(
            narrow.start * inner, narrow.length * inner, shape[narrow.dim] * inner, count, total
        )

    @classmethod
    def of_box(
        cls,
        shape: tuple[int, ...],
        itemsize: int,
        offset: tuple[int, ...],
        size: tuple[int, ...],
    ) -> Runs | None:
        """The bytes of the box of ``size`` elements from ``offset`` (per dimension) of a
        tensor of ``shape`` (row-major, ``itemsize`` bytes an element), when one set of runs
        holds them: a run per step of the dimensions before the last one the box cuts (each
        run: its band of that dimension, every later dimension whole), which are equally
        far apart when, from the first of them the box spans more than one step of, every
        dimension up to that last cut one is whole (as ``Shard(0)`` plus ``Shard(k)`` of one
        other dimension ``k`` cut a tensor); one run when no earlier dimension spans more
        than a step; else ``None``."""
        strides = [itemsize] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        total = strides[0] * shape[0] if shape else itemsize
        cut = [d for d in range(len(shape)) if size[d] != shape[d]]
        if not cut:
            return cls.one(0, total, total)
        last = cut[-1]
        start = sum(o * s for o, s in zip(offset, strides, strict=True))
        length = size[last] * strides[last]
        spans = [d for d in range(last) if size[d] > 1]
        if not spans or not length:
            return cls.one(start, length * prod(size[:last]), total)
        if any(size[d] != shape[d] for d in range(spans[0] + 1, last)):
            return None
        return cls(start, length, strides[last - 1], prod(size[spans[0] : last]), total)

    def to_list(self) -> list[int]:
        return [self.start, self.length, self.stride, self.count, self.total]


@dataclass
class Routes:
    """What each member of a routed round keeps: its runs by tensor, keyed by its index in
    the epoch's process group (the trainer being 0); a tensor not named: every byte."""

    members: dict[int, dict[int, Runs]]


def rows_of(piece: Piece, data: torch.Tensor) -> torch.Tensor:
    """The bytes of ``piece`` in ``data`` (a slice's bytes, 1-D uint8), as ``rows`` x
    ``nbytes`` (a strided view, no copy)."""
    return data.as_strided(
        (piece.rows, piece.nbytes), (piece.stride, 1), data.storage_offset() + piece.at
    )


def gather(runs: Runs, s: Slice, data: torch.Tensor) -> torch.Tensor:
    """The bytes of slice ``s`` (``data``) that ``runs`` keep, back to back as the keeper
    lays them: a view of ``data`` when they are one range of it, else a packed copy."""
    pieces = runs.pieces(s)
    if len(pieces) == 1 and pieces[0].rows == 1:
        p = pieces[0]
        return data[p.at : p.at + p.nbytes]
    out = torch.empty(sum(p.rows * p.nbytes for p in pieces), dtype=data.dtype, device=data.device)
    at = 0
    for p in pieces:  # one copy of each piece, straight into its place
        n = p.rows * p.nbytes
        out[at : at + n].view(p.rows, p.nbytes).copy_(rows_of(p, data))
        at += n
    return out
