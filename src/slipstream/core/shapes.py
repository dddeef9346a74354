"""Element counts and row-major strides of shapes, computed one way for every caller."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def numel(shape: Iterable[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for the empty shape of a scalar)."""
    n = 1
    for d in shape:
        n *= d
    return n


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides, in elements, of a contiguous (row-major) tensor of ``shape``, as torch gives
    them (a dimension of size 0 counts as 1, so ``(3, 0, 2)`` has strides ``(2, 2, 1)``)."""
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
