"""Staging under a budget: a rank's image streamed through a few part-sized host slots.

A save whose image is larger than ``SaveOptions.staging_budget_bytes`` keeps the file layout
of any other save (:mod:`.plan`), but is never held whole: the image is cut into parts of
:func:`part_bytes` and the budget into :data:`~.options.STREAM_SLOTS` slots of that size.
The stager copies part ``k`` (its frames, its records' data or the pieces of them that fall
in it, its zero padding) into slot ``k % STREAM_SLOTS`` and advances the watermark to the
part's end; the writer writes the slot's bytes at the part's place in the file, hashes the
records' bytes in it, and gives the slot back; the stager takes a slot only once the part
it last held is given back, waiting at most the save's timeout.

Invariants: a slot holds one part from :meth:`PartRing.take` until :meth:`PartRing.give_back`
(nothing else writes into it meanwhile); the bytes the parts carry are, byte for byte, the
image a save within the budget would stage (frames, data, zeroed padding); a failure on
either side (:meth:`PartRing.fail`) wakes the other at once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...core.buffers import PAGE_BYTES, byte_view
from ...core.dtypes import dtype_from_name
from ...errors import PeerTimeoutError
from ..format.records import tensor_frame
from .options import STREAM_SLOTS
from .plan import RecordPlan
from .record_copy import copy_record_bytes, record_source


@dataclass(frozen=True)
class PartPiece:
    """``length`` bytes at ``at`` in a part: bytes ``[start, start + length)`` of
    ``record``'s data, or, where ``record`` is ``None``, the constant bytes ``fill``."""

    at: int
    length: int
    record: RecordPlan | None
    start: int = 0
    fill: bytes = b""


@dataclass(frozen=True)
class PartPlan:
    """The image's bytes ``[start, end)`` and the pieces that make them, in order."""

    start: int
    end: int
    pieces: list[PartPiece]


def part_bytes(budget_bytes: int) -> int:
    """The size of each part (and slot) under ``budget_bytes``: whole pages, so that every
    part but the last starts and ends on a page (``O_DIRECT`` writes stay aligned)."""
    return budget_bytes // STREAM_SLOTS // PAGE_BYTES * PAGE_BYTES


def plan_parts(records: list[RecordPlan], image_bytes: int, part: int) -> list[PartPlan]:
    """``image_bytes`` of image (``records`` in file order, from offset 0) cut into parts of
    ``part`` bytes: each record's frame, its data split where a part ends, its padding."""
    runs: list[tuple[int, int, RecordPlan | None, bytes]] = []
    for i, rec in enumerate(records):
        frame = tensor_frame(dtype_from_name(rec.chunk.dtype), rec.chunk.sizes)
        data_end = rec.data_offset + rec.nbytes
        next_offset = records[i + 1].offset if i + 1 < len(records) else image_bytes
        padding = bytes(next_offset - data_end - len(frame.suffix))
        runs.append((rec.offset, len(frame.prefix), None, frame.prefix))
        runs.append((rec.data_offset, rec.nbytes, rec, b""))
        runs.append((data_end, next_offset - data_end, None, frame.suffix + padding))
    pieces: list[list[PartPiece]] = [[] for _ in range(0, image_bytes, part)]
    for offset, length, source, fill in runs:
        pos = offset
        while pos < offset + length:
            k = pos // part
            cut = min(offset + length, (k + 1) * part)
            within = pos - offset
            piece = (
                PartPiece(pos - k * part, cut - pos, source, start=within)
                if source is not None
                else PartPiece(pos - k * part, cut - pos, None, fill=fill[within : cut - offset])
            )
            pieces[k].append(piece)
            pos = cut
    return [PartPlan(k * part, min((k + 1) * part, image_bytes), p) for k, p in enumerate(pieces)]


def fill_part(slot: torch.Tensor, plan: PartPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``plan``'s bytes into ``slot`` (a device tensor's copies queued on the current
    stream, for the caller to wait on)."""
    view = byte_view(slot)
    for piece in plan.pieces:
        if piece.record is None:
            view[piece.at : piece.at + piece.length] = piece.fill
        else:
            src = record_source(piece.record, tensors)
            copy_record_bytes(slot[piece.at : piece.at + piece.length], src, piece.start)


class PartRing:
    """One budgeted save's slots (views of one reused pool buffer) and which part each
    holds; shared by the stager (:meth:`take`) and the writer (:meth:`slot`,
    :meth:`give_back`)."""

    def __init__(self, buffer: torch.Tensor, parts: list[PartPlan], where: str) -> None:
        self.parts = parts
        self.part_bytes = parts[0].end - parts[0].start
        self.where = where
        slots = buffer.numel() // self.part_bytes
        self._slots = [
            buffer[i * self.part_bytes : (i + 1) * self.part_bytes] for i in range(slots)
        ]
        self._holding: list[int | None] = [None] * slots
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def take(self, k: int, timeout: float) -> torch.Tensor:
        """Wait for the slot of part ``k`` to be free (the part it held given back), mark it
        as ``k``'s and return it; raises the other side's failure, or on timeout."""
        i = k % len(self._slots)
        with self._cond:
            free = self._cond.wait_for(
                lambda: self._holding[i] is None or self._error is not None, timeout
            )
            if self._error is not None:
                raise self._error
            if not free:
                raise PeerTimeoutError(
                    f"staging of {self.where}: part {k} waited {timeout} s for a slot of the "
                    f"staging budget, still held by part {self._holding[i]} (its write did "
                    "not finish)"
                )
            self._holding[i] = k
        return self._slots[i]

    def slot(self, k: int) -> torch.Tensor:
        """The slot holding part ``k`` (taken, and not yet given back)."""
        i = k % len(self._slots)
        with self._cond:
            assert self._holding[i] == k, f"part {k} is not in its slot"
        return self._slots[i]

    def give_back(self, k: int) -> None:
        """Part ``k`` is written and hashed: its slot may take the next part."""
        with self._cond:
            i = k % len(self._slots)
            if self._holding[i] == k:
                self._holding[i] = None
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The save failed: wake a stager waiting for a slot, with ``exc``."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
