"""The device snapshot: a save's tensors gathered on their own device in a few copy calls,
then drained to the host staging buffer in a few large ones.

In ``save()``, on the caller's thread, :meth:`DeviceSnapshots.gather` copies every tensor
this rank writes into the layout's snapshot buffer, a flat buffer on the state's device laid
out byte for byte as this rank's image (framed once, when it is allocated), with
:class:`~...core.gather.FlatGather` on the caller's current stream; it records an event
after the copies and ``staging_completion`` resolves: work the caller queues on that stream
from then on runs after the gather (on CPU, the gather has run). On the staging thread,
:meth:`DeviceSnapshots.drain` has the side stream wait for that event and copies the
snapshot to the host staging buffer in at most :data:`DRAIN_PIECES` copies, the watermark
advancing as each lands; the writes then go on from the host buffer.

The same code runs on CPU (``SaveOptions.device_snapshot=True``): the snapshot is then host
memory and there are no streams.

Invariants: a layout's snapshot is gathered into only by the one save that holds it, and is
released once that save's drain has ended (landed, failed or never begun) with no copy of it
left queued; once released, its buffer goes back to the device's caching allocator unless
``SaveOptions.keep_device_snapshot`` (so by default it holds no device memory between
saves); a save whose snapshot does not fit ``SaveOptions.device_snapshot_bytes`` (for a
snapshot in host memory, by default, ``SaveOptions.staging_budget_bytes``), or whose
tensors span several accelerators, stages the usual way, and the saver says so once. A
snapshot of a save over the staging budget drains part by part through the budget's slots
(:meth:`DeviceSnapshots.drain_parts`), so host staging memory stays within it.
"""

from __future__ import annotations

import logging
import threading

import torch

from ...core import streams, tracing
from ...core.buffers import PAGE_BYTES
from ...core.copy import copy_in_slices
from ...core.dtypes import dtype_from_name
from ...core.gather import FlatGather, Slot
from ...errors import CheckpointError
from ..format.records import tensor_frame
from .job import DeviceSnapshot, SaveJob
from .options import SaveOptions
from .part_ring import PartRing
from .plan import SavePlan

logger = logging.getLogger(__name__)

DRAIN_PIECES = 4
"""Most copies a drain issues: enough for the writes to start before the drain ends."""


