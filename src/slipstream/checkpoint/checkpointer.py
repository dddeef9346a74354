"""A training run's checkpoints: one location per step, retention, latest, resume.

Works the same on every storage backend (a directory, an object store prefix).

Invariants: a step is listed by :meth:`Checkpointer.steps` only once committed (its
``.metadata`` exists), so :meth:`latest` never names a checkpoint that was cut short, and
:meth:`load` of such a step raises, naming the newest complete one; old steps are deleted
only after a newer one has committed; steps that never committed, temporary files of a
commit cut short, and multipart uploads cut short, are removed by the next save (never
while a save into them may be running: a reader in another process never deletes what a
writer is writing); with a local tier, each node's uncommitted local steps are removed
when the job's ``Checkpointer`` starts, before any rank can write one. With
``reuse_files`` on the local disk the data files of a deleted
step are kept aside, under invariants of their own (see :mod:`.storage.recycle`), for the next
save to write over, and :meth:`Checkpointer.close` deletes what is left of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ..core.control_plane import ranks_text
from ..core.handles import all_of, completed_future
from ..core.waits import Deadline
from ..errors import CheckpointError, SlipstreamError
from . import collective_load
from .agreement import LoadAgreement, agreement_for
from .format.names import METADATA_FILE, SPARE_DIR, is_temporary, step_dir, step_dirs
from .format.safe_types import Trusted
from .health import CheckpointHealth, HealthTracker
from .load import loader
from .save.commit import uncommit
from .save.job import AsyncSaveResponse
from .save.messages import SkipDecision, Topics
from .save.options import SaveOptions
from .save.saver import CheckpointSaver
from .storage import LocalStorage, Location, Storage, resolve_storage
from .tier.local_tier import MARKER_FILE, LocalTierSaver
from .tier.options import LocalTier

logger = logging.getLogger(__name__)


class Checkpointer:
    """Asynchronous, atomic, retained checkpoints of a training run under ``root``."""

    def __init__(
        self,
        root: Location,
        keep_last: int | None = 3,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        options: SaveOptions | None = None,
        reuse_files: bool = True,
        storage_options: dict[str, Any] | None = None,
        on_error: Literal["log", "raise"] = "log",
        when_busy: Literal["wait", "skip"] = "wait",
        max_lag_steps: int | None = None,
        local_tier: LocalTier | None = None,
        durable_every: int = 1,
    ) -> None:
        """``root`` is a directory, an object store URL (``s3://bucket/run``, ``memory://``)
        or a :class:`~slipstream.checkpoint.storage.Storage`; ``storage_options`` configure
        an object store's client (see docs/storage.md).

        ``reuse_files``: on the local disk, the next save writes over the data files of the
        step retention deletes, where nothing else has them open, instead of freeing their
        blocks and allocating new ones (see docs/save-cost.md). Between saves one step's
        data files more stay on disk, in ``root/.spare``, until :meth:`close`.

        ``timeout``, when given, overrides ``options.timeout``; every default is
        :class:`SaveOptions`'s.

        Failures (see docs/checkpoint.md, "Failures"): with ``on_error="log"`` a save that
        fails never raises into the training loop: its error is on its futures, in the log
        and in :meth:`health`, and the next save retries. ``on_error="raise"`` makes
        :meth:`save` raise a failure of its own call, and of the previous save.

        ``when_busy``: what :meth:`save` does while the previous save is still running:
        ``"wait"`` for it, or ``"skip"`` this step (logged, counted in :meth:`health`);
        with ``max_lag_steps``, a save that would leave durability more than that many
        steps behind waits instead of skipping. Rank 0 decides, so every rank skips the
        same steps.

        ``local_tier`` adds a second, fast tier (see docs/two-tiers.md):
        every ``local_tier.every``-th step is saved into node-local storage and replicated
        to peer ranks on other nodes, while only every ``durable_every``-th step also goes
        to ``root``; :meth:`latest` and :meth:`load` then take the newest step either tier
        can serve, all ranks calling them together. ``keep_last`` is the durable tier's
        retention, ``local_tier.keep_last`` the local tier's."""
        if durable_every < 1:
            raise ValueError(f"durable_every must be >= 1, got {durable_every}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if on_error not in ("log", "raise"):
            raise ValueError(f"on_error must be 'log' or 'raise', got {on_error!r}")
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        if max_lag_steps is not None and max_lag_steps < 0:
            raise ValueError(f"max_lag_steps must be >= 0 or None, got {max_lag_steps}")
        self.on_error = on_error
        self.when_busy = when_busy
        self.max_lag_steps = max_lag_steps
        self.keep_last = keep_last
        opts = dataclasses.replace(options or SaveOptions())
        if timeout is not None:
            opts.timeout = timeout
        self.storage: Storage = resolve_storage(
            root,
            storage_options,
            spare_dir_name=SPARE_DIR if reuse_files else None,
            direct_io=opts.direct_io,
        )
        self.root = self.storage.url
        self.storage.prepare()
        self._saver = CheckpointSaver(process_group, opts)
        self._last: AsyncSaveResponse | None = None
        self._saved = False
        self._health = HealthTracker(self.root)
        self._skip_topics: list[tuple[int, str]] = []
        self._saved_step: int | None = None
        self.durable_every = durable_every
        self.local_tier: LocalTierSaver | None = None
        if local_tier is not None:
            self.local_tier = LocalTierSaver(local_tier, self.root, process_group, opts)
            self._sweep_local_tier()
        self.last_load_tier: Literal["local", "durable"] | None = None
        """Which tier served the last :meth:`load`."""

    def path(self, step: int) -> str:
        """Where ``step`` is saved (a path or URL)."""
        return self._step(step).url

    def _step(self, step: int) -> Storage:
        return self.storage.child(step_dir(step))

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(
            s
            for s, name in step_dirs(self.storage.list_children()).items()
            if self.storage.child(name).exists(METADATA_FILE)
        )

    def latest(self) -> int | None:
        """The newest step the job can load: committed in the durable tier, or (with a
        local tier, every rank calling together) rebuildable from the nodes' local tiers."""
        if self.local_tier is None:
            steps = self.steps()
            return steps[-1] if steps else None
        local = max(self.local_tier.rebuildable(), default=None)
        durable = max(self._durable_steps(), default=None)
        return max((s for s in (durable, local) if s is not None), default=None)

    def _durable_steps(self) -> list[int]:
        """The steps every rank sees committed, the same list on every rank (every rank
        calling together, through the same agreement as a load without a local tier): a
        rank that cannot list them fails the call on every rank, naming itself and why; a
        step a lagging rank does not see is left out, and the difference is logged."""
        listings = agreement_for(self._saver.channel).values(
            f"listing of the committed steps under {self.root}",
            self.steps,
            self._saver.options.timeout,
        )
        common = set(listings[0]).intersection(*listings[1:])
        if any(set(steps) != common for steps in listings):
            logger.warning(
                "ranks list different committed steps under %s (%s); every rank considers "
                "only the steps every rank sees: %s",
                self.root,
                ", ".join(f"rank {r}: {steps}" for r, steps in enumerate(listings)),
                sorted(common),
            )
        return sorted(common)

    def save(self, step: int, state_dict: Mapping[str, Any] | Stateful) -> AsyncSaveResponse:
        """Start saving ``state_dict`` as ``step``; see :func:`slipstream.async_save`.
        ``state_dict`` may be a bare ``Stateful`` (its ``state_dict()`` is saved).

        Returns the save's response; a skipped save's (``when_busy="skip"``) has
        ``skipped`` set and resolved futures. With a local tier, the step goes to each
        tier whose interval it falls on, and the response covers them all (a step neither
        tier takes is a skipped save)."""
        state = state_dict if isinstance(state_dict, Mapping) else state_dict.state_dict()
        responses = []
        if step % self.durable_every == 0:
            responses.append(self._save_durable(step, state))
        if self.local_tier is not None and step % self.local_tier.tier.every == 0:
            responses.append(self._save_local(step, state))
        if not responses:
            return AsyncSaveResponse(completed_future(), completed_future(), skipped=True)
        if len(responses) == 1:
            return responses[0]
        both = AsyncSaveResponse(
            all_of([r.staging_completion for r in responses]),
            all_of([r.upload_completion for r in responses]),
            skipped=all(r.skipped for r in responses),
        )
        both.timings = responses[-1].timings
        return both

    def _save_local(self, step: int, state: Mapping[str, Any]) -> AsyncSaveResponse:
        """Start the local tier's save of ``step``; failures follow ``on_error`` as the
        durable tier's do, and are logged."""
        assert self.local_tier is not None
        try:
            response = self.local_tier.save(step, state)
        except SlipstreamError as exc:
            if self.on_error == "raise":
                raise
            logger.warning("local save of step %d failed to start: %s", step, exc)
            failed: Future[None] = Future()
            failed.set_exception(exc)
            return AsyncSaveResponse(failed, failed)

        def log_failure(done: Future[None]) -> None:
            error = done.exception()
            if error is not None:
                logger.warning("local save of step %d failed: %s", step, error)

        response.upload_completion.add_done_callback(log_failure)
        return response

    def _save_durable(self, step: int, state: Mapping[str, Any]) -> AsyncSaveResponse:
        if self.on_error == "raise" and self._last is not None:
            previous, self._last = self._last, None
            self._saver.wait_previous()
            error = previous.upload_completion.exception()
            if error is not None:
                raise error
        self._saved = True
        try:
            if self.when_busy == "skip" and self._skip(step):
                self._health.skipped(step)
                return AsyncSaveResponse(completed_future(), completed_future(), skipped=True)
            self._saved_step = step
            self._saver.wait_previous()
            if self._saver.rank == 0:
                self._remove_uncommitted(except_step=step)
            retain = self._retain if self._saver.rank == 0 else None
            response = self._saver.save(state, self._step(step), after_commit=retain)
        except SlipstreamError as exc:
            self._health.failed_to_start(step, exc)
            if self.on_error == "raise":
                raise
            failed: Future[None] = Future()
            failed.set_exception(exc)
            response = AsyncSaveResponse(failed, failed)
            self._last = response
            return response
        self._health.started(step, response.upload_completion)
        self._last = response
        return response

    def _skip(self, step: int) -> bool:
        """Whether to skip the save of ``step`` because the previous one is still running,
        as rank 0 decides (posted through the saver's channel for the other ranks)."""
        channel = self._saver.channel
        topic = Topics.skip(int(step))
        if channel.rank == 0:
            busy = self._last is not None and not self._last.upload_completion.done()
            durable = self._health.snapshot().last_durable_step
            within_lag = self.max_lag_steps is None or (
                durable is not None and step - durable <= self.max_lag_steps
            )
            decision = busy and within_lag
            if not busy and self._saved_step is not None:
                # The last save that ran has finished on every rank, and every rank read
                # each decision up to its step before joining it: those can go.
                read = [(s, t) for s, t in self._skip_topics if s <= self._saved_step]
                for _, old in read:
                    channel.forget(old, [0])
                self._skip_topics = [(s, t) for s, t in self._skip_topics if s > self._saved_step]
            channel.post(topic, SkipDecision(decision))
            self._skip_topics.append((int(step), topic))
            return decision
        deadline = Deadline(self._saver.options.timeout)
        message = channel.receive(
            topic, SkipDecision.from_json, 0, deadline, f"decide whether to save step {step}"
        )
        return message.skip

    def health(self) -> CheckpointHealth:
        """The last durable step, the last error, failed and skipped saves, and how many
        steps durability lags (see :class:`CheckpointHealth`)."""
        return self._health.snapshot()

    def _remove_uncommitted(self, except_step: int) -> None:
        """Remove steps that never committed, temporary files of a commit cut short, and
        unfinished uploads, except ``except_step`` (the save about to start); what it
        removes is logged in one line. Cleaning up is best effort: a failure is logged, and
        the save goes on."""
        removed = []
        try:
            for step, name in step_dirs(self.storage.list_children()).items():
                if step == except_step:
                    continue
                location = self.storage.child(name)
                if not location.exists(METADATA_FILE):
                    location.delete_all()
                    removed.append(name)
                elif isinstance(location, LocalStorage):
                    for leftover in _temporary_files(location):
                        location.delete(leftover)
                        removed.append(f"{name}/{leftover}")
            self.storage.cleanup_incomplete(keep=step_dir(except_step))
        except (OSError, SlipstreamError) as exc:
            logger.warning("could not clean up uncommitted saves under %s: %s", self.root, exc)
        if removed:
            logger.warning(
                "removed what saves that never committed left under %s: %s",
                self.root,
                ", ".join(removed),
            )

    def _sweep_local_tier(self) -> None:
        """Each node's lowest rank removes its node's uncommitted local steps (a killed
        job's), at start: no rank of the job can write one yet, since a local save starts
        on a node only after its lowest rank has cleared it in :meth:`save`."""
        assert self.local_tier is not None
        if not self.local_tier.is_leader:
            return
        storage, removed = self.local_tier.storage, []
        try:
            for _, name in sorted(step_dirs(storage.list_children()).items()):
                location = storage.child(name)
                if not location.exists(MARKER_FILE):
                    location.delete_all()
                    removed.append(name)
        except (OSError, SlipstreamError) as exc:
            logger.warning("could not clean up uncommitted local steps in %s: %s", storage.url, exc)
        if removed:
            logger.warning(
                "removed local steps a killed job never committed from %s: %s",
                storage.url,
                ", ".join(removed),
            )

    def _retain(self) -> None:
        """Delete committed steps older than the last ``keep_last`` (runs after a commit).

        Each step is uncommitted first (its ``.metadata`` removed), so a deletion cut short
        leaves a location that is no longer listed and that the next save cleans up.
        """
        if self.keep_last is None:
            return
        try:
            old = self.steps()[: -self.keep_last]
        except (OSError, SlipstreamError) as exc:
            logger.warning("could not list %s for retention: %s", self.root, exc)
            return
        for step in old:
            location = self._step(step)
            try:
                uncommit(location)
                location.delete_all()
            except (OSError, SlipstreamError) as exc:
                logger.warning("could not delete old checkpoint %s: %s", location.url, exc)

    def load(
        self,
        state_dict: dict[str, Any] | Stateful,
        step: int | None = None,
        *,
        strict: bool = True,
        trusted: Trusted = None,
    ) -> int:
        """Load ``step`` (default: the latest committed one) into ``state_dict``; return it.
        Every rank of the group calls it together, and every rank loads the same step
        (without ``step``: the newest step that every rank sees committed).

        ``state_dict`` may be a bare ``Stateful``: its ``state_dict()`` is loaded in place,
        then given to its ``load_state_dict``. ``trusted``: see :func:`slipstream.load`.

        With a local tier (every rank calling together), a step the local tiers can
        rebuild is read from them, each rank's missing files from peer replicas; otherwise,
        or where that load fails on any rank, from the durable tier. Without ``step``, a
        step that no tier can load on every rank is passed over for the next older one
        (each refusal logged); every rank loads the same step, and this raises, listing
        what was tried, only when none loads. The tier that served it is logged and kept
        in :attr:`last_load_tier`."""
        target = state_dict if isinstance(state_dict, dict) else state_dict.state_dict()
        if self.local_tier is None:
            step = self._load_agreed(target, step, strict, trusted)
            tier: Literal["local", "durable"] = "durable"
        else:
            step, tier = self._load_two_tier(target, step, strict, trusted)
        if not isinstance(state_dict, dict):
            state_dict.load_state_dict(target)
        if self.local_tier is not None:
            self.local_tier.discard_newer(step)
        self.last_load_tier = tier
        return step

    def _load_agreed(
        self, target: dict[str, Any], step: int | None, strict: bool, trusted: Trusted
    ) -> int:
        """Load ``step`` (``None``: the newest step every rank sees committed) from the
        durable tier, every rank the same step. Without a step, the ranks first agree on it
        in one round: each posts the newest it lists, and where they differ (a lagging
        listing, another copy of the root; the difference is logged) every rank loads the
        newest that every rank sees. The load then runs its own rounds
        (:mod:`.collective_load`), which need every rank planning the same step."""
        agreement = agreement_for(self._saver.channel)
        timeout = self._saver.options.timeout
        if step is None:
            own, newest = agreement.same(
                f"load of the newest step under {self.root}", self._newest, timeout
            )
            step = int(own if newest is None else min(newest))
            if newest is not None:
                logger.warning(
                    "ranks see different newest steps under %s (%s); every rank loads step "
                    "%d, the newest that every rank sees",
                    self.root,
                    ", ".join(f"rank {r}: {s}" for r, s in enumerate(newest)),
                    step,
                )
        self._load_durable(agreement, target, step, strict, trusted)
        return step

    def _newest(self) -> int:
        """The newest step this rank lists committed."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(
                f"no committed checkpoint under {self.root} "
                f"(as listed by {ranks_text([self._saver.rank])})"
            )
        return steps[-1]

    def _load_durable(
        self,
        agreement: LoadAgreement,
        target: dict[str, Any],
        step: int,
        strict: bool,
        trusted: Trusted,
    ) -> None:
        """Load ``step`` from the durable tier into ``target``, every rank together."""

        def prepare() -> loader.PlannedLoad:
            if not self._step(step).exists(METADATA_FILE):
                raise self._not_committed(step, max(self.steps()[-1:], default=None))
            return loader.open_plan(target, self._step(step), strict=strict, trusted=trusted)

        what = f"load of step {step} under {self.root}"
        collective_load.load(agreement, what, prepare, self._saver.options.timeout)
        logger.info("rank %d loaded step %d from %s", self._saver.rank, step, self.root)

    def _load_two_tier(
        self, target: dict[str, Any], step: int | None, strict: bool, trusted: Trusted
    ) -> tuple[int, Literal["local", "durable"]]:
        """Load ``step`` (``None``: the newest step either tier can serve, falling back to
        older ones) into ``target``, every rank the same step from the same tier.

        Each candidate, newest first: the local tier where it can rebuild it, then the
        durable tier where it holds it; an attempt that fails on any rank fails on all
        (their outcomes are gathered through the store), is logged, and the next is
        tried; an attempt that succeeds has written every value of ``target``, so what a
        failed one left is overwritten. Raises, listing every attempt, only when none
        loads; the error then says that ``target`` may hold part of a failed attempt."""
        assert self.local_tier is not None
        local = self.local_tier.rebuildable()
        durable = self._durable_steps()
        if step is None:
            candidates = sorted(set(local) | set(durable), reverse=True)
            if not candidates:
                raise CheckpointError(
                    f"no committed checkpoint under {self.root} or its local tier"
                )
        elif step not in local and step not in durable:
            raise self._not_committed(step, max([*local, *durable[-1:]], default=None))
        else:
            candidates = [step]
        tried = []
        attempted = False
        for candidate in candidates:
            found = local.get(candidate)
            if found is not None:
                attempted = True
                try:
                    remote = self.local_tier.load(target, found, strict, trusted)
                except CheckpointError as exc:
                    tried.append(f"step {candidate} from the local tier: {exc}")
                    logger.warning("the local tier could not serve step %d: %s", candidate, exc)
                else:
                    logger.info(
                        "rank %d loaded step %d from the local tier (%d file(s) from peers)",
                        self._saver.rank,
                        candidate,
                        remote,
                    )
                    return candidate, "local"
            if candidate in durable:
                attempted = True
                try:
                    self._load_durable(
                        agreement_for(self._saver.channel), target, candidate, strict, trusted
                    )
                except CheckpointError as exc:
                    tried.append(f"step {candidate} from {self.root}: {exc}")
                    logger.warning("could not load step %d from %s: %s", candidate, self.root, exc)
                else:
                    return candidate, "durable"
            elif found is None:
                tried.append(f"step {candidate}: neither tier holds it")
        partial = (
            "; the state dict may hold part of a failed attempt (some of its tensors loaded, "
            "others not): do not train from it"
            if attempted
            else ""
        )
        raise CheckpointError(
            "no checkpoint could be loaded on every rank; tried " + " | ".join(tried) + partial
        )

    def _not_committed(self, step: int, newest: int | None) -> CheckpointError:
        found = (
            f"the newest complete step is {newest}"
            if newest is not None
            else f"no step under {self.root} is complete"
        )
        return CheckpointError(
            f"step {step} under {self.root} is not a complete checkpoint (no {METADATA_FILE}: "
            f"its save did not commit, or it was never saved); {found}"
        )

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last save (of each tier) is committed; raise its error if it failed."""
        if self._last is not None:
            self._last.upload_completion.result(timeout)
        if self.local_tier is not None:
            self.local_tier.wait(timeout)

    def close(self) -> None:
        """Wait for the save in flight and join the threads; errors were already reported.
        Rank 0 of a Checkpointer that saved then deletes the spare data files (one that
        only read, such as a reader in another process, never deletes the writer's)."""
        try:
            if self.local_tier is not None:
                self.local_tier.close()
        finally:
            self._saver.close()  # joined even when the local tier's close raised
            if self._saver.rank == 0 and self._saved:
                self.storage.discard_spares()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _temporary_files(location: LocalStorage) -> list[str]:
    """Temporary files of a commit cut short in a committed step on the local disk."""
    try:
        return [n for n in os.listdir(location.path) if is_temporary(n)]
    except FileNotFoundError:
        return []
