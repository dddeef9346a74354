"""Asynchronous saves: stage into reused buffers off the caller's thread, then upload.

Pipeline of one save (each stage on a thread this object owns and joins in ``close``):

1. caller's thread: flatten the state dict, serialize plain values (so later mutation
   cannot change them, and a bad value fails here, naming its key; a value equal to the
   previous save's reuses its bytes), look up the plan
   for this layout (planning, through the store, only on a layout's first save), record
   an event on the accelerator's current stream; return.
2. staging thread: copy every tensor chunk this rank writes into its staging buffer,
   whose bytes are the head of the rank's data file (record headers already in place);
   on an accelerator the copy runs on a side stream that first waits on that event.
   Then ``staging_completion`` resolves: the caller may mutate the state.
3. upload thread: pick file names no committed checkpoint here uses (see
   :mod:`.generations`: an older checkpoint stays loadable until this one commits), then
   write the buffer in parallel pieces through the storage backend's writer (``pwrite``
   on the local disk, multipart parts on an object store), block checksums, plain values
   appended, make it durable; post the result; rank 0 gathers every rank's result and
   commits (metadata last, atomically); every rank waits for that commit, then
   ``upload_completion`` resolves; the older checkpoint's files are deleted after the
   commit. A save that fails removes what it wrote at once (a rank's aborted write, its
   file once the commit fails).

Backpressure: one save in flight; a new save first waits for the previous one to finish
(its staging buffer is about to be reused). Host memory: one staging buffer, for the
layout being saved (a layout change frees the old one). Nothing here touches the user's
process group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import streams
from ..core.buffers import StagingBudgetError, StagingPool, byte_view
from ..core.checksum import block_checksums, checksum
from ..core.copy import copy_in_slices, copy_to_address
from ..core.handles import Watermark, completed_future, fail_unfinished
from ..core.threads import lower_thread_priority
from ..core.waits import Deadline, wait_future
from ..errors import CheckpointError, PeerDiedError, PeerTimeoutError, SlipstreamError
from .channel import RankChannel
from .commit import METADATA_FILE, CommitTemplate, build_index, build_metadata, publish
from .generations import data_file, files_of, free_generation, generation_of, index_file
from .layout import LocalLayout, ValueSerializer, dtype_from_name, local_layout
from .plan import SavePlan, data_file_name, make_save_plan
from .safe_pickle import load_metadata
from .storage import DataWriter, Location, Storage, resolve_storage

logger = logging.getLogger(__name__)

WRITE_PIECE_BYTES = 64 * 1024 * 1024
MAX_CACHED_PLANS = 8


@dataclass
class SaveOptions:
    """Knobs of :class:`CheckpointSaver`; the defaults suit most jobs."""

    timeout: float = 600.0
    """Seconds any wait on another rank may take before failing with the rank's name."""
    io_threads: int = 4
    """Parallel writes per rank."""
    staging_budget_bytes: int | None = None
    """Upper bound on host staging memory; ``None`` means the size of one save."""
    pin_memory: bool | None = None
    """Pin staging buffers; ``None`` pins when the state lives on an accelerator."""
    direct_io: bool = True
    """On the local disk, write data files with ``O_DIRECT`` where the filesystem allows it
    (see :class:`~.storage.local.LocalDataWriter`)."""
    split_copy: bool = False
    """Stage CPU tensors with two threads: the staging thread copies the first half of the
    bytes front to back (so writes start at once) while a second thread copies the rest.
    Staging then finishes about twice as fast, but on a host whose cores all train, the
    second thread takes CPU from the training loop (measured: 12% instead of 4% per step)."""
    thread_nice: int = 5
    """Nice increment of the saver's own threads (Linux), so that on oversubscribed cores
    staging and upload give way to the training thread; 0 keeps the caller's priority."""
    idle_threads: bool = False
    """Run the saver's threads under Linux's ``SCHED_IDLE`` policy instead (``thread_nice``
    where it is refused): they use only time no other thread wants, and a training thread
    that wakes takes its core back at once. Where the cores are all busy, a save then makes
    progress only once the training loop waits for it, and a saver that falls behind stalls
    the next save call (measured on the demo's two CPU ranks through a ``Checkpointer``:
    +26% to +37% a step against +15% to +18% at ``thread_nice``, four runs); measure
    before turning it on."""


