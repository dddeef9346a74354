"""How a bucket's payload crosses a transport: runs of packed slices, and the slices large
enough to be sent on their own (``separate_min``), in payload order; or, in a routed round,
one member's own bytes of each slice (:func:`routed_segments`).

Invariant: a sender and its receivers derive the same segments from the same slices,
include mask and ``separate_min`` (or the member's runs); no segment list is ever sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .plan import Slice, align, payload_offsets
from .runs import Runs


def sent_separately(s: Slice, separate_min: int | None) -> bool:
    return separate_min is not None and s.nbytes >= separate_min


@dataclass(frozen=True)
class Segment:
    """Payload bytes ``[start, start + nbytes)`` that cross the transport as one message;
    ``slice`` is set (an index into the bucket's slices) when they are one slice sent on
    its own."""

    start: int
    nbytes: int
    slice: int | None = None


def payload_segments(
    slices: Sequence[Slice], mask: Sequence[int], separate_min: int | None
) -> list[Segment]:
    """The payload of a bucket with include ``mask``, cut into runs of packed slices and the
    slices sent separately, in payload order (sender and receiver derive the same list)."""
    offsets, _ = payload_offsets(slices, mask)
    segments: list[Segment] = []
    run: list[int] | None = None
    for k, (s, off) in enumerate(zip(slices, offsets, strict=True)):
        if off < 0 or s.nbytes == 0:
            continue
        if sent_separately(s, separate_min):
            if run is not None:
                segments.append(Segment(run[0], run[1] - run[0]))
                run = None
            segments.append(Segment(off, s.nbytes, k))
        elif run is None:
            run = [off, off + s.nbytes]
        else:
            run[1] = off + s.nbytes
    if run is not None:
        segments.append(Segment(run[0], run[1] - run[0]))
    return segments


def routed_segments(
    slices: Sequence[Slice], mask: Sequence[int], runs: Mapping[int, Runs]
) -> tuple[list[Segment], int]:
    """The payload one member gets of a bucket with include ``mask`` in a routed round: of
    each included slice the bytes it keeps (``runs`` by tensor; a tensor not named, every
    byte) as a segment of its own, each on an ``ALIGN`` boundary; and the payload's size.
    A slice it keeps nothing of has no segment."""
    segments: list[Segment] = []
    cursor = 0
    for k, (s, keep) in enumerate(zip(slices, mask, strict=True)):
        kept = runs[s.tensor].kept(s) if s.tensor in runs else s.nbytes
        if keep and kept:
            cursor = align(cursor)
            segments.append(Segment(cursor, kept, k))
            cursor += kept
    return segments, cursor
