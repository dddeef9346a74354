"""Reading the trainer's tensors bucket by bucket and packing them into payloads.

:class:`BucketSources` walks the plan's buckets in order and materialises only the tensors
the current bucket needs. A DTensor the plan has holders for (:mod:`..layout.holders`) is read
from this rank's own shard, which holds every byte this rank sends of it (a slice's bytes
lie at its place in the shard's runs: rows, or a band of each row): no collective, no full
tensor. Any other DTensor is gathered (``full_tensor``) when its first bucket comes up
and dropped after its last, so at most the tensors of one bucket (plus one that spans
several) are ever gathered at once, never the whole model. Every trainer rank walks the same
buckets in the same order, so those gathers (collectives on the user's mesh, run on the
caller's thread) match across ranks.

:func:`pack_slices` copies a bucket's slices into a payload buffer, takes an xxh3 checksum of
each copied slice, and leaves out (rewinds over) slices whose checksum says every rollout
already holds those bytes. Slices the transport sends on their own (``separate_min``) are
checksummed where they are and not copied: their place in the payload is only reserved.
:func:`..layout.segments.payload_segments` cuts a payload into what crosses the transport, the same
way on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from ...core.buffers import as_bytes, byte_view, memory_at
from ...core.checksum import checksum
from ...core.copy import copy_in_slices, copy_to_address
from ..layout.holders import local_runs
from ..layout.plan import BucketPlan, Slice, align, is_dtensor
from ..layout.runs import Runs
from ..layout.segments import Segment, sent_separately


class BucketSources:
    """The tensors bucket ``g`` reads, materialised lazily and released after their last bucket."""

    def __init__(self, plan: BucketPlan, tensors: Sequence[torch.Tensor], rank: int) -> None:
        self.plan = plan
        self.tensors = tensors
        self.rank = rank
        self._live: dict[int, torch.Tensor] = {}
        #: the bytes of its tensor each live shard holds (a tensor held whole: not here)
        self._runs: dict[int, Runs] = {}
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0

    def enter(self, g: int) -> None:
        """Materialise the tensors that start in bucket ``g`` (gathers run on every rank)."""
        owner = self.plan.buckets[g].owner == self.rank
        holders = self.plan.holders
        for s in self.plan.bucket_slices(g):
            i = s.tensor
            if i in self._live or self.plan.first_bucket[i] != g:
                continue
            t = self.tensors[i]
            if holders is not None and holders[i] is not None:
                if self.plan.parts_of(i, self.rank):
                    local = cast(Any, t).to_local()
                    self._live[i] = local.detach().contiguous()
                    self._runs[i] = local_runs(t, self.plan.specs[i])
            elif is_dtensor(t):
                full = cast(Any, t).full_tensor()
                self.gathered_bytes += self.plan.specs[i].nbytes
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
                if self._owns_any(i):
                    self._live[i] = full.detach().contiguous()
                else:
                    self.gathered_bytes -= self.plan.specs[i].nbytes
            elif owner or self._owns_any(i):
                self._live[i] = t.detach().contiguous()

    def _owns_any(self, i: int) -> bool:
        first, last = self.plan.first_bucket[i], self.plan.last_bucket[i]
        return any(self.plan.buckets[g].owner == self.rank for g in range(first, last + 1))

    def leave(self, g: int) -> None:
        """Release the tensors whose last slice is in bucket ``g``."""
        for s in self.plan.bucket_slices(g):
            i = s.tensor
            if self.plan.last_bucket[i] == g and i in self._live:
                del self._live[i]
                if self._runs.pop(i, None) is None and is_dtensor(self.tensors[i]):
                    self.gathered_bytes -= self.plan.specs[i].nbytes

    def slice_bytes(self, s: Slice) -> torch.Tensor:
        data = as_bytes(self._live[s.tensor])
        runs = self._runs.get(s.tensor)
        if runs is None:
            return data[s.tensor_offset : s.tensor_offset + s.nbytes]
        lo, hi = runs.local_range(s)  # a slice of a part lies in one run of its shard's
        return data[lo:hi]

    def finish(self) -> None:
        """Nothing is left to read: every tensor was given up front."""


class Sources(Protocol):
    """Where a publish reads its tensors from, bucket by bucket in the plan's order:
    :class:`BucketSources` (a list given up front) or :class:`.stream.StreamSources` (an
    iterator, read as it yields)."""

    peak_gathered_bytes: int

    def enter(self, g: int) -> None: ...
    def leave(self, g: int) -> None: ...
    def slice_bytes(self, s: Slice) -> torch.Tensor: ...
    def finish(self) -> None: ...


def slice_checksum(data: torch.Tensor) -> int | None:
    """xxh3 of a CPU byte range; ``None`` (always resend) for device memory."""
    if data.device.type != "cpu":
        return None
    return checksum(byte_view(data))


#: The packing buffer of a bucket that packs nothing.
NO_BYTES = torch.empty(0, dtype=torch.uint8)


def packs_any(slices: Sequence[Slice], separate_min: int | None) -> bool:
    """Whether any of ``slices`` has bytes to pack (is not sent on its own)."""
    return any(s.nbytes and not sent_separately(s, separate_min) for s in slices)


def pack_slices(
    slices: Sequence[Slice],
    read: Callable[[Slice], torch.Tensor],
    out: torch.Tensor,
    unchanged: Callable[[int, int | None], bool],
    first_slice: int,
    separate_min: int | None = None,
) -> tuple[list[int], int, dict[int, int], dict[int, torch.Tensor]]:
    """Copy the changed slices into ``out`` back to back (``ALIGN``-aligned).

    ``unchanged(slice_index, checksum)`` decides whether the slice may be left out. A
    changed slice sent separately is not copied (its bytes in ``out`` stay unwritten) and
    comes back in ``separate``, keyed by its index in ``slices``, as the bytes to send.
    Returns the include mask, the payload size, each slice's checksum and ``separate``.
    """
    mask: list[int] = []
    sums: dict[int, int] = {}
    separate: dict[int, torch.Tensor] = {}
    cursor = 0
    out_address = out.data_ptr() if out.device.type == "cpu" else None
    for k, s in enumerate(slices):
        pos = align(cursor)
        src = read(s)
        if sent_separately(s, separate_min):
            cs = slice_checksum(src)
        elif out_address is not None and copy_to_address(out_address + pos, src):
            cs = checksum(memory_at(out_address + pos, s.nbytes))
        else:
            dst = out[pos : pos + s.nbytes]
            copy_in_slices(dst, src)
            cs = slice_checksum(dst)
        if cs is not None:
            sums[first_slice + k] = cs
        if unchanged(first_slice + k, cs):
            mask.append(0)
            continue
        mask.append(1)
        cursor = pos + s.nbytes
        if sent_separately(s, separate_min):
            separate[k] = src
    return mask, cursor, sums, separate


def segment_parts(
    segments: Sequence[Segment], payload: torch.Tensor, separate: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """The tensors to send for ``segments``: separate slices' own bytes, else payload ranges."""
    return [
        separate[seg.slice]
        if seg.slice is not None and seg.slice in separate
        else payload[seg.start : seg.start + seg.nbytes]
        for seg in segments
    ]
