"""The one send path: how every bucket leaves a trainer.

:func:`send_bucket` sends a bucket packed from live tensors or read from the host cache: it
encodes the bucket's header, cuts the payload into the transport's segments and submits one
:class:`.protocol.BucketMessage`. :func:`send_delta` sends a bucket as its changed words.

Invariant: a bucket's header and segments are derived from the plan and its include mask
exactly as the rollouts derive them (:func:`.packing.payload_segments`).
"""

from __future__ import annotations

import torch

from .delta import DELTA
from .packing import payload_segments, segment_parts
from .plan import BucketPlan, encode_header
from .protocol import BucketMessage
from .transport import Sender


def send_bucket(
    sender: Sender,
    plan: BucketPlan,
    g: int,
    mask: list[int],
    nbytes: int,
    buffer: torch.Tensor,
    separate: dict[int, torch.Tensor],
    header: torch.Tensor | None = None,
) -> None:
    """Send bucket ``g`` with include ``mask`` and a payload of ``nbytes``: ``buffer`` holds
    the packed slices (laid out by :func:`.plan.payload_offsets`; the bytes of slices in
    ``separate`` need not be there), ``separate`` the slices sent from their own bytes.
    ``header``: the bucket's header when it is not the plan's (a described round's)."""
    slices = plan.bucket_slices(g)
    if header is None:
        header = encode_header(
            torch.empty(plan.buckets[g].header_bytes, dtype=torch.uint8), nbytes, mask
        )
    segments = payload_segments(slices, mask, sender.separate_min)
    parts = segment_parts(segments, buffer[:nbytes], separate)
    message = BucketMessage(g, header.to(buffer.device), parts)
    sender.submit(message.header, message.parts)


def send_delta(sender: Sender, plan: BucketPlan, g: int, message: torch.Tensor) -> None:
    """Send bucket ``g`` as the delta ``message`` (:func:`.delta.encode_delta`): its header
    marks every slice :data:`.delta.DELTA` and its payload is the message, one segment."""
    slices = plan.bucket_slices(g)
    header = encode_header(
        torch.empty(plan.buckets[g].header_bytes, dtype=torch.uint8),
        message.numel(),
        [DELTA] * len(slices),
    )
    sender.submit(header.to(message.device), [message])
