"""Staging: a rank's tensors copied into one reused host buffer, the head of its data file.

The buffer is allocated and touched once per layout (pinned where the state lives on an
accelerator), framed once (every record's constant zip bytes put in place), and reused by
every later save of that layout. It is filled on the saver's staging thread in one of two
ways, advancing the job's watermark as bytes land so that writing starts before staging ends:

- from a device snapshot the call already gathered (:mod:`.device_snapshot`; on an
  accelerator by default): a few large copies on a side stream;
- from the state itself: one copy per record (on an accelerator, on a side stream that first
  waits on the event recorded at the call; on CPU, ``memmove`` in slices), then
  ``staging_completion`` resolves.

A save larger than ``SaveOptions.staging_budget_bytes`` is not held whole: it streams
through the few part-sized slots of one reused buffer of the budget's size
(:mod:`.part_ring`), each part staged once the writer has given its slot back. From the
state, ``staging_completion`` then resolves once the last part is staged; a device
snapshot drains into the slots the same way (its ``staging_completion`` came at the call).

Invariant: a save's buffer is not handed to another save until :meth:`Stager.release`
(the saver releases it once both the save's staging and its writes have ended, failed or
not, and before the save's outcome reaches the caller).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...core import streams
from ...core.buffers import StagingBudgetError, StagingPool
from ...core.handles import completed_future
from ...core.threads import lower_thread_priority
from ...core.waits import wait_future
from ...errors import CheckpointError
from .device_snapshot import DeviceSnapshots
from .job import SaveJob
from .layout import LocalLayout
from .options import STREAM_SLOTS, SaveOptions
from .part_ring import PartPlan, PartRing, fill_part, part_bytes, plan_parts
from .plan import RecordPlan
from .record_copy import copy_records, record_source


class Stager:
    """Owns the staging buffers (one per layout being saved), the side streams and the
    thread that copies the second half of a split copy (``split_copy``)."""

    def __init__(self, rank: int, options: SaveOptions, priority: tuple[int, bool]) -> None:
        self.rank = rank
        self.options = options
        self._pool = StagingPool(options.staging_budget_bytes)
        self._snapshots = DeviceSnapshots(rank, options)
        self._framed: dict[str, int] = {}
        self._parts: dict[str, list[PartPlan]] = {}
        self._side_streams: dict[torch.device, Any] = {}
        self._tail_copier = ThreadPoolExecutor(
            1, "slipstream-stage-tail", initializer=lower_thread_priority, initargs=priority
        )

    @property
    def pool(self) -> StagingPool:
        """The staging buffers, for the saver's counters (read-only use)."""
        return self._pool

    @property
    def snapshots(self) -> DeviceSnapshots:
        """The device snapshots, for the saver's counters (read-only use)."""
        return self._snapshots

    def gather(self, job: SaveJob, devices: set[torch.device]) -> bool:
        """On the caller's thread: gather ``job``'s tensors into a device snapshot (see
        :mod:`.device_snapshot`); False when the save stages from the state instead."""
        return self._snapshots.gather(job, devices)

    def _prepare_pool(self, job: SaveJob) -> None:
        """Decide pinning on the first save; free the buffers of other layouts."""
        if self._pool.allocations == 0:
            pin = self.options.pin_memory
            self._pool.pin = (job.device is not None) if pin is None else pin
        self._drop_stale(job.fingerprint)

    def _buffer(self, job: SaveJob) -> torch.Tensor:
        self._prepare_pool(job)
        try:
            buf = self._pool.acquire(job.fingerprint, job.plan.image_bytes)
        except StagingBudgetError as exc:
            raise StagingBudgetError(
                f"rank {self.rank} cannot stage {job.storage.url}: it needs "
                f"{job.plan.image_bytes} bytes, over SaveOptions.staging_budget_bytes="
                f"{self._pool.budget_bytes}"
            ) from exc
        if self._framed.get(job.fingerprint) != buf.data_ptr():
            job.plan.write_frames(buf)
            self._framed[job.fingerprint] = buf.data_ptr()
        return buf

    def _drop_stale(self, fingerprint: str) -> None:
        """Free the buffers of layouts other than ``fingerprint`` (one layout is staged at
        a time: the pool then holds one buffer)."""
        for stale in [k for k in {*self._framed, *self._parts} if k != fingerprint]:
            self._pool.drop(stale)
            self._framed.pop(stale, None)
            self._parts.pop(stale, None)

    def streams(self, job: SaveJob) -> bool:
        """Whether ``job`` is over the staging budget, so streams through a ring of parts."""
        budget = self.options.staging_budget_bytes
        return budget is not None and job.plan.image_bytes > budget

    def _ring(self, job: SaveJob) -> PartRing:
        """The ring of ``job``'s layout: its parts (planned once per layout) and its slots,
        one pool buffer of ``STREAM_SLOTS`` parts (at most the budget)."""
        budget = self.options.staging_budget_bytes
        assert budget is not None, "only a save over a budget streams"
        self._prepare_pool(job)
        part = part_bytes(budget)
        parts = self._parts.get(job.fingerprint)
        if parts is None:
            parts = self._parts[job.fingerprint] = plan_parts(
                job.plan.records, job.plan.image_bytes, part
            )
        buf = self._pool.acquire(job.fingerprint, STREAM_SLOTS * part)
        return PartRing(buf, parts, f"{job.storage.url}/{job.file}")

    def stage(self, job: SaveJob) -> None:
        """Fill the staging buffer, front to back: drain the device snapshot the call
        gathered, or copy this rank's chunks from the state and then resolve
        ``staging_completion``. A failure is raised (and set on ``job.progress``).

        On CPU the watermark advances after every record (or drained piece) so the upload
        thread writes each part of the file as soon as it is staged; on an accelerator, a
        drain advances it as each piece lands, a copy from the state once the side stream
        has finished.
        """
        try:
            _skip_if_abandoned(job)
            if self.streams(job):
                job.ring = self._ring(job)
                _skip_if_abandoned(job)  # the upload fails the ring only once it is set
            else:
                job.buffer = self._buffer(job)
            job.progress.advance(0)
            side = None
            if job.device is not None:
                side = self._side_streams.setdefault(job.device, streams.new_stream(job.device))
            if job.device_snapshot is not None:
                if job.ring is not None:
                    self._snapshots.drain_parts(job, job.ring, side)
                else:
                    self._snapshots.drain(job, side)
                return
            if job.ring is not None:
                self._stream(job, job.ring, side)
                return
            streams.wait_event(side, job.ready_event)
            head: list[RecordPlan] = job.plan.records
            tail: list[RecordPlan] = []
            if side is None and self.options.split_copy:
                head, tail = _split_by_bytes(job.plan.records)
            tail_copy = (
                self._tail_copier.submit(self._copy_records, job, tail, side, False)
                if tail
                else completed_future()
            )
            try:
                with streams.on_stream(side):
                    self._copy_records(job, head, side, True)
            finally:
                wait_future(tail_copy, job.timeout, f"staging of {job.storage.url}")
            if side is not None:
                side.synchronize()
            self._staged(job)
        except BaseException as exc:
            job.progress.fail(exc)
            if job.ring is not None:
                job.ring.fail(exc)
            raise

    @staticmethod
    def _staged(job: SaveJob) -> None:
        """Every byte of ``job``'s image is staged: the state is no longer read."""
        job.layout = LocalLayout([], {}, {}, {})
        job.progress.advance(job.plan.image_bytes)
        job.response.timings.staged = job.elapsed()
        job.response.staging_completion.set_result(None)

    def _stream(self, job: SaveJob, ring: PartRing, side: torch.Stream | None) -> None:
        """Stage ``job`` part by part into ``ring``'s slots, each once the writer gave it
        back, advancing the watermark past each part as it lands. Every tensor's size is
        checked before the first part, so none is refused after parts were written."""
        tensors = job.layout.tensors
        for rec in job.plan.records:
            record_source(rec, tensors)
        streams.wait_event(side, job.ready_event)
        for k, part in enumerate(ring.parts):
            slot = ring.take(k, job.timeout)
            with streams.on_stream(side):
                fill_part(slot, part, tensors)
            if side is not None:
                side.synchronize()
            job.progress.advance(part.end)
        self._staged(job)

    @staticmethod
    def _copy_records(
        job: SaveJob, records: list[RecordPlan], side: torch.Stream | None, advance: bool
    ) -> None:
        """Copy ``records`` into the staging buffer; with ``advance``, move the watermark
        past each one as it lands (only for a run that starts at the head of the file)."""
        assert job.buffer is not None, "stage() sets the buffer before copying"

        def landed(rec: RecordPlan) -> None:
            job.progress.advance(rec.offset + rec.length)

        on_landed = landed if advance and side is None else None
        copy_records(job.buffer, records, job.layout.tensors, on_landed)

    @staticmethod
    def stage_snapshot(job: SaveJob) -> None:
        """A snapshot laid out as this rank's image is written as it is: nothing to copy."""
        assert job.snapshot is not None
        job.buffer = job.snapshot.buffer
        job.layout = LocalLayout([], {}, {}, {})
        job.progress.advance(job.plan.image_bytes)
        job.response.timings.staged = job.elapsed()
        job.response.staging_completion.set_result(None)

    def release(self, job: SaveJob) -> None:
        """The save's staging and writes have ended: its buffer (or snapshot, or device
        snapshot, when its drain never ran) may serve the next save."""
        self._pool.release(job.fingerprint)
        self._snapshots.release(job)
        if job.snapshot is not None and job.snapshot_hold is not None:
            job.snapshot.release(job.snapshot_hold)
            job.snapshot_hold = None

    def close(self) -> None:
        self._tail_copier.shutdown(wait=True)
        self._pool.clear()
        self._snapshots.clear()


def _skip_if_abandoned(job: SaveJob) -> None:
    if job.abandoned is not None:
        raise CheckpointError(
            f"staging of {job.storage.url} skipped: the save already failed ({job.abandoned})"
        )


def _split_by_bytes(records: list[RecordPlan]) -> tuple[list[RecordPlan], list[RecordPlan]]:
    """Records cut in two runs of about equal bytes, in file order."""
    half = sum(rec.nbytes for rec in records) / 2
    copied = 0
    for i, rec in enumerate(records):
        if copied >= half:
            return records[:i], records[i:]
        copied += rec.nbytes
    return records, []
