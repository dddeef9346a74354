"""A publish read from an iterator, bucket by bucket, as the iterator yields.

:class:`StreamSources` has :class:`.packing.BucketSources`' interface (``enter``, ``leave``,
``slice_bytes``), but takes its tensors from an iterator of ``(name, tensor)`` pairs instead
of a list: entering bucket g pulls items until every tensor that starts in bucket g is in,
and leaving it drops those whose last slice was in it. A tensor this rank packs no byte of
is dropped as soon as it is yielded. So the yielded tensors alive at once are those of the
bucket being packed (one larger than a bucket spans several, as its slices go) and the next
one's first, never the whole model.

The layout (names, shapes, dtypes, aliases) is fixed in advance by the plan: the iterator
must yield each sent tensor in the plan's order, under its name, with its shape and dtype;
the other names of a tied tensor (its aliases) may come anywhere after it and are skipped
(their bytes are the tensor's). Anything else (a name out of order or unknown, a shape or
dtype that differs, a tensor missing at the end) raises :class:`LayoutMismatch` naming it.

Invariant: a tensor is read only while it is held here; nothing yielded is kept after the
bucket holding its last slice was left.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn, cast

import torch

from ...core.buffers import as_bytes
from ...core.dtypes import dtype_name
from ..layout.plan import BucketPlan, LayoutMismatch, Slice, is_dtensor


class StreamSources:
    """The tensors bucket ``g`` reads, pulled from ``items`` as the plan's buckets need them."""

    def __init__(
        self, plan: BucketPlan, items: Iterator[tuple[str, torch.Tensor]], rank: int
    ) -> None:
        self.plan = plan
        self.items = items
        self._live: dict[int, torch.Tensor] = {}
        self._next = 0  # the next tensor (index into plan.specs) the iterator must yield
        self._alias_of = {a: i for i, spec in enumerate(plan.specs) for a in spec.aliases}
        self._owned = [False] * len(plan.specs)
        for s in plan.slices:
            if plan.buckets[s.bucket].owner == rank:
                self._owned[s.tensor] = True
        self.peak_gathered_bytes = 0

    def enter(self, g: int) -> None:
        """Pull items until every tensor that starts in bucket ``g`` is in."""
        wanted = max((s.tensor for s in self.plan.bucket_slices(g)), default=-1)
        while self._next <= wanted:
            self._pull()

    def leave(self, g: int) -> None:
        """Drop the tensors whose last slice is in bucket ``g``."""
        for s in self.plan.bucket_slices(g):
            if self.plan.last_bucket[s.tensor] == g:
                self._live.pop(s.tensor, None)

    def slice_bytes(self, s: Slice) -> torch.Tensor:
        return as_bytes(self._live[s.tensor])[s.tensor_offset : s.tensor_offset + s.nbytes]

    def finish(self) -> None:
        """Read the iterator to its end: only aliases of tensors already sent may remain."""
        if self._next < len(self.plan.specs):
            self._missing()
        for name, t in self.items:
            self._skip_alias(name, t)

    def _next_item(self) -> tuple[str, Any]:
        """The next item that is not an alias (skipped: its tensor was sent already)."""
        for name, t in self.items:
            if name not in self._alias_of:
                return name, t
            self._skip_alias(name, t)
        self._missing()

    def _pull(self) -> None:
        name, t = self._next_item()
        i = self._next
        spec = self.plan.specs[i]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if name != spec.name:
            where = f"tensor {i} of the layout is {spec.name!r}"
            if any(s.name == name for s in self.plan.specs):
                raise LayoutMismatch(f"{name!r} was yielded out of the layout's order ({where})")
            raise LayoutMismatch(f"{name!r} is not in the layout ({where})")
        if tuple(t.shape) != spec.shape or dtype_name(t.dtype) != spec.dtype:
            raise LayoutMismatch(
                f"{name!r} is {list(t.shape)} {dtype_name(t.dtype)}, the layout has "
                f"{list(spec.shape)} {spec.dtype}"
            )
        self._next += 1
        if is_dtensor(t):
            t = cast(Any, t).full_tensor()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, spec.nbytes)
        if self._owned[i]:
            self._live[i] = t.detach().contiguous()

    def _skip_alias(self, name: str, t: object) -> None:
        i = self._alias_of.get(name)
        if i is None:
            raise LayoutMismatch(f"{name!r} is not in the layout (it came after every tensor)")
        if i >= self._next:
            raise LayoutMismatch(
                f"{name!r} (a tied name of {self.plan.specs[i].name!r}) was yielded before it"
            )

    def _missing(self) -> NoReturn:
        missing = [s.name for s in self.plan.specs[self._next :]]
        raise LayoutMismatch(
            f"the iterator ended without {missing[:4]}{' ...' if len(missing) > 4 else ''} "
            f"({len(missing)} tensor(s) of the layout)"
        )
