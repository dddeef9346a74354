"""The one send path: how every bucket leaves a trainer.

:func:`send_bucket` sends a bucket packed from live tensors or read from the host cache: it
encodes the bucket's header, cuts the payload into the transport's segments and submits one
:class:`..round.protocol.BucketMessage`. :func:`send_delta` sends a bucket as its changed words.
:func:`send_cached_bucket` and :func:`send_cached_delta` send from the host cache
(:mod:`.host_cache`), whose lock the caller holds; :func:`send_cached` sends a generation of
it that a refetch holds.

Invariant: a bucket's header and segments are derived from the plan and its include mask
exactly as the rollouts derive them (:func:`..layout.segments.payload_segments`).
"""

from __future__ import annotations

import torch

from ..layout.delta import DELTA, BucketDelta, encode_delta, root_token
from ..layout.plan import BucketPlan, Slice, encode_header, payload_offsets
from ..layout.runs import Routes
from ..layout.segments import payload_segments
from ..round.protocol import BucketMessage
from ..transport.network import BroadcastSender, Sender
from .host_cache import Generation, HostCache, Unchanged
from .packing import pack_slices, segment_parts, slice_checksum
from .routes import routed_messages


def send_bucket(
    sender: Sender,
    plan: BucketPlan,
    g: int,
    mask: list[int],
    nbytes: int,
    buffer: torch.Tensor,
    separate: dict[int, torch.Tensor],
    header: torch.Tensor | None = None,
    routes: Routes | None = None,
) -> None:
    """Send bucket ``g`` with include ``mask`` and a payload of ``nbytes``: ``buffer`` holds
    the packed slices (laid out by :func:`..layout.plan.payload_offsets`; the bytes of slices in
    ``separate`` need not be there), ``separate`` the slices sent from their own bytes.
    ``header``: the bucket's header when it is not the plan's (a described round's).
    ``routes``: a routed round's (:mod:`.routes`): each member gets its own bytes."""
    slices = plan.bucket_slices(g)
    if routes is not None:
        assert isinstance(sender, BroadcastSender) and header is None
        offsets, _ = payload_offsets(slices, mask)
        full = [
            None if off < 0 else separate.get(k, buffer[off : off + s.nbytes])
            for k, (s, off) in enumerate(zip(slices, offsets, strict=True))
        ]
        header_bytes = plan.buckets[g].header_bytes
        sender.submit_routed(routed_messages(routes, slices, mask, header_bytes, full))
        return
    if header is None:
        header = encode_header(
            torch.empty(plan.buckets[g].header_bytes, dtype=torch.uint8), nbytes, mask
        )
    segments = payload_segments(slices, mask, sender.separate_min)
    parts = segment_parts(segments, buffer[:nbytes], separate)
    message = BucketMessage(g, header.to(buffer.device), parts)
    sender.submit(message.header, message.parts)


def send_delta(sender: Sender, plan: BucketPlan, g: int, message: torch.Tensor) -> None:
    """Send bucket ``g`` as the delta ``message`` (:func:`..layout.delta.encode_delta`): its header
    marks every slice :data:`..layout.delta.DELTA` and its payload is the message, one segment."""
    slices = plan.bucket_slices(g)
    header = encode_header(
        torch.empty(plan.buckets[g].header_bytes, dtype=torch.uint8),
        message.numel(),
        [DELTA] * len(slices),
    )
    sender.submit(header.to(message.device), [message])


def send_cached_delta(
    cache: HostCache, sender: Sender, plan: BucketPlan, g: int, delta: BucketDelta
) -> None:
    """Send bucket ``g`` as ``delta`` (computed from the cache's ``base_version``) and record
    the token it leads to in the cache."""
    assert cache.base_version is not None
    message, header = encode_delta(sender.next_buffer(), delta, cache.base_version, cache.tokens[g])
    send_delta(sender, plan, g, message)
    cache.tokens[g] = header.token


def send_cached(held: Generation, sender: Sender, device: torch.device) -> None:
    """Send every bucket of ``held`` (the buckets its rank owns), whole, through ``sender``
    (a refetch)."""
    for g in held.offsets:
        send_view(sender, held.plan, g, held.bucket(g), device, None)


def send_cached_bucket(
    cache: HostCache,
    sender: Sender,
    plan: BucketPlan,
    g: int,
    device: torch.device,
    unchanged: Unchanged | None,
    version: int | None = None,
    routes: Routes | None = None,
) -> dict[int, int]:
    """Send bucket ``g``'s bytes from the cache, leaving out the slices ``unchanged`` names,
    and record the bucket's token as the rollouts will for ``version``; return every slice's
    checksum (see :func:`send_view`)."""
    if version is not None:
        cache.tokens[g] = root_token(plan.plan_id, g, version)
    return send_view(sender, plan, g, cache.bucket(g), device, unchanged, routes)


def send_view(
    sender: Sender,
    plan: BucketPlan,
    g: int,
    padded: torch.Tensor,
    device: torch.device,
    unchanged: Unchanged | None,
    routes: Routes | None = None,
) -> dict[int, int]:
    """Send bucket ``g`` from ``padded`` (its bytes laid out as the plan lays out a bucket
    with every slice, padded to whole words), leaving out the slices ``unchanged`` names;
    return every slice's checksum. Without ``unchanged`` every byte is sent and nothing is
    hashed."""
    sums: dict[int, int] = {}
    bucket = plan.buckets[g]
    view = padded[: bucket.nbytes]

    def cached(s: Slice) -> torch.Tensor:
        return view[s.bucket_offset : s.bucket_offset + s.nbytes]

    slices = plan.bucket_slices(g)
    mask = [1] * len(slices)
    for j, s in enumerate(slices if unchanged is not None else ()):
        cs = slice_checksum(cached(s))
        if cs is not None:
            sums[bucket.first_slice + j] = cs
        assert unchanged is not None
        mask[j] = 0 if unchanged(bucket.first_slice + j, cs) else 1
    if all(mask) and view.device == device:
        # the cache already holds the payload where the transport reads: no copy
        send_bucket(sender, plan, g, mask, bucket.nbytes, view, {}, routes=routes)
        return sums
    out = sender.next_buffer()
    kept = [s for s, m in zip(slices, mask, strict=True) if m]
    _, nbytes, _, _ = pack_slices(kept, cached, out, lambda i, cs: False, 0)
    send_bucket(sender, plan, g, mask, nbytes, out, {}, routes=routes)
    return sums
