"""The local tier of a :class:`~..checkpointer.Checkpointer`: saves into node-local storage
(``/dev/shm`` by default), each rank's file replicated to peer ranks on other nodes.

A local save is an ordinary slipstream save (same format as the durable tier, same
loader), made by a saver of its own into ``<node root>/step_<k>`` on each node: every rank
writes its data file on its own node, rank 0 also the ``.metadata`` and index. Then, on
a thread this tier owns, each rank sends its file to its replica ranks
(:mod:`.nodes`), and rank 0 its ``.metadata`` and index to those and to one rank of every
other node, over a gloo group of the tier's own (:mod:`.link`, :mod:`.replication`).
Rank 0 gathers every rank's report through the store and decides; only then does each
node's lowest rank write the step's marker (``.local_commit``, the step's manifest: every
file, its size and its digest, under a MAC with the node's key; :mod:`.sealing`).

Invariants:

- A step is committed in the local tier only once every file has its replicas; a step
  without a marker on any node is never read (nor are its replicas).
- Recovery (:meth:`LocalTierSaver.rebuildable`) takes a step only where the nodes that
  answered hold, between them, every file of its manifest with the manifest's size, and
  every rank loads the same step; block checksums are verified on every read, replica
  or not.
- A local save that fails (a peer died, a full ``/dev/shm``) fails its own futures only:
  the previous committed step stays on every node, and retention deletes a committed step
  only after a newer one has committed.
- At most two local saves are in flight: step N+1 stages and writes while step N
  replicates (replication and commits run in save order, on one thread), and the clear
  before a save spares the steps still in flight.
- A rank's local save resolves only once its node's marker is in place (the node's other
  ranks wait for the lowest rank's word), so nothing a caller does after it (deleting the
  directory, losing the node) can cut a marker short.
- A failed step's error names every rank found dead, with its node and that node's
  directory, and every surviving rank gets the same set: rank 0 decides it, waiting past
  the first death for the ranks still missing to answer or be found dead too (those of a
  lost node die together), and a rank whose connection to a peer drops is reported dead
  through the store at once (:meth:`~..save.channel.RankChannel.report_dead`).

Deletions. Only a node's lowest rank deletes its node's step directories, always holding
``_dir_lock``, and only where no thread may still write:

- the clear, on the caller's thread at the start of the save of step ``s``: an earlier
  attempt at ``s`` (a save of ``s`` still in flight is waited for first) and steps without
  a marker that are not in flight (abandoned: their saves failed);
- retention, on the replication thread right after it wrote a step's marker: committed
  steps (marker in place) older than the last ``keep_last``;
- the discard after a load (:meth:`LocalTierSaver.discard_newer`), on the caller's thread:
  it waits until every local save in flight has committed or failed, then deletes the
  steps past the one loaded.

Recovery (:meth:`LocalTierSaver.rebuildable`, :meth:`LocalTierSaver.load`) first waits
for the local saves in flight too, so no retention runs while a step is listed or read,
and a load called mid-run takes the newest step, the one that was in flight included.

A step is in flight from the start of its save until its ``upload_completion`` resolves
on the lowest rank, which is after that rank wrote the marker under ``_dir_lock`` (or gave
the step up). So a marker is written only into a step directory that nothing deletes
until the marker is in place or the step is abandoned.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ...core.control_plane import ranks_text
from ...core.handles import fail_unfinished
from ...core.threads import lower_thread_priority
from ...core.waits import Deadline
from ...errors import CheckpointError, CorruptCheckpointError, PeerDiedError, SlipstreamError
from ..agreement import agreement_for
from ..format.index import CheckpointIndex
from ..format.names import (
    METADATA_FILE,
    SPARE_DIR,
    data_file_name,
    files_of,
    index_file,
    step_dir,
    step_dirs,
)
from ..format.safe_types import Trusted
from ..save.channel import LIVENESS_CHECK_SECONDS, SILENT_AFTER_SECONDS
from ..save.job import AsyncSaveResponse
from ..save.options import SaveOptions
from ..save.saver import CheckpointSaver
from ..storage import LocalStorage, Storage
from .link import TierLink
from .messages import (
    HeldStep,
    HostAnnouncement,
    LocalCommitMarker,
    NodeCleared,
    NodeMarked,
    ReplicationReport,
    StepInventory,
    TierCommitOutcome,
    TierRoot,
    TierTopics,
)
from .nodes import NodeMap
from .options import LocalTier, default_root
from .recovery import RecoveredStep, recover
from .replication import StepReplication, TierFiles, step_copies
from .sealing import (
    blocks_digests,
    bytes_digest,
    file_digest,
    mac_matches,
    manifest_mac,
    node_key,
)

logger = logging.getLogger(__name__)

MARKER_FILE = ".local_commit"
LATE_DEATHS_SECONDS = SILENT_AFTER_SECONDS + 2 * LIVENESS_CHECK_SECONDS
"""How long rank 0 waits on, after finding a rank dead, for the ranks still missing to
answer or be found dead too (a silence period and two looks: ranks that die together are
named together)."""


@dataclass(frozen=True)
class Rebuildable:
    """A local step the job can load: its manifest (file: size, file: digest) and, per
    file, the ranks whose nodes hold it."""

    step: int
    manifest: dict[str, int]
    holders: dict[str, list[int]]
    digests: dict[str, str]


class LocalTierSaver:
    """Saves, replication, commit markers, retention and recovery of one job's local tier.
    Every rank makes one, in the same order relative to its other savers, and calls
    :meth:`save`, :meth:`rebuildable` and :meth:`load` together."""

    def __init__(
        self,
        tier: LocalTier,
        durable_url: str,
        process_group: dist.ProcessGroup | None,
        options: SaveOptions,
    ) -> None:
        self.tier = tier
        self.options = dataclasses.replace(options, direct_io=False)
        self.timeout = tier.timeout if tier.timeout is not None else self.options.timeout
        self._saver = CheckpointSaver(process_group, self.options)
        self.channel = self._saver.channel
        self.rank = self.channel.rank
        world = self.channel.world_size
        if tier.ranks_per_node is not None:
            self.nodes = NodeMap.from_ranks_per_node(world, tier.ranks_per_node)
        else:
            topic = TierTopics.host()
            self.channel.post(topic, HostAnnouncement(socket.gethostname()))
            hosts = self.channel.gather(
                topic, HostAnnouncement.from_json, Deadline(self.timeout), "name their host"
            )
            self.nodes = NodeMap.from_hosts([m.host for m in hosts])
        self.node = self.nodes.node_of[self.rank]
        self.is_leader = self.nodes.leader(self.node) == self.rank
        self.peers = self.nodes.replica_ranks(self.rank, tier.replicas)
        root = tier.root if tier.root is not None else default_root(durable_url)
        self.storage: Storage = (
            root
            if isinstance(root, Storage)
            else LocalStorage(root, spare_dir=Path(root) / SPARE_DIR, direct_io=False)
        )
        self.storage.prepare()
        self.channel.post(TierTopics.root(), TierRoot(self.storage.url))
        if self.is_leader:
            node_key(self.storage, create=True)
        self._files = TierFiles(self.storage)
        priority = (self.options.thread_nice, self.options.idle_threads)
        self._copies = step_copies(self.nodes, tier.replicas)
        self._link = TierLink(self.channel, self.timeout)
        self._thread = ThreadPoolExecutor(
            1, "slipstream-replicate", initializer=lower_thread_priority, initargs=priority
        )
        self._seq = 0
        """Local saves started, counted alike on every rank (they call :meth:`save`
        together); a save's number keys its node's :class:`NodeMarked`."""
        self._marked_seq: int | None = None
        self._in_flight: deque[tuple[int, Future[None]]] = deque()
        """The local saves started and not yet seen finished, oldest first: their steps and
        their commit futures."""
        self._dir_lock = threading.Lock()
        """Held by whoever deletes step directories (the clear, retention, the discard)
        and while a marker is written (see the module docstring)."""
        self._rounds = 0
        self._committed_steps: list[int] = []
        self._dead: dict[int, str] = {}
        """Ranks a local save's commit found dead: later local saves fail at once (a job
        that lost a rank restarts; its new ranks make a new tier)."""
        self.before_replication: Callable[[int], None] | None = None
        """Called on the replication thread with the step, before this rank sends any
        replica of it (instrumentation, and tests that stop a node mid-replication); an
        exception it raises fails this rank's part of the save."""

    # -- saving -----------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> AsyncSaveResponse:
        """Start the local save of ``step``: its ``upload_completion`` resolves once the
        step is committed in the local tier (written, replicated, marked). Waits first
        until at most one earlier local save is in flight (none where that one is of this
        same step)."""
        step = int(step)
        seq = self._seq
        self._seq += 1
        self._wait_in_flight(0 if any(s == step for s, _ in self._in_flight) else 1)
        dead = {**self.channel.known_dead(), **self._dead}
        if dead:
            raise PeerDiedError(
                f"{ranks_text(sorted(dead))} of {self._where(sorted(dead))} died "
                f"({self._reasons(dead)}); local saves fail at once until the job restarts",
                sorted(dead),
                f"local save of step {step}",
            )
        step_name = step_dir(step)
        self._clear(step, step_name, {s for s, f in self._in_flight if not f.done()})
        self._files.forget(step_name)
        written = self._saver.save(state, self.storage.child(step_name))
        response = AsyncSaveResponse(written.staging_completion, Future())
        response.timings = written.timings
        self._in_flight.append((step, response.upload_completion))
        written.upload_completion.add_done_callback(
            lambda _: self._thread.submit(self._replicate, seq, step, written, response)
        )
        return response

    def _wait_in_flight(self, keep: int) -> None:
        """Block until at most ``keep`` local saves are in flight (their errors are their
        futures': only a save that outlives its bound raises here, naming its step)."""
        while len(self._in_flight) > keep:
            step, done = self._in_flight[0]
            try:
                done.result(self.timeout + self.options.timeout)
            except SlipstreamError:
                pass
            except TimeoutError as exc:
                raise CheckpointError(
                    f"the local save of step {step} did not finish within "
                    f"{self.timeout + self.options.timeout} s"
                ) from exc
            self._in_flight.popleft()

    def wait_previous(self) -> None:
        """Block until every local save started has committed or failed."""
        self._wait_in_flight(0)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last local save is committed; raise its error if it failed
        (saves commit in order, so every earlier one has finished too)."""
        if self._in_flight:
            self._in_flight[-1][1].result(timeout)

    def _clear(self, step: int, step_name: str, in_flight: set[int]) -> None:
        """The node's lowest rank removes what a save of ``step`` would collide with (an
        older attempt at it, uncommitted steps other than those ``in_flight``, which this
        process is still replicating), then tells its node's other ranks, which wait for
        that before writing (so that every node starts the step from nothing)."""
        topic = TierTopics.clear(step)
        leader = self.nodes.leader(self.node)
        if self.is_leader:
            try:
                with self._dir_lock:
                    for found, name in step_dirs(self.storage.list_children()).items():
                        location = self.storage.child(name)
                        if found == step or (
                            found not in in_flight and not location.exists(MARKER_FILE)
                        ):
                            self._delete_step(name)
            except (OSError, SlipstreamError) as exc:
                logger.warning("could not clear %s before step %d: %s", self.storage.url, step, exc)
            self.channel.post(topic, NodeCleared(step))
        else:
            self.channel.receive(
                topic,
                NodeCleared.from_json,
                leader,
                Deadline(self.timeout),
                f"clear its node's local step {step}",
            )

    def _replicate(
        self, seq: int, step: int, written: AsyncSaveResponse, response: AsyncSaveResponse
    ) -> None:
        try:
            self._commit_step(seq, step, written)
        except BaseException as exc:
            fail_unfinished(_as_error(exc, step), response.upload_completion)
        else:
            response.upload_completion.set_result(None)

    def _commit_step(self, seq: int, step: int, written: AsyncSaveResponse) -> None:
        """Replicate this rank's files of the written step, let rank 0 decide, and (the
        node's lowest rank) write the marker; return once this node's marker is in place.
        A save that failed on its own fails here at once (every rank saw its outcome),
        unless it failed by a death: then it still reports, so that rank 0 names every
        dead rank, alike on every rank."""
        step_name = step_dir(step)
        location = self._files.step(step_name)
        deadline = Deadline(self.timeout)
        try:
            written.upload_completion.result()
            unsendable = self._unsendable(step, location, written)
            replication = StepReplication(
                self._link, self._copies, self.rank, location, step_name, unsendable
            )
            errors = replication.run(deadline)
            report = (
                ReplicationReport(error="; ".join(errors))
                if errors
                else ReplicationReport(*self._own_files(location))
            )
        except BaseException as exc:
            save_failed = written.upload_completion.exception() is not None
            if save_failed and not isinstance(exc, PeerDiedError):
                raise
            dead = list(exc.ranks) if isinstance(exc, PeerDiedError) else []
            if not save_failed:
                for peer in dead:  # e.g. its connection dropped: tell every rank's waits now
                    self.channel.report_dead(peer, f"seen gone by rank {self.rank}: {exc}")
            report = ReplicationReport(
                error=str(exc) if save_failed else f"rank {self.rank}: {type(exc).__name__}: {exc}",
                dead=dead,
            )
        self.channel.post(TierTopics.replicated(step), report)
        if self.rank == 0:
            failed = written.upload_completion.exception()
            self._decide(
                step, location, deadline, str(failed) if isinstance(failed, PeerDiedError) else None
            )
        try:
            outcome = self.channel.receive(
                TierTopics.commit(step),
                TierCommitOutcome.from_json,
                0,
                deadline,
                f"commit local step {step}",
            )
            if outcome.error is not None:
                message = f"local step {step} was not committed: {outcome.error}"
                dead = outcome.dead
                if dead:
                    self._dead.update(dict.fromkeys(dead, message))
                    raise PeerDiedError(message, dead, f"local step {step}")
                raise CheckpointError(message)
            if self.is_leader:
                self._mark(seq, step, location, outcome)
        except BaseException as exc:
            if self.is_leader:
                self._post_marked(seq, NodeMarked(step, str(exc)))
            raise
        if self.is_leader:
            self._retain()
            # every rank of the node read it before its part of the save that just committed
            self.channel.forget(TierTopics.clear(step), [self.rank])
        else:
            self._await_marker(seq, step, deadline)
        self._committed_steps.append(step)
        self._files.forget(step_name)  # no file handle keeps a retired step's files

    def _mark(self, seq: int, step: int, location: Storage, outcome: TierCommitOutcome) -> None:
        """Write the step's marker on this node (its lowest rank), then tell the node."""
        marker = self._marker(step, outcome)
        with self._dir_lock:
            location.put_atomic(MARKER_FILE, marker.to_json())
        self._post_marked(seq, NodeMarked(step))

    def _post_marked(self, seq: int, message: NodeMarked) -> None:
        """Post this node's word on the local save numbered ``seq``; the word on the one
        before it goes (every rank of the node read it before reporting on this one)."""
        self.channel.post(TierTopics.marked(seq), message)
        previous, self._marked_seq = self._marked_seq, seq
        if previous is not None and previous != seq:
            self.channel.forget(TierTopics.marked(previous), [self.rank])

    def _await_marker(self, seq: int, step: int, deadline: Deadline) -> None:
        """Wait for the node's lowest rank to have written the step's marker."""
        leader = self.nodes.leader(self.node)
        marked = self.channel.receive(
            TierTopics.marked(seq),
            NodeMarked.from_json,
            leader,
            deadline,
            f"write the marker of local step {step} on node {self.node}",
        )
        if marked.error is not None:
            raise CheckpointError(
                f"local step {step} is not committed on node {self.node}: its lowest rank "
                f"({leader}) could not write the marker: {marked.error}"
            )

    def _marker(self, step: int, outcome: TierCommitOutcome) -> LocalCommitMarker:
        """The step's marker, its manifest sealed with this node's key."""
        key = node_key(self.storage, create=True)
        assert key is not None
        world = self.nodes.world_size
        mac = manifest_mac(key, step, world, outcome.files, outcome.digests)
        return LocalCommitMarker(step, world, outcome.files, outcome.digests, mac)

    def _unsendable(self, step: int, location: Storage, written: AsyncSaveResponse) -> str | None:
        """Why this rank sends none of its files of ``step`` (its copies still take part,
        so its peers learn it at once), or ``None``: the instrumentation hook raised, or
        rank 0's save is not one data file per rank."""
        try:
            if self.before_replication is not None:
                self.before_replication(step)
            if self.rank == 0:
                metadata = written.metadata()
                want = {data_file_name(r) for r in range(self.nodes.world_size)}
                if files_of(metadata) != want:
                    return (
                        f"{location.url}: the local save's files {sorted(files_of(metadata))} "
                        "are not one per rank of generation 0"
                    )
        except Exception as exc:
            return f"rank {self.rank}: {type(exc).__name__}: {exc}"
        return None

    def _own_files(self, location: Storage) -> tuple[dict[str, int], dict[str, str]]:
        """The sizes of this rank's files of the step, and the contents digests of the
        small ones (rank 0's ``.metadata`` and index)."""
        own = [data_file_name(self.rank)]
        small = [METADATA_FILE, index_file(0)] if self.rank == 0 else []
        sizes, digests = {}, {}
        for file in own + small:
            if not location.exists(file):
                raise CheckpointError(f"{location.url}/{file}: this rank's local save is missing")
            sizes[file] = location.size(file)
        for file in small:
            digests[file] = file_digest(location, file, sizes[file])
        return sizes, digests

    def _decide(
        self, step: int, location: Storage, deadline: Deadline, save_death: str | None
    ) -> None:
        """Rank 0: gather every rank's report on ``step`` and post the outcome: the manifest,
        each data file's digest taken from the index (:mod:`.sealing`), or why the step
        failed. Where a rank is found dead (or this rank saw one go already), wait on
        (:data:`LATE_DEATHS_SECONDS` at most) for the others to report or be found dead too,
        so that the outcome names every dead rank. ``save_death``: the error of the local
        save itself, where it failed by a death (the same text on every rank)."""
        topic = TierTopics.replicated(step)
        what = f"replicate local step {step}"

        def living() -> tuple[dict[int, ReplicationReport], dict[int, str], list[int]]:
            return self.channel.gather_living(
                topic, ReplicationReport.from_json, Deadline(LATE_DEATHS_SECONDS), what
            )

        try:
            if self.channel.dead:  # this rank saw one go already (its replica's connection)
                reports, found, missing = living()
            else:
                try:
                    gathered = self.channel.gather(
                        topic, ReplicationReport.from_json, deadline, what
                    )
                    reports, found, missing = dict(enumerate(gathered)), {}, []
                except PeerDiedError:
                    reports, found, missing = living()
            outcome = self._outcome(step, location, reports, found, missing, save_death)
        except BaseException as exc:
            dead = list(exc.ranks) if isinstance(exc, PeerDiedError) else []
            outcome = TierCommitOutcome(error=str(exc), dead=dead)
        self.channel.post(TierTopics.commit(step), outcome)
        self.channel.forget(topic)
        if self._committed_steps:
            previous = self._committed_steps[-1]
            self.channel.forget(TierTopics.commit(previous), [0])

    def _outcome(
        self,
        step: int,
        location: Storage,
        reports: dict[int, ReplicationReport],
        found: dict[int, str],
        missing: list[int],
        save_death: str | None,
    ) -> TierCommitOutcome:
        """The decision on ``step`` from the reports posted (by rank), the ranks found dead
        (rank: why) and those that neither reported nor were found dead in time: the dead
        (found by rank 0, or by a rank whose replica could not reach them) are named once,
        with their nodes and directories; every other error once, in rank order."""
        dead = dict(found)
        errors: list[str] = []
        # a save that failed by a death failed with one text on every rank (rank 0's
        # outcome, which names its own directory): the dead are named below instead
        deaths = {m.error for m in reports.values() if m.dead} | {save_death}
        if missing:
            errors.append(
                f"{ranks_text(missing)} did not report on local step {step} within "
                f"{LATE_DEATHS_SECONDS:.0f} s of the first death"
            )
        # a rank reported dead by another may have posted its own report first: the
        # notice of whoever saw it go says how
        reported = sorted({p for m in reports.values() for p in m.dead} - set(dead))
        noticed = self.channel.dead_among(reported) if reported else {}
        for rank, m in sorted(reports.items()):
            for peer in m.dead:
                dead.setdefault(peer, noticed.get(peer, f"seen dead by rank {rank}"))
            if m.error is not None and m.error not in deaths and m.error not in errors:
                errors.append(m.error)
        if dead:
            ranks = sorted(dead)
            died = f"{ranks_text(ranks)} of {self._where(ranks, step)} died ({self._reasons(dead)})"
            return TierCommitOutcome(error="; ".join([died, *errors]), dead=ranks)
        if save_death is not None and save_death not in errors:
            errors.append(save_death)
        if errors:
            return TierCommitOutcome(error="; ".join(errors))
        files: dict[str, int] = {}
        digests: dict[str, str] = {}
        for m in reports.values():
            files.update(m.files)
            digests.update(m.digests)
        data = sorted(set(files) - set(digests))
        digests.update(blocks_digests(self._index(location, digests), data))
        return TierCommitOutcome(files, digests)

    def _where(self, ranks: list[int], step: int | None = None) -> str:
        """The nodes of ``ranks`` and their local-tier directories (of ``step``), as each
        rank posted them: ``node 1 (/dev/shm/x/step_9)``."""
        parts = []
        for node in sorted({self.nodes.node_of[r] for r in ranks}):
            url = self._root_of(self.nodes.leader(node))
            for rank in (r for r in ranks if self.nodes.node_of[r] == node):
                url = url or self._root_of(rank)
            if url is not None and step is not None:
                url = f"{url}/{step_dir(step)}"
            parts.append(f"node {node}" + (f" ({url})" if url else ""))
        return ", ".join(parts)

    def _root_of(self, rank: int) -> str | None:
        """Where ``rank``'s node keeps the tier, as it posted it (None if it never did)."""
        try:
            posted = self.channel.receive(
                TierTopics.root(), TierRoot.from_json, rank, Deadline(0.0), "name its root"
            )
        except SlipstreamError:
            return None
        return posted.url

    @staticmethod
    def _reasons(dead: Mapping[int, str]) -> str:
        return "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()))

    @staticmethod
    def _index(location: Storage, digests: dict[str, str]) -> CheckpointIndex:
        """The step's index, as rank 0 wrote it and digested it for the manifest."""
        name = index_file(0)
        data = location.get(name)
        if data is None or bytes_digest(data) != digests.get(name):
            raise CheckpointError(f"{location.url}/{name} changed while it was replicated")
        return CheckpointIndex.from_json(data, f"{location.url}/{name}")

    def _retain(self) -> None:
        """Delete this node's committed steps older than the last ``keep_last``."""
        try:
            with self._dir_lock:
                committed = sorted(
                    s
                    for s, name in step_dirs(self.storage.list_children()).items()
                    if self.storage.child(name).exists(MARKER_FILE)
                )
                for old in committed[: -self.tier.keep_last]:
                    self._delete_step(step_dir(old))
        except (OSError, SlipstreamError) as exc:
            logger.warning("local-tier retention under %s failed: %s", self.storage.url, exc)

    def _delete_step(self, name: str) -> None:
        """Delete step directory ``name`` of this node, its marker first (a deletion cut
        short leaves a step no one lists); the caller holds ``_dir_lock``."""
        self._files.forget(name)
        location = self.storage.child(name)
        location.delete(MARKER_FILE)
        location.delete_all()

    # -- recovery ---------------------------------------------------------------------

    def _inventory(self) -> StepInventory:
        """This node's committed steps whose marker verifies under the node's key: each
        one's manifest and the files held whole (a marker that does not verify is logged
        and left out, as a corrupt one is)."""
        steps: dict[int, HeldStep] = {}
        try:
            key = node_key(self.storage, create=False)
        except (OSError, SlipstreamError) as exc:
            logger.warning("no local step of %s can be verified: %s", self.storage.url, exc)
            return StepInventory(steps)
        for step, name in step_dirs(self.storage.list_children()).items():
            location = self.storage.child(name)
            try:
                held_step = self._held(step, location, key)
            except (OSError, SlipstreamError) as exc:
                logger.warning("skipped local step %s: %s", location.url, exc)
                continue
            finally:
                location.close()
            if held_step is not None:
                steps[step] = held_step
        return StepInventory(steps)

    def _held(self, step: int, location: Storage, key: bytes | None) -> HeldStep | None:
        """What this node holds of ``step`` under its verified marker; ``None`` where it
        has no marker. Raises where the marker is refused."""
        where = f"{location.url}/{MARKER_FILE}"
        data = location.get(MARKER_FILE)
        if data is None:
            return None
        marker = LocalCommitMarker.from_json(data, where)
        if key is None:
            raise CorruptCheckpointError(f"{where}: the node has no key to verify it with")
        want = manifest_mac(key, marker.step, marker.world_size, marker.files, marker.digests)
        if marker.step != step or not mac_matches(marker.mac, want):
            raise CorruptCheckpointError(
                f"{where}: refused, its MAC does not verify under this node's key (a marker "
                "this job did not write)"
            )
        held = [f for f, n in marker.files.items() if location.exists(f) and location.size(f) == n]
        return HeldStep(marker.files, marker.digests, held)

    def rebuildable(self) -> dict[int, Rebuildable]:
        """The local steps the job can load, by step (every rank calls this together and
        gets the same answer). A node whose manifest of a step differs from the lowest
        rank's that reported it is not counted as holding any of its files. Answered once
        the local saves in flight have committed or failed."""
        self.wait_previous()
        number = self._rounds
        self._rounds += 1
        topic = TierTopics.inventory(number)
        self.channel.post(topic, self._inventory())
        found = self.channel.gather(
            topic, StepInventory.from_json, Deadline(self.timeout), "list their local steps"
        )
        self._forget_round(number - 2)
        manifests: dict[int, HeldStep] = {}
        holders: dict[int, dict[str, list[int]]] = {}
        for rank, inventory in enumerate(found):
            for step, entry in inventory.steps.items():
                first = manifests.setdefault(step, entry)
                if (first.files, first.digests) != (entry.files, entry.digests):
                    logger.warning(
                        "rank %d's node holds a manifest of local step %d that differs from "
                        "the one rank %d's node holds: its files of that step are not read",
                        rank,
                        step,
                        min(r for r, i in enumerate(found) if step in i.steps),
                    )
                    continue
                for file in entry.held:
                    holders.setdefault(step, {}).setdefault(file, []).append(rank)
        return {
            step: Rebuildable(step, m.files, holders.get(step, {}), m.digests)
            for step, m in manifests.items()
            if all(f in holders.get(step, {}) for f in m.files)
        }

    def load(
        self, state_dict: dict[str, Any], found: Rebuildable, strict: bool, trusted: Trusted
    ) -> int:
        """Load ``found`` into ``state_dict`` on every rank together, what this node lacks
        sent by ranks whose nodes hold it (:mod:`.recovery`); all raise if any failed.
        Returns how many of the step's files this rank read from peers.

        A small file is taken only where its contents match the manifest's digest; the
        index's checksums of each data file must match the manifest's digest of it before
        any byte is read, and every byte read is verified against them. A file refused is
        logged on this rank with the peer that served it and why. Waits first for the local
        saves in flight."""
        self.wait_previous()
        step_name = step_dir(found.step)
        storage = RecoveredStep(
            self.storage.child(step_name),
            step_name,
            found.manifest,
            found.digests,
            found.holders,
            self.rank,
            self.nodes,
        )
        try:
            recover(
                agreement_for(self.channel),
                storage,
                self._link,
                state_dict,
                strict,
                trusted,
                f"local step {found.step}",
                self.timeout,
            )
        finally:
            storage.close()
        return storage.files_from_peers()

    def _forget_round(self, number: int) -> None:
        """Drop this rank's messages of round ``number``: every rank has read them once
        it has posted to a later round, which this rank has seen all do."""
        if number >= 0:
            self.channel.forget(TierTopics.inventory(number), [self.rank])

    def discard_newer(self, step: int) -> None:
        """After the job resumed from ``step``: the node's lowest rank waits for the local
        saves in flight (they commit or fail), then deletes its local steps past ``step``
        (they belong to the run that was abandoned)."""
        if not self.is_leader:
            return
        self.wait_previous()
        try:
            with self._dir_lock:
                for found, name in step_dirs(self.storage.list_children()).items():
                    if found > step:
                        self._delete_step(name)
        except (OSError, SlipstreamError) as exc:
            logger.warning("could not delete local steps after %d: %s", step, exc)

    def close(self) -> None:
        """Wait for the local save in flight, then stop serving and join every thread."""
        try:
            self.wait_previous()
        finally:
            self._saver.close()
            self._thread.shutdown(wait=True)
            self._link.close()
            self._files.close()
            if self.is_leader:
                self.storage.discard_spares()


def _as_error(exc: BaseException, step: int) -> SlipstreamError:
    if isinstance(exc, SlipstreamError):
        return exc
    return CheckpointError(f"local save of step {step} failed: {exc!r}")
