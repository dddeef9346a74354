"""How a bucket's payload crosses a transport: runs of packed slices, and the slices large
enough to be sent on their own (``separate_min``), in payload order.

Invariant: a sender and its receivers derive the same segments from the same slices,
include mask and ``separate_min``; no segment list is ever sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plan import Slice, payload_offsets


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
