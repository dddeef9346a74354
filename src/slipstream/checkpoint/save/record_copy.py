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
        src = tensors[rec.chunk.record_key].detach()
        nbytes = src.numel() * src.element_size()
        if nbytes != rec.nbytes:
            raise CheckpointError(
                f"{rec.chunk.fqn!r} holds {nbytes} bytes, its record in the plan "
                f"{rec.nbytes}: the state changed after save() returned"
            )
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
