"""The saver: the conductor of a save's stages, for one process group.

One save, stage by stage (each on a thread this object owns and joins in ``close``):

1. caller's thread (here): flatten the state dict, serialize plain values (so later
   mutation cannot change them, and a bad value fails here, naming its key; a value equal
   to the previous save's reuses its bytes), look up the plan for this layout (planning,
   through the store, only on a layout's first save), record an event on the
   accelerator's current stream; with a device snapshot (:mod:`.device_snapshot`, on
   accelerators by default), gather the tensors into it in a few copy calls on that stream
   and resolve ``staging_completion``; return.
2. staging thread (:mod:`.staging`): fill this rank's staging buffer, the head of its data
   file: drain the device snapshot into it, or copy every tensor chunk this rank writes
   from the state and then resolve ``staging_completion``: the caller may mutate the state.
3. upload thread: pick file names no committed checkpoint here uses (:mod:`..format.names`:
   an older checkpoint stays loadable until this one commits); write the image as it is
   staged, checksums and plain values (:mod:`.writer`, through the storage backend of
   :mod:`..storage`); post the result; rank 0 gathers every rank's result and commits
   (:mod:`.commit`: metadata last, atomically); every rank waits for that commit (its
   peers' liveness watched, :mod:`.channel`), then ``upload_completion`` resolves; the
   older checkpoint's files are deleted after the commit. A save that fails removes what
   it wrote at once (a rank's aborted write, its file once the commit fails).

Backpressure: one save in flight; a new save first waits for the previous one to finish
(its staging buffer is about to be reused). Host memory: one staging buffer, for the
layout being saved (a layout change frees the old one). Nothing here touches the user's
process group.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ...core import streams, tracing
from ...core.handles import fail_unfinished
from ...core.threads import lower_thread_priority
from ...core.waits import Deadline
from ...errors import CheckpointError, PeerDiedError, PeerTimeoutError, SlipstreamError
from ..format.names import (
    METADATA_FILE,
    data_file_name,
    files_of,
    free_generation,
    generation_of,
    index_file,
)
from ..format.safe_pickle import load_metadata
from ..storage import Location, Storage, resolve_storage
from .channel import RankChannel
from .commit import CommitTemplate, build_index, build_metadata, publish
from .job import AsyncSaveResponse, SaveJob
from .layout import LayoutSignature, LocalLayout, ValueSerializer, local_layout
from .messages import (
    CommitOutcome,
    LayoutDescription,
    LayoutReport,
    PlanView,
    Topics,
    WriteReport,
)
from .options import SaveOptions
from .plan import SavePlan, make_save_plan, plan_from_view
from .snapshot import StagedState
from .staging import Stager
from .writer import RankWriter

logger = logging.getLogger(__name__)

MAX_CACHED_PLANS = 8
"""Layouts whose plan this process keeps, per group and store."""

PlanKey = tuple[tuple[int, ...], LayoutSignature]
_plans: weakref.WeakKeyDictionary[
    dist.Store, dict[PlanKey, tuple[SavePlan, dict[int, CommitTemplate]]]
]
_plans = weakref.WeakKeyDictionary()
"""The plans this process made, by store (a process group made anew, with a store of its
own, plans again; a store gone takes its plans with it), then by group and layout."""
_plans_lock = threading.Lock()


def cached_plan(
    channel: RankChannel, signature: LayoutSignature
) -> tuple[SavePlan, dict[int, CommitTemplate]] | None:
    """The plan this process made for ``signature`` in ``channel``'s group on its store, by
    any saver (a new ``Checkpointer`` beside ``ss.async_save`` plans nothing again)."""
    with _plans_lock:
        return _plans.get(channel.store, {}).get((tuple(channel.global_ranks), signature))


def _keep_plan(
    channel: RankChannel, signature: LayoutSignature, plan: SavePlan
) -> tuple[SavePlan, dict[int, CommitTemplate]]:
    group = tuple(channel.global_ranks)
    with _plans_lock:
        kept = _plans.setdefault(channel.store, {})
        mine = [k for k in kept if k[0] == group]
        if len(mine) >= MAX_CACHED_PLANS:
            del kept[mine[0]]
        found = kept[(group, signature)] = (plan, {})
        return found


def exchange_plan(
    channel: RankChannel, layout: LocalLayout, seq: int, where: str, deadline: Deadline
) -> SavePlan:
    """The plan of a layout's first save, made once, by rank 0: every rank posts its
    layout, rank 0 gathers them, plans, and posts each rank its part of the plan
    (:class:`PlanView`), which is all a rank other than 0 waits for and reads. A rank's
    error (or rank 0's, planning) fails the save on every rank, naming it."""
    whole: list[SavePlan] = []

    def decide(reports: list[LayoutReport]) -> list[str]:
        errors = [f"rank {r}: {m.error}" for r, m in enumerate(reports) if m.error]
        if errors:
            raise CheckpointError(f"save to {where} failed; " + "; ".join(errors))
        descriptions = [m.description for m in reports if m.description is not None]
        fingerprints = [m.fingerprint for m in reports if m.fingerprint is not None]
        plan = make_save_plan(0, descriptions, fingerprints)
        whole.append(plan)
        return [plan.view_of(r).to_json() for r in range(plan.world_size)]

    text = channel.exchange(
        Topics.layout(seq),
        LayoutReport(layout.fingerprint(), LayoutDescription.of(layout)),
        LayoutReport.from_json,
        decide,
        deadline,
        "send their state dict layout for planning",
        per_rank=True,
    )
    if channel.rank == 0:
        return whole[0]
    return plan_from_view(channel.rank, PlanView.from_json(text, f"rank 0's plan for {where}"))


class CheckpointSaver:
    """Owns the threads, staging buffers and cached plans of saves for one process group."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        options: SaveOptions | None = None,
        *,
        no_dist: bool = False,
    ) -> None:
        """``no_dist``: save as a job of one rank, whatever process group exists (DCP's
        ``no_dist``); each process then writes a whole checkpoint of its own."""
        self.options = options or SaveOptions()
        self.channel = RankChannel.local() if no_dist else RankChannel.for_group(process_group)
        priority = (self.options.thread_nice, self.options.idle_threads)
        self._stage_thread = ThreadPoolExecutor(
            1, "slipstream-stage", initializer=lower_thread_priority, initargs=priority
        )
        self._upload_thread = ThreadPoolExecutor(
            1, "slipstream-upload", initializer=lower_thread_priority, initargs=priority
        )
        self._stager = Stager(self.channel.rank, self.options, priority)
        self._writer = RankWriter(self.options, priority)
        self._serialize_values = ValueSerializer()
        self._seq = 0
        self._last: AsyncSaveResponse | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.plans_made = 0
        self.before_staging: Callable[[], None] | None = None
        """Called on the staging thread as each save's staging begins, before any byte is
        copied into the host staging buffer (instrumentation, and tests that hold staging to
        order events): with a device snapshot, after the call gathered the state into it and
        before the drain; otherwise before any tensor byte is copied. It may block, which
        holds that save's staging (and its writes) until it returns; an exception it raises
        fails the save (and with a device snapshot, releases it)."""

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def staging_allocations(self) -> int:
        """Staging buffers allocated so far: a save of a layout already staged reuses its
        buffer, so only a new layout allocates."""
        return self._stager.pool.allocations

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging buffers this saver holds (none for the saves of a
        snapshot written as it is, see :func:`~.snapshot.stage`)."""
        return self._stager.pool.live_bytes

    @property
    def staging_peak_bytes(self) -> int:
        """The most host bytes the staging buffers have held at once (at most
        ``SaveOptions.staging_budget_bytes``, where one is set)."""
        return self._stager.pool.peak_bytes

    @property
    def snapshot_allocations(self) -> int:
        """Device snapshot buffers allocated so far (see ``SaveOptions.device_snapshot``): a
        save of a layout already snapshotted reuses its buffer."""
        return self._stager.snapshots.allocations

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the device snapshot buffers this saver holds (on the state's device)."""
        return self._stager.snapshots.live_bytes

    @property
    def staging_pinned(self) -> bool | None:
        """Whether the staging buffers this saver holds are pinned (``None`` before any)."""
        return self._stager.pool.all_pinned

    def save(
        self,
        state_dict: Mapping[str, Any],
        checkpoint_id: Location,
        after_commit: Callable[[], None] | None = None,
        storage_options: dict[str, Any] | None = None,
        storage_meta: StorageMeta | None = None,
        timeout: float | None = None,
    ) -> AsyncSaveResponse:
        """Start a save; returns once the work is queued (see the module docstring).

        ``after_commit`` runs on rank 0's upload thread once the save has committed and
        before the commit is announced, so no rank's ``upload_completion`` resolves before
        it has run (used for retention: every rank then sees the same steps).
        ``checkpoint_id`` is a path, a URL or a :class:`Storage` (see :mod:`..storage`);
        ``storage_options`` configure an object store's client. ``storage_meta`` (rank
        0's counts) is what the committed ``Metadata`` records as its ``storage_meta``, as
        DCP records its writer's; without it, a new ``save_id`` and the location's URL.
        ``timeout`` bounds this save's waits (``None``: ``options.timeout``); it never
        changes another save's.

        A save racing :meth:`close` either is queued before the close begins (which then
        waits for it) or fails, telling the other ranks, once it has taken its number.
        """
        if self._closed:
            raise CheckpointError("this saver is closed")
        timeout = self.options.timeout if timeout is None else timeout
        started = time.perf_counter()
        with tracing.span("slipstream.save.wait_previous"):
            self.wait_previous(timeout)
        dead = self.channel.known_dead()
        if dead:
            rank, why = min(dead.items())
            raise PeerDiedError(
                f"rank {rank} is dead ({why}); saves fail at once until the job rebuilds its "
                "process group"
            )
        # Every rank numbers this save before anything can fail on its own thread, so a
        # save that fails on one rank only leaves the ranks' sequence numbers in step.
        with self._lock:
            if self._closed:
                raise CheckpointError("this saver is closed")
            seq = self._seq
            self._seq += 1
        try:
            storage = resolve_storage(
                checkpoint_id, storage_options, direct_io=self.options.direct_io
            )
            with tracing.span("slipstream.save.prepare", url=storage.url):
                layout, values, plan, templates = self._prepare(state_dict, seq, storage, timeout)
            snapshot = state_dict if isinstance(state_dict, StagedState) else None
            hold = snapshot.hold(f"save to {storage.url}") if snapshot is not None else None
        except BaseException as exc:
            self._announce_failure(seq, exc)
            raise
        fingerprint = plan.fingerprints[plan.rank]
        devices = {t.device for t in layout.tensors.values()}
        device = next((d for d in devices if streams.is_accelerator(d)), None)
        ready = streams.record_event(streams.current_stream(device)) if device else None
        response = AsyncSaveResponse(Future(), Future())
        job = SaveJob(
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
            timeout=timeout,
            started=started,
            snapshot=snapshot,
            snapshot_hold=hold,
            storage_meta=storage_meta,
        )
        response.timings.nbytes = plan.data_bytes
        with self._lock:
            if self._closed:
                error = CheckpointError(f"this saver was closed before its save to {storage.url}")
                if hold is not None and snapshot is not None:
                    snapshot.release(hold)
                self._announce_failure(seq, error)
                raise error
            self._queue(job, snapshot, devices)
        self._last = response
        response.timings.blocked = job.elapsed()
        return response

    def _queue(
        self, job: SaveJob, snapshot: StagedState | None, devices: set[torch.device]
    ) -> None:
        """Hand ``job`` to the staging and upload threads (under ``_lock``, so never to
        threads a :meth:`close` has begun to shut down)."""
        if snapshot is not None and snapshot.image_matches(job.plan):
            job.holders = 1  # nothing to copy: staged before save returns
            self._stager.stage_snapshot(job)
            job.staging_ended.set()
        else:
            if snapshot is None:
                self._gather(job, devices)
            self._stage_thread.submit(self._stage, job)
        self._upload_thread.submit(self._upload, job)

    def _gather(self, job: SaveJob, devices: set[torch.device]) -> None:
        """Take ``job``'s device snapshot, if it has one (:mod:`.device_snapshot`), and
        resolve ``staging_completion`` at once; a failure fails the save here, and every
        other rank's with it."""
        try:
            gathered = self._stager.gather(job, devices)
        except BaseException as exc:
            self._announce_failure(job.seq, exc)
            raise
        if gathered:
            job.layout = LocalLayout([], {}, {}, {})
            job.response.timings.staged = job.elapsed()
            job.response.staging_completion.set_result(None)

    def _prepare(
        self, state_dict: Mapping[str, Any], seq: int, storage: Storage, timeout: float
    ) -> tuple[LocalLayout, dict[str, bytes], SavePlan, dict[int, CommitTemplate]]:
        """The caller's-thread part of save ``seq``: layout, serialized values, and the plan
        (made only for a new layout) with its commit templates. No storage request runs
        here: the location is prepared on the upload thread."""
        if isinstance(state_dict, StagedState) and not state_dict.path:
            layout = state_dict.layout
        else:
            layout = local_layout(state_dict)
        values = self._serialize_values(layout.values)
        signature = layout.signature
        cached = cached_plan(self.channel, signature)
        if cached is None:
            plan = exchange_plan(self.channel, layout, seq, storage.url, Deadline(timeout))
            self.plans_made += 1
            cached = _keep_plan(self.channel, signature, plan)
        plan, templates = cached
        return layout, values, plan, templates

    def _announce_failure(self, seq: int, exc: BaseException) -> None:
        """Tell the other ranks that this rank's part of save ``seq`` failed before it was
        queued, so that they fail at once naming this rank instead of waiting for it until
        their timeout: rank 0 planning reads it as this rank's layout, and as its write
        report; when this is rank 0, every rank reads it as the plan's verdict (for a save
        that plans) and as the commit's outcome."""
        error = f"{type(exc).__name__}: {exc}"
        self.channel.post(Topics.written(seq), WriteReport(None, error=error))
        if self.rank == 0:
            failed = CheckpointError(f"save failed; rank 0: {error}")
            self.channel.fail_exchange(Topics.layout(seq), failed)
            self.channel.post(Topics.commit(seq), CommitOutcome(f"rank 0: {error}"))
        else:
            self.channel.post(Topics.layout(seq), LayoutReport(error=error))

    def wait_previous(self, timeout: float | None = None) -> None:
        """Block until the previous save has finished (its outcome is on its own futures),
        at most ``timeout`` seconds (``None``: ``options.timeout``)."""
        timeout = self.options.timeout if timeout is None else timeout
        if self._last is not None:
            try:
                self._last.upload_completion.result(timeout)
            except SlipstreamError:
                pass
            except TimeoutError as exc:
                raise CheckpointError(
                    f"the previous save did not finish within {timeout} s"
                ) from exc

    def _stage(self, job: SaveJob) -> None:
        """Stage ``job``; a failure fails ``staging_completion`` only: the upload thread
        sees it through the watermark and fails ``upload_completion`` once it has let go
        of everything the save holds."""
        try:
            with tracing.span("slipstream.save.stage", url=job.storage.url):
                if self.before_staging is not None:
                    try:
                        self.before_staging()
                    except BaseException as exc:
                        job.progress.fail(exc)
                        raise
                self._stager.stage(job)
        except BaseException as exc:
            fail_unfinished(_save_error(job, exc), job.response.staging_completion)
        finally:
            self._let_go(job)
            job.staging_ended.set()

    def _upload(self, job: SaveJob) -> None:
        """Write and commit ``job``. Whatever the outcome, the save lets go of its staging
        buffer (once staging has ended too) before ``upload_completion`` resolves, so the
        caller's next save finds everything free."""
        try:
            self._upload_and_commit(job)
        except BaseException as exc:
            job.abandoned = exc
            if job.ring is not None:  # a streaming stager waits for slots this frees
                job.ring.fail(exc)
            if not job.staging_ended.wait(job.timeout):
                logger.warning(
                    "staging of the failed save to %s did not end within %s s; its buffer is "
                    "released when it does",
                    job.storage.url,
                    job.timeout,
                )
            self._let_go(job)
            self._fail(job, exc)
        else:
            self._let_go(job)
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

    def _upload_and_commit(self, job: SaveJob) -> None:
        """Write this rank's file, report to rank 0, and wait for its commit decision.

        A rank that fails before writing (staging included) still reports, so rank 0
        fails the save at once instead of waiting for it until the timeout; when rank 0
        itself fails it still runs the commit step, which posts the failure to every rank.
        """
        try:
            job.storage.prepare()
            self._choose_generation(job)
            with tracing.span("slipstream.save.write", url=job.storage.url):
                done = self._writer.write(job)
        except BaseException as exc:
            self.channel.post(Topics.written(job.seq), WriteReport(job.fingerprint, error=str(exc)))
            if self.rank == 0:
                self._commit(job, Deadline(job.timeout))
            raise
        try:
            self._report_and_await_commit(job, done)
        except BaseException:
            self._discard_written(job)
            raise

    def _choose_generation(self, job: SaveJob) -> None:
        """Name this save's files so that none is a file of the checkpoint committed here
        (every rank reads the same ``.metadata``, so every rank picks the same names)."""
        committed = _committed(job.storage)
        if committed is None:
            return
        job.replaced = files_of(committed)
        job.replaced_index = index_file(generation_of(committed))
        plan_files = [data_file_name(r) for r in range(job.plan.world_size)]
        job.generation = free_generation(job.replaced, plan_files)

    def _discard_written(self, job: SaveJob) -> None:
        """After a failed save: remove this rank's data file (and rank 0 the index), unless a
        committed ``.metadata`` here points to it. A rank that could not hear the commit's
        outcome (rank 0 died after publishing, the store gone with it) must not take a
        committed checkpoint's file away; when in doubt, the file stays (unreferenced, it is
        written over or cleaned up by a later save)."""
        try:
            committed = _committed(job.storage)
            if committed is not None and job.file in files_of(committed):
                return
        except (OSError, SlipstreamError) as exc:
            logger.warning("kept %s/%s of a failed save: %s", job.storage.url, job.file, exc)
            return
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

    def _report_and_await_commit(self, job: SaveJob, done: WriteReport) -> None:
        """Post this rank's write report; rank 0 commits; every rank awaits the outcome."""
        self.channel.post(Topics.written(job.seq), done)
        deadline = Deadline(job.timeout)
        with tracing.span("slipstream.save.commit", url=job.storage.url):
            if self.rank == 0:
                self._commit(job, deadline)
            outcome = self.channel.receive(
                Topics.commit(job.seq),
                CommitOutcome.from_json,
                0,
                deadline,
                f"commit checkpoint {job.storage.url}",
            )
        self.channel.forget(Topics.written(job.seq), [self.rank])  # rank 0 has read it
        if outcome.error is not None:
            if outcome.dead:
                raise PeerDiedError(outcome.error)
            raise (PeerTimeoutError if outcome.timeout else CheckpointError)(outcome.error)
        committed = job.committed
        if committed is not None:
            job.response.committed_as(lambda: committed)
        else:
            assert outcome.save_id is not None, "CommitOutcome.from_json: a success has one"
            job.response.committed_as(_CommittedMetadata(job.storage, outcome.save_id))

    def _commit(self, job: SaveJob, deadline: Deadline) -> None:
        channel = self.channel
        topic = Topics.written(job.seq)
        try:
            done = channel.gather(
                topic, WriteReport.from_json, deadline, f"finish writing {job.storage.url}"
            )
            errors = [f"rank {r}: {m.error}" for r, m in enumerate(done) if m.error]
            if errors:
                raise CheckpointError(f"save to {job.storage.url} failed; " + "; ".join(errors))
            changed = [r for r, m in enumerate(done) if m.fingerprint != job.plan.fingerprints[r]]
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
            metadata = build_metadata(template, done, job.storage.url, job.storage_meta)
            publish(
                job.storage, metadata, build_index(job.plan, done, job.generation), job.generation
            )
            assert metadata.storage_meta is not None, "build_metadata sets storage_meta"
            job.committed = metadata
            outcome = CommitOutcome(save_id=metadata.storage_meta.save_id)
            self._after_publish(job, files_of(metadata))
        except BaseException as exc:
            outcome = CommitOutcome(
                str(exc),
                timeout=isinstance(exc, PeerTimeoutError),
                dead=isinstance(exc, PeerDiedError),
            )
        channel.post(Topics.commit(job.seq), outcome)
        if job.seq > 0:
            channel.forget(Topics.commit(job.seq - 1), [0])

    def _after_publish(self, job: SaveJob, kept: set[str]) -> None:
        """Once committed, a save succeeds whatever happens next: deleting the files of the
        checkpoint it replaced, and ``after_commit`` (retention), fail only into the log."""
        self._delete_replaced(job, kept)
        if job.after_commit is not None:
            try:
                job.after_commit()
            except Exception as exc:
                logger.warning("after the commit of %s: %s", job.storage.url, exc)

    @staticmethod
    def _delete_replaced(job: SaveJob, kept: set[str]) -> None:
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

    def _let_go(self, job: SaveJob) -> None:
        """One stage of ``job`` is done with its staging buffer; the last one releases it."""
        with job.holders_lock:
            job.holders -= 1
            last = job.holders == 0
        if last:
            self._stager.release(job)

    @staticmethod
    def _fail(job: SaveJob, exc: BaseException) -> None:
        error = _save_error(job, exc)
        fail_unfinished(error, job.response.staging_completion, job.response.upload_completion)

    def close(self) -> None:
        """Wait for the save in flight, then join every thread this saver owns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stage_thread.shutdown(wait=True)
        self._upload_thread.shutdown(wait=True)
        self._stager.close()
        self._writer.close()
        self.channel.close()


def _save_error(job: SaveJob, exc: BaseException) -> BaseException:
    """``exc`` as the save's error: slipstream's own errors as they are, others wrapped."""
    if isinstance(exc, SlipstreamError):
        return exc
    return CheckpointError(f"save to {job.storage.url} failed: {exc!r}")


def _committed(storage: Storage) -> Metadata | None:
    """The metadata of the checkpoint committed at ``storage``, if there is one."""
    data = storage.get(METADATA_FILE)
    return None if data is None else load_metadata(data, f"{storage.url}/{METADATA_FILE}")


class _CommittedMetadata:
    """Reads back, once, the ``.metadata`` a save committed (on the ranks other than 0,
    which did not build it); fails if a later save has replaced it meanwhile."""

    def __init__(self, storage: Storage, save_id: str) -> None:
        self._storage, self._save_id = storage, save_id
        self._metadata: Metadata | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Metadata:
        with self._lock:
            if self._metadata is None:
                metadata = _committed(self._storage)
                found = metadata.storage_meta if metadata is not None else None
                if metadata is None or found is None or found.save_id != self._save_id:
                    raise CheckpointError(
                        f"{self._storage.url}: the checkpoint this save committed was "
                        "replaced or deleted before its metadata was read"
                    )
                self._metadata = metadata
            return self._metadata