class DeviceSnapshots:
    """Owns the snapshot buffers (one per layout being saved); the saver's stager holds it."""

    def __init__(self, rank: int, options: SaveOptions) -> None:
        self.rank = rank
        self.options = options
        self._snapshots: dict[tuple[str, torch.device], DeviceSnapshot] = {}
        self._lock = threading.Lock()
        self._said_why_not = False
        self.allocations = 0

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(int(s.buffer.numel()) for s in self._snapshots.values())

    def gather(self, job: SaveJob, devices: set[torch.device]) -> bool:
        """Gather ``job``'s tensors (``devices``: where they live) into its layout's
        snapshot and record the event the drain waits for. Returns False, having copied
        nothing, when this save stages the usual way instead."""
        device = self._device(job, devices)
        if device is None:
            return False
        snap = self._acquire(job, device)
        if snap is None:
            return False
        job.device_snapshot = snap
        try:
            tensors = job.layout.tensors
            with tracing.span("slipstream.save.gather", url=job.storage.url):
                snap.gather.copy([tensors[k] for k in snap.record_keys], devices)
            job.gathered = streams.record_event(streams.current_stream(device))
        except BaseException:
            self.release(job)
            raise
        return True

    def drain(self, job: SaveJob, side: torch.Stream | None) -> None:
        """Copy ``job``'s snapshot into its host buffer (``job.buffer``) on ``side`` (``None``
        on CPU), advancing the watermark as each piece lands. The snapshot is released
        however the drain ends, and before the watermark reaches the end: the save cannot
        finish (and the next one gather into the snapshot) while it is still held."""
        snap = job.device_snapshot
        host = job.buffer
        assert snap is not None and host is not None, "gather() and stage() set them"
        nbytes = job.plan.image_bytes
        try:
            src = snap.buffer[:nbytes]
            landed: list[tuple[int, torch.Event | None]] = []  # on an accelerator
            streams.wait_event(side, job.gathered)
            with streams.on_stream(side):
                for start, end in drain_pieces(nbytes):
                    with tracing.span("slipstream.save.drain", start=start, end=end):
                        copy_in_slices(
                            host[start:end], src[start:end], non_blocking=side is not None
                        )
                    if side is not None:
                        landed.append((end, streams.record_event(side)))
                    elif end < nbytes:
                        job.progress.advance(end)
            for end, event in landed:
                streams.synchronize_event(event)
                if end < nbytes:
                    job.progress.advance(end)
        finally:
            if side is not None:
                side.synchronize()  # nothing queued may still read the snapshot once released
            self.release(job)
        job.progress.advance(nbytes)

    def drain_parts(self, job: SaveJob, ring: PartRing, side: torch.Stream | None) -> None:
        """Copy ``job``'s snapshot into ``ring``'s slots part by part (a save over the
        staging budget), each once the writer has given its slot back, the watermark
        advancing as each part lands; the snapshot is released as :meth:`drain` releases it."""
        snap = job.device_snapshot
        assert snap is not None, "gather() set it"
        nbytes = job.plan.image_bytes
        try:
            streams.wait_event(side, job.gathered)
            for k, part in enumerate(ring.parts):
                slot = ring.take(k, job.timeout)
                with (
                    streams.on_stream(side),
                    tracing.span("slipstream.save.drain", start=part.start, end=part.end),
                ):
                    copy_in_slices(
                        slot[: part.end - part.start],
                        snap.buffer[part.start : part.end],
                        non_blocking=side is not None,
                    )
                if side is not None:
                    side.synchronize()
                if part.end < nbytes:
                    job.progress.advance(part.end)
        finally:
            if side is not None:
                side.synchronize()  # nothing queued may still read the snapshot once released
            self.release(job)
        job.progress.advance(nbytes)

    def release(self, job: SaveJob) -> None:
        """``job`` is done with its snapshot (if it still holds one); idempotent. The
        buffer is dropped (back to the allocator) unless the options keep it."""
        with self._lock:
            snap, job.device_snapshot = job.device_snapshot, None
            if snap is not None:
                snap.in_use = False
                if not self.options.keep_device_snapshot:
                    self._snapshots.pop(snap.key, None)

    def clear(self) -> None:
        with self._lock:
            self._snapshots.clear()

    def _device(self, job: SaveJob, devices: set[torch.device]) -> torch.device | None:
        """The device to snapshot ``job`` on, or None to stage straight to the host."""
        wanted = self.options.device_snapshot
        if wanted is False or self.options.device_snapshot_bytes == 0 or not job.plan.records:
            return None
        accelerators = {d for d in devices if streams.is_accelerator(d)}
        if len(accelerators) > 1:
            names = ", ".join(sorted(map(str, accelerators)))
            self._say_why_not(f"its tensors are on several devices ({names})")
            return None
        if accelerators:
            return next(iter(accelerators))
        return torch.device("cpu") if wanted else None

    def _acquire(self, job: SaveJob, device: torch.device) -> DeviceSnapshot | None:
        key = (job.fingerprint, device)
        with self._lock:
            snap = self._snapshots.get(key)
            if snap is not None:
                if snap.in_use:
                    raise CheckpointError(
                        f"rank {self.rank}: the device snapshot of this layout is still held "
                        "by an earlier save"
                    )
                snap.in_use = True
                return snap
            for stale in [k for k, s in self._snapshots.items() if not s.in_use]:
                del self._snapshots[stale]
        nbytes = job.plan.image_bytes
        limit = self._limit(device)
        if limit is not None and nbytes > limit:
            self._say_why_not(
                f"it needs {nbytes} bytes on {device}, over the {limit} bytes it may take "
                "(SaveOptions.device_snapshot_bytes; in host memory, by default, "
                "staging_budget_bytes)"
            )
            return None
        try:
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as exc:
            self._say_why_not(f"allocating {nbytes} bytes on {device} failed ({exc})")
            return None
        _frame(buffer, job.plan)
        slots = [
            Slot(rec.data_offset, dtype_from_name(rec.chunk.dtype), rec.chunk.sizes)
            for rec in job.plan.records
        ]
        keys = [rec.chunk.record_key for rec in job.plan.records]
        snap = DeviceSnapshot(key, buffer, FlatGather(buffer, slots), keys, in_use=True)
        with self._lock:
            self._snapshots[key] = snap
            self.allocations += 1
        return snap

    def _limit(self, device: torch.device) -> int | None:
        """The bytes a snapshot may take on ``device``: the option, or half of what the
        device has free now; in host memory, the staging budget (no limit without one)."""
        if self.options.device_snapshot_bytes is not None:
            return self.options.device_snapshot_bytes
        if not streams.is_accelerator(device):
            return self.options.staging_budget_bytes
        free, _ = torch.accelerator.get_memory_info(device)
        return free // 2

    def _say_why_not(self, why: str) -> None:
        """Log, once per saver at WARNING (then at DEBUG), why a save stages straight to
        the host instead of through a device snapshot."""
        level = logging.DEBUG if self._said_why_not else logging.WARNING
        self._said_why_not = True
        logger.log(
            level,
            "rank %d: no device snapshot for this save, %s; it stages straight to the host "
            "(one copy per tensor), as will any other save that does not fit",
            self.rank,
            why,
        )


def drain_pieces(nbytes: int) -> list[tuple[int, int]]:
    """``[0, nbytes)`` cut into at most :data:`DRAIN_PIECES` runs, each a whole number of
    pages but the last."""
    pages = -(-nbytes // PAGE_BYTES)
    step = max(1, -(-pages // DRAIN_PIECES)) * PAGE_BYTES
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def _frame(buffer: torch.Tensor, plan: SavePlan) -> None:
    """Put every record's constant zip bytes in place in ``buffer`` (on any device) with one
    indexed copy, so that the drain copies whole records, frames included."""
    positions: list[torch.Tensor] = []
    pieces: list[bytes] = []
    for rec in plan.records:
        frame = tensor_frame(dtype_from_name(rec.chunk.dtype), rec.chunk.sizes)
        end = rec.data_offset + rec.nbytes
        positions.append(torch.arange(rec.offset, rec.offset + len(frame.prefix)))
        positions.append(torch.arange(end, end + len(frame.suffix)))
        pieces += [frame.prefix, frame.suffix]
    if not positions:
        return
    values = torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)
    index = torch.cat(positions)
    if streams.is_accelerator(buffer.device):
        # from pinned memory the copies queue behind the caller's work instead of waiting
        # for it (torch's pinned allocator keeps these until the device has read them)
        values, index = values.pin_memory(), index.pin_memory()
    to = buffer.device
    buffer.index_copy_(0, index.to(to, non_blocking=True), values.to(to, non_blocking=True))