@dataclass
class SaveTimings:
    """Where one save's time went on this rank, in seconds from the call; each field is
    filled in when its phase ends (``None`` until then, or if the save failed)."""

    nbytes: int = 0
    """Tensor bytes this rank staged and wrote."""
    blocked: float | None = None
    """Time the caller's thread spent in the call (waiting for the previous save included)."""
    staged: float | None = None
    """Until ``staging_completion``: the state may be mutated from then on."""
    durable: float | None = None
    """Until ``upload_completion``: written, fsync'd and committed on every rank."""


@dataclass
class AsyncSaveResponse:
    """The two phases of a save, as futures (same names as DCP's ``AsyncSaveResponse``),
    and this rank's :class:`SaveTimings` of it."""

    staging_completion: Future
    upload_completion: Future
    timings: SaveTimings = field(default_factory=SaveTimings)
    skipped: bool = False
    """The save was skipped (a ``Checkpointer`` with ``when_busy="skip"``): nothing written."""

    def result(self, timeout: float | None = None) -> None:
        """Wait until the save is durable and committed."""
        self.upload_completion.result(timeout)


@dataclass
class _Job:
    plan: SavePlan
    templates: dict[int, CommitTemplate]
    """The plan's commit templates by generation, shared by its saves (made on rank 0)."""
    layout: LocalLayout
    values: dict[str, bytes]
    storage: Storage
    seq: int
    fingerprint: str
    ready_event: Any
    device: torch.device | None
    response: AsyncSaveResponse
    after_commit: Callable[[], None] | None
    started: float = 0.0
    progress: Watermark = field(default_factory=Watermark)
    buffer: torch.Tensor | None = None
    generation: int = 0
    """The generation of file names this save writes (see :mod:`.generations`)."""
    replaced: set[str] = field(default_factory=set)
    """Data files of the committed checkpoint this save replaces, deleted after its commit."""
    replaced_index: str | None = None

    @property
    def file(self) -> str:
        """This rank's data file, as this save names it."""
        return data_file(self.plan.file, self.generation)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class CheckpointSaver:
    """Owns the threads, staging buffers and cached plans of saves for one process group."""

    def __init__(self, process_group=None, options: SaveOptions | None = None) -> None:
        self.options = options or SaveOptions()
        self.channel = RankChannel.for_group(process_group)
        priority = (self.options.thread_nice, self.options.idle_threads)
        self._stage_thread = ThreadPoolExecutor(
            1, "slipstream-stage", initializer=lower_thread_priority, initargs=priority
        )
        self._upload_thread = ThreadPoolExecutor(
            1, "slipstream-upload", initializer=lower_thread_priority, initargs=priority
        )
        self._tail_copier = ThreadPoolExecutor(
            1, "slipstream-stage-tail", initializer=lower_thread_priority, initargs=priority
        )
        self._io_pool = ThreadPoolExecutor(
            self.options.io_threads,
            "slipstream-io",
            initializer=lower_thread_priority,
            initargs=priority,
        )
        self._pool = StagingPool(self.options.staging_budget_bytes)
        self._framed: dict[str, int] = {}
        self._plans: dict[str, tuple[SavePlan, dict[int, CommitTemplate]]] = {}
        self._serialize_values = ValueSerializer()
        self._seq = 0
        self._last: AsyncSaveResponse | None = None
        self._side_streams: dict[torch.device, Any] = {}
        self._closed = False
        self._lock = threading.Lock()
        self.plans_made = 0

    @property
    def rank(self) -> int:
        return self.channel.rank

    def save(
        self,
        state_dict: Mapping[str, Any],
        checkpoint_id: Location,
        after_commit: Callable[[], None] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> AsyncSaveResponse:
        """Start a save; returns once the work is queued (see the module docstring).

        ``after_commit`` runs on rank 0's upload thread once the save has committed and
        before the commit is announced, so no rank's ``upload_completion`` resolves before
        it has run (used for retention: every rank then sees the same steps).
        ``checkpoint_id`` is a path, a URL or a :class:`Storage` (see :mod:`.storage`);
        ``storage_options`` configure an object store's client.
        """
        if self._closed:
            raise CheckpointError("this saver is closed")
        started = time.perf_counter()
        self.wait_previous()
        dead = self.channel.known_dead()
        if dead:
            rank, why = min(dead.items())
            raise PeerDiedError(
                f"rank {rank} is dead ({why}); saves fail at once until the job rebuilds its "
                "process group"
            )
        # Every rank numbers this save before anything can fail on its own thread, so a
        # save that fails on one rank only leaves the ranks' sequence numbers in step.
        seq = self._seq
        self._seq += 1
        try:
            storage = resolve_storage(
                checkpoint_id, storage_options, direct_io=self.options.direct_io
            )
            layout, values, plan, templates = self._prepare(state_dict, seq, storage)
        except BaseException as exc:
            self._announce_failure(seq, exc)
            raise
        fingerprint = plan.fingerprints[plan.rank]
        device = _accelerator_of(layout)
        ready = streams.record_event(streams.current_stream(device)) if device else None
        response = AsyncSaveResponse(Future(), Future())
        job = _Job(
            plan=plan,
            templates=templates,
            layout=layout,
            values=values,
            storage=storage,
            seq=seq,
            fingerprint=fingerprint,
            ready_event=ready,
            device=device,
            response=response,
            after_commit=after_commit,
            started=started,
        )
        response.timings.nbytes = plan.data_bytes
        self._stage_thread.submit(self._stage, job)
        self._upload_thread.submit(self._upload, job)
        self._last = response
        response.timings.blocked = job.elapsed()
        return response

    def _prepare(
        self, state_dict: Mapping[str, Any], seq: int, storage: Storage
    ) -> tuple[LocalLayout, dict[str, bytes], SavePlan, dict[int, CommitTemplate]]:
        """The caller's-thread part of save ``seq``: layout, serialized values, plan (made
        only for a new layout) with its commit templates, and the location, prepared."""
        layout = local_layout(state_dict)
        values = self._serialize_values(layout.values)
        signature = layout.signature
        cached = self._plans.get(signature)
        if cached is None:
            plan = self._make_plan(layout, seq, storage.url, Deadline(self.options.timeout))
            cached = (plan, {})
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[signature] = cached
        plan, templates = cached
        storage.prepare()
        return layout, values, plan, templates

    def _announce_failure(self, seq: int, exc: BaseException) -> None:
        """Tell the other ranks that this rank's part of save ``seq`` failed before it was
        queued, so that they fail at once naming this rank instead of waiting for it until
        their timeout: ranks planning read it as this rank's layout, rank 0 as its write
        report, and when this is rank 0, every rank as the commit's outcome."""
        error = f"{type(exc).__name__}: {exc}"
        self.channel.post(f"{seq}/layout", {"error": error})
        self.channel.post(f"{seq}/done", {"fp": None, "error": error})
        if self.rank == 0:
            self.channel.post(f"{seq}/commit", {"error": f"rank 0: {error}", "timeout": False})

    def wait_previous(self) -> None:
        """Block until the previous save has finished (its outcome is on its own futures)."""
        if self._last is not None:
            try:
                self._last.upload_completion.result(self.options.timeout)
            except SlipstreamError:
                pass
            except TimeoutError as exc:
                raise CheckpointError(
                    f"the previous save did not finish within {self.options.timeout} s"
                ) from exc

    def _make_plan(self, layout: LocalLayout, seq: int, where: str, deadline: Deadline) -> SavePlan:
        channel = self.channel
        fingerprint = layout.fingerprint()
        channel.post(f"{seq}/layout", {"fp": fingerprint, "desc": layout.describe()})
        msgs = channel.gather(
            f"{seq}/layout", deadline, "send their state dict layout for planning"
        )
        errors = [f"rank {r}: {m['error']}" for r, m in enumerate(msgs) if m.get("error")]
        if errors:
            raise CheckpointError(f"save to {where} failed; " + "; ".join(errors))
        plan = make_save_plan(channel.rank, [m["desc"] for m in msgs], [m["fp"] for m in msgs])
        self.plans_made += 1
        return plan

    def _buffer(self, job: _Job) -> torch.Tensor:
        if self._pool.allocations == 0:
            pin = self.options.pin_memory
            self._pool.pin = (job.device is not None) if pin is None else pin
        for stale in [k for k in self._framed if k != job.fingerprint]:
            self._pool.drop(stale)
            del self._framed[stale]
        try:
            buf = self._pool.acquire(job.fingerprint, job.plan.image_bytes)
        except StagingBudgetError as exc:
            raise StagingBudgetError(
                f"rank {self.rank} cannot stage {job.storage.url}: it needs "
                f"{job.plan.image_bytes} bytes, over SaveOptions.staging_budget_bytes="
                f"{self._pool.budget_bytes}"
            ) from exc
        if self._framed.get(job.fingerprint) != buf.data_ptr():
            _write_frames(buf, job.plan)
            self._framed[job.fingerprint] = buf.data_ptr()
        return buf

    def _stage(self, job: _Job) -> None:
        """Copy this rank's chunks into the staging buffer, front to back.

        On CPU the watermark advances after every record so the upload thread writes each
        part of the file as soon as it is staged; on an accelerator it advances once the
        side stream has finished.
        """
        try:
            buf = self._buffer(job)
            job.buffer = buf
            job.progress.advance(0)
            side = None
            if job.device is not None:
                side = self._side_streams.setdefault(job.device, streams.new_stream(job.device))
                streams.wait_event(side, job.ready_event)
            head, tail = job.plan.records, []
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
                wait_future(tail_copy, self.options.timeout, f"staging of {job.storage.url}")
            if side is not None:
                side.synchronize()
            job.layout = LocalLayout([], {}, {}, {})
            job.progress.advance(job.plan.image_bytes)
            job.response.timings.staged = job.elapsed()
            job.response.staging_completion.set_result(None)
        except BaseException as exc:
            job.progress.fail(exc)
            self._fail(job, exc)

    @staticmethod
    def _copy_records(job: _Job, records: list, side, advance: bool) -> None:
        """Copy ``records`` into the staging buffer; with ``advance``, move the watermark
        past each one as it lands (only for a run that starts at the head of the file)."""
        base = job.buffer.data_ptr()
        for rec in records:
            src = job.layout.tensors[rec.chunk.record_key]
            if src.numel() * src.element_size() != rec.nbytes:
                raise CheckpointError(
                    f"{rec.chunk.fqn!r} holds {src.numel() * src.element_size()} bytes, its "
                    f"record in the plan {rec.nbytes}: the state changed after save() returned"
                )
            on_host = src.device.type == "cpu"
            if not copy_to_address(base + rec.data_offset, src):
                dst = _data_view(job.buffer, rec.data_offset, rec.nbytes, rec.chunk)
                if on_host:
                    copy_in_slices(dst, src.detach())
                else:
                    dst.copy_(src.detach(), non_blocking=True)
            if on_host and advance and side is None:
                job.progress.advance(rec.offset + rec.length)

    def _upload(self, job: _Job) -> None:
        try:
            self._upload_and_commit(job)
        except BaseException as exc:
            self._pool.release(job.fingerprint)
            self._fail(job, exc)
        else:
            self._pool.release(job.fingerprint)
            timings = job.response.timings
            timings.durable = job.elapsed()
            logger.info(
                "rank %d saved %s: %.3f GiB, caller blocked %.1f ms, staged in %.3f s, "
                "durable in %.3f s",
                self.rank,
                job.storage.url,
                timings.nbytes / 2**30,
                1000 * (timings.blocked or 0.0),
                timings.staged or 0.0,
                timings.durable,
            )
            job.response.upload_completion.set_result(None)

    def _upload_and_commit(self, job: _Job) -> None:
        """Write this rank's file, report to rank 0, and wait for its commit decision.

        A rank that fails before writing (staging included) still reports, so rank 0
        fails the save at once instead of waiting for it until the timeout; when rank 0
        itself fails it still runs the commit step, which posts the failure to every rank.
        """
        try:
            self._choose_generation(job)
            done = self._write_rank_file(job)
        except BaseException as exc:
            self.channel.post(f"{job.seq}/done", {"fp": job.fingerprint, "error": str(exc)})
            if self.rank == 0:
                self._commit(job, Deadline(self.options.timeout))
            raise
        try:
            self._report_and_await_commit(job, done)
        except BaseException:
            self._discard_written(job)
            raise

    def _choose_generation(self, job: _Job) -> None:
        """Name this save's files so that none is a file of the checkpoint committed here
        (every rank reads the same ``.metadata``, so every rank picks the same names)."""
        data = job.storage.get(METADATA_FILE)
        if data is None:
            return
        committed = load_metadata(data, f"{job.storage.url}/{METADATA_FILE}")
        job.replaced = files_of(committed)
        job.replaced_index = index_file(generation_of(committed))
        plan_files = [data_file_name(r) for r in range(job.plan.world_size)]
        job.generation = free_generation(job.replaced, plan_files)

    def _discard_written(self, job: _Job) -> None:
        """After a failed commit: remove this rank's data file (and rank 0 the index), which
        no committed checkpoint points to, so a failed save gives its space back at once."""
        names = [job.file] + ([index_file(job.generation)] if self.rank == 0 else [])
        for name in names:
            if name in job.replaced or name == job.replaced_index:
                continue
            try:
                job.storage.delete(name)
            except (OSError, SlipstreamError) as exc:
                logger.warning(
                    "could not remove %s/%s of a failed save: %s", job.storage.url, name, exc
                )

    def _report_and_await_commit(self, job: _Job, done: dict) -> None:
        """Post this rank's write report; rank 0 commits; every rank awaits the outcome."""
        self.channel.post(f"{job.seq}/done", done)
        deadline = Deadline(self.options.timeout)
        if self.rank == 0:
            self._commit(job, deadline)
        outcome = self.channel.receive(
            f"{job.seq}/commit", 0, deadline, f"commit checkpoint {job.storage.url}"
        )
        if outcome.get("error"):
            if outcome.get("dead"):
                raise PeerDiedError(outcome["error"])
            raise (PeerTimeoutError if outcome["timeout"] else CheckpointError)(outcome["error"])

    def _write_piece(self, job: _Job, out: DataWriter, start: int, end: int) -> None:
        job.progress.wait_for(end, self.options.timeout, f"staging of {out.path}")
        out.write(start, end)

    def _write_rank_file(self, job: _Job) -> dict:
        """Write the staged image as it fills, then the values; make it durable; return the
        report. A failure aborts the writer, removing what it wrote.

        Checksums are taken once staging is complete, so that they never compete with the
        staging copy (the phase the training loop may be waiting on) for a core.
        """
        plan = job.plan
        where = f"{job.storage.url}/{job.file}"
        job.progress.wait_for(0, self.options.timeout, f"a staging buffer for {where}")
        image = byte_view(job.buffer)
        with job.storage.open_writer(job.file, image) as out:
            try:
                writes = [
                    self._io_pool.submit(self._write_piece, job, out, start, end)
                    for start, end in out.pieces(WRITE_PIECE_BYTES)
                ]
                try:
                    job.progress.wait_for(len(image), self.options.timeout, f"staging of {where}")
                    records = {
                        rec.chunk.record_key: block_checksums(
                            image[rec.data_offset : rec.data_offset + rec.nbytes]
                        )
                        for rec in plan.records
                    }
                    values = self._append_values(job, out, len(image))
                finally:
                    _join_writes(writes, self.options.timeout, where)
                out.finish()
            except BaseException:
                out.abort()
                raise
        return {"fp": job.fingerprint, "records": records, "values": values, "error": None}

    @staticmethod
    def _append_values(job: _Job, out: DataWriter, cursor: int) -> dict[str, list]:
        """Write this rank's plain values after its tensor records; return their index."""
        values = {}
        for fqn in job.plan.my_values():
            data = job.values[fqn]
            out.append(memoryview(data), cursor)
            values[fqn] = [job.file, cursor, len(data), checksum(data)]
            cursor += len(data)
        return values

    def _commit(self, job: _Job, deadline: Deadline) -> None:
        channel = self.channel
        topic = f"{job.seq}/done"
        try:
            done = channel.gather(topic, deadline, f"finish writing {job.storage.url}")
            errors = [f"rank {r}: {m['error']}" for r, m in enumerate(done) if m.get("error")]
            if errors:
                raise CheckpointError(f"save to {job.storage.url} failed; " + "; ".join(errors))
            changed = [r for r, m in enumerate(done) if m["fp"] != job.plan.fingerprints[r]]
            if changed:
                raise CheckpointError(
                    f"rank(s) {changed} saved a state dict whose layout differs from the plan "
                    "made for this layout on rank 0; every rank must change layout together"
                )
            template = job.templates.get(job.generation)
            if template is None:
                template = job.templates[job.generation] = CommitTemplate.for_plan(
                    job.plan, job.generation
                )
            metadata = build_metadata(template, done, job.storage.url)
            publish(
                job.storage, metadata, build_index(job.plan, done, job.generation), job.generation
            )
            outcome: dict = {"error": None}
            self._after_publish(job, files_of(metadata))
        except BaseException as exc:
            outcome = {
                "error": str(exc),
                "timeout": isinstance(exc, PeerTimeoutError),
                "dead": isinstance(exc, PeerDiedError),
            }
        channel.post(f"{job.seq}/commit", outcome)
        channel.forget(topic)
        if job.seq > 0:
            channel.forget(f"{job.seq - 1}/commit", [0])
            channel.forget(f"{job.seq - 1}/layout")

    def _after_publish(self, job: _Job, kept: set[str]) -> None:
        """Once committed, a save succeeds whatever happens next: deleting the files of the
        checkpoint it replaced, and ``after_commit`` (retention), fail only into the log."""
        self._delete_replaced(job, kept)
        if job.after_commit is not None:
            try:
                job.after_commit()
            except Exception as exc:
                logger.warning("after the commit of %s: %s", job.storage.url, exc)

    @staticmethod
    def _delete_replaced(job: _Job, kept: set[str]) -> None:
        """Delete the files of the checkpoint this commit replaced (best effort: a file left
        behind is unreferenced, never read)."""
        stale = sorted(job.replaced - kept)
        if job.replaced_index is not None and job.replaced_index != index_file(job.generation):
            stale.append(job.replaced_index)
        for name in stale:
            try:
                job.storage.delete(name)
            except (OSError, SlipstreamError) as exc:
                logger.warning("could not delete replaced %s/%s: %s", job.storage.url, name, exc)

    @staticmethod
    def _fail(job: _Job, exc: BaseException) -> None:
        if not isinstance(exc, SlipstreamError):
            exc = CheckpointError(f"save to {job.storage.url} failed: {exc!r}")
        fail_unfinished(exc, job.response.staging_completion, job.response.upload_completion)

    def close(self) -> None:
        """Wait for the save in flight, then join every thread this saver owns."""
        if self._closed:
            return
        self._closed = True
        self._stage_thread.shutdown(wait=True)
        self._tail_copier.shutdown(wait=True)
        self._upload_thread.shutdown(wait=True)
        self._io_pool.shutdown(wait=True)
        self._pool.clear()
        self.channel.close()


def _join_writes(writes: list[Future], timeout: float, path: str) -> None:
    """Wait for every write of a file, then raise the first failure.

    Waiting for all of them, failed or not, is what keeps a write from running after its
    file descriptor is closed (and its number possibly reused by another file).
    """
    _, pending = futures_wait(writes, timeout)
    if pending:
        raise PeerTimeoutError(f"writes to {path} did not finish within {timeout} s")
    for w in writes:
        w.result()


def _split_by_bytes(records: list) -> tuple[list, list]:
    """Records cut in two runs of about equal bytes, in file order."""
    half = sum(rec.nbytes for rec in records) / 2
    copied = 0
    for i, rec in enumerate(records):
        if copied >= half:
            return records[:i], records[i:]
        copied += rec.nbytes
    return records, []


def _accelerator_of(layout: LocalLayout) -> torch.device | None:
    devices = {t.device for t in layout.tensors.values()}
    return next((d for d in devices if streams.is_accelerator(d)), None)


def _data_view(buf: torch.Tensor, offset: int, nbytes: int, chunk) -> torch.Tensor:
    return buf[offset : offset + nbytes].view(dtype_from_name(chunk.dtype)).view(chunk.sizes)


def _write_frames(buf: torch.Tensor, plan: SavePlan) -> None:
    """Put every record's constant zip bytes in place around its (still empty) data."""
    from .records import tensor_frame

    image = byte_view(buf)
    for rec in plan.records:
        frame = tensor_frame(dtype_from_name(rec.chunk.dtype), rec.chunk.sizes)
        image[rec.offset : rec.offset + len(frame.prefix)] = frame.prefix
        end = rec.data_offset + rec.nbytes
        image[end : end + len(frame.suffix)] = frame.suffix
