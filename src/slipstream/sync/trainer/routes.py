"""What each member gets in a routed round (:attr:`..round.protocol.RoundStart.routed`).

Over the network a rollout that keeps only part of the tensors (a tensor-parallel rank) asks
for only those bytes (:class:`..round.protocol.Wants`); in a round where one does, a trainer
sends every member its own bytes of each bucket, point to point: of each included slice the
bytes its runs keep (:func:`..layout.runs.gather`: a view of the slice where they are one
range of it, else a packed copy), every byte for a member that keeps the tensor whole.

Invariant: a member's message is its payload of :func:`..layout.segments.routed_segments`,
the segments its receiver posts, under a header naming that payload's size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout.plan import Slice, encode_header
from ..layout.runs import Routes, gather
from ..layout.segments import routed_segments
from ..transport.network import RoutedMessage


def routed_messages(
    routes: Routes,
    slices: Sequence[Slice],
    mask: Sequence[int],
    header_bytes: int,
    full: Sequence[torch.Tensor | None],
) -> list[RoutedMessage]:
    """Every member's message of a bucket whose included slices' bytes are ``full`` (by
    index in the bucket; ``None`` for those left out)."""
    out = []
    for member, runs in routes.members.items():
        segments, size = routed_segments(slices, mask, runs)
        parts = []
        for seg in segments:
            assert seg.slice is not None
            s, data = slices[seg.slice], full[seg.slice]
            assert data is not None
            parts.append(gather(runs[s.tensor], s, data) if s.tensor in runs else data)
        header = encode_header(torch.empty(header_bytes, dtype=torch.uint8), size, mask)
        out.append(RoutedMessage(member, header, parts))
    return out
