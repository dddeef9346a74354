"""Copying a save's tensors into a host image laid out by its plan: the one copy that
staging buffers and staged snapshots both use.

Invariant: a record receives exactly its tensor's bytes; a tensor whose size is no longer
its record's is refused before anything of it is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from ...core.copy import copy_in_slices, copy_to_address
from ...core.dtypes import dtype_from_name
from ...errors import CheckpointError
from .plan import RecordPlan


def copy_records(
    image: torch.Tensor,
    records: Iterable[RecordPlan],
    tensors: Mapping[str, torch.Tensor],
    landed: Callable[[RecordPlan], None] | None = None,
) -> set[torch.device]:
    """Copy each record's tensor (``tensors[rec.chunk.record_key]``) to its data in the host
    ``image``; raises if a tensor's size is no longer its record's.

    A host tensor is copied in slices (``memmove`` without the GIL where it can, never an
    OpenMP team over every core), then ``landed(rec)`` is called. A device tensor's copy is
    queued on the current stream, non-blocking: returns the devices with copies queued,
    for the caller to wait on."""
    base = image.data_ptr()
    queued: set[torch.device] = set()
    for rec in records:
        src = record_source(rec, tensors)
        if src.device.type == "cpu":
            if not copy_to_address(base + rec.data_offset, src):
                copy_in_slices(record_view(image, rec), src)
            if landed is not None:
                landed(rec)
        else:
            record_view(image, rec).copy_(src, non_blocking=True)
            queued.add(src.device)
    return queued


def record_view(image: torch.Tensor, rec: RecordPlan) -> torch.Tensor:
    """``rec``'s data in ``image``, as a tensor of the record's dtype and shape."""
    data = image[rec.data_offset : rec.data_offset + rec.nbytes]
    return data.view(dtype_from_name(rec.chunk.dtype)).view(rec.chunk.sizes)


def record_source(rec: RecordPlan, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``rec``'s tensor, refused if its size is no longer the record's."""
    src = tensors[rec.chunk.record_key].detach()
    nbytes = src.numel() * src.element_size()
    if nbytes != rec.nbytes:
        raise CheckpointError(
            f"{rec.chunk.fqn!r} holds {nbytes} bytes, its record in the plan "
            f"{rec.nbytes}: the state changed after save() returned"
        )
    return src


def copy_record_bytes(dst: torch.Tensor, src: torch.Tensor, start: int) -> None:
    """Copy bytes ``[start, start + len(dst))`` of ``src``'s data, in C order, into ``dst``
    (a host ``uint8`` tensor whose start is aligned to ``src``'s element size); a range of
    whole elements. A device tensor's copies are queued on the current stream."""
    item = src.element_size()
    if start % item or dst.numel() % item:
        raise ValueError(f"bytes [{start}, +{dst.numel()}) are not whole {src.dtype} elements")
    at = 0
    for piece in flat_range(src, start // item, (start + dst.numel()) // item):
        n = piece.numel() * item
        view = dst[at : at + n].view(src.dtype).view(piece.shape)
        copy_in_slices(view, piece, non_blocking=src.device.type != "cpu")
        at += n


def flat_range(t: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    """Views of ``t`` (any strides) whose elements, in order, are ``t.flatten()[lo:hi]``:
    at most two partial rows per dimension and one block of whole rows between them."""
    if hi <= lo:
        return []
    if t.dim() <= 1 or t.is_contiguous():
        return [t.reshape(-1)[lo:hi]]
    row = t[0].numel()
    first, last = lo // row, (hi - 1) // row
    if first == last:
        return flat_range(t[first], lo - first * row, hi - first * row)
    head: list[torch.Tensor] = []
    tail: list[torch.Tensor] = []
    whole_from, whole_to = first, last + 1
    if lo % row:
        head = flat_range(t[first], lo % row, row)
        whole_from += 1
    if hi % row:
        tail = flat_range(t[last], 0, hi % row)
        whole_to -= 1
    whole = [t[whole_from:whole_to]] if whole_to > whole_from else []
    return head + whole + tail
