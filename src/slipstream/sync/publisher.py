"""The trainer side: :class:`WeightPublisher`, one publish round after another.

A publish is one round of the protocol in :mod:`.round.protocol`, run by :mod:`.round.trainer_round`
(who takes part, the epoch's transport, the acknowledgements, giving a broken round up);
this module reads the caller's tensors (a mapping, or an iterator as it yields:
:mod:`.trainer.stream`, or :mod:`.layout.described` while no layout is known yet) and packs
and sends the buckets this rank owns. The set of rollouts may change between publishes
(:meth:`WeightPublisher.set_rollouts`). In ``cached`` mode
the caller's thread only snapshots into the host cache (:mod:`.trainer.host_cache`) and the worker
thread runs the round from it, serving rollouts that ask again meanwhile.

Rollouts that die or come back: a rollout found dead (its process gone, or its heartbeat
still) is left out of the next rounds, which go on for the others; ``handle.absent`` names
it. A rollout that dies *during* a round breaks it for everyone: ``delivered`` fails with
:class:`~slipstream.errors.PeerDiedError` naming it, the trainers post the abort and drop
the epoch's transport (so every survivor blocked on it is freed at once), and the next
round starts a new epoch without it. A process that replaces it (same rank, new
``init_group`` and subscriber) asks for the next round and is a member again from then on.

Threads: in ``direct`` mode the caller's thread packs (reading live tensors, gathering
DTensors on the user's mesh) and issues asynchronous sends on the sync group; in ``cached``
mode the caller's thread only snapshots and the publisher's one worker thread,
``slipstream-sync-publisher``, runs the round. The worker only ever talks to the sync
group's own store and process groups, never to a group the user also uses.
:meth:`WeightPublisher.close` (or the context manager) joins it.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from ..core import tracing
from ..core.handles import fail_unfinished
from ..core.holds import Holdable
from ..errors import PeerTimeoutError, SyncError
from .group import SyncGroup
from .layout.aliases import named_items, unique_tensors
from .layout.delta import BucketDelta, DeltaStats, Differ
from .layout.described import DESCRIBED, DescribedSources, GrowingLayout, nonempty
from .layout.holders import holders_of
from .layout.plan import HEADER_CAP, BucketPlan, Holders, TensorSpec, is_dtensor, layout_json
from .round.negotiation import LOCAL_TRANSPORTS, TRANSPORTS, candidates, negotiate
from .round.protocol import Keys, Request
from .round.trainer_round import TrainerRound
from .round.versions import RolloutVersions
from .trainer.host_cache import HostCache
from .trainer.packing import BucketSources, Sources
from .trainer.pipeline import Pack, Refresh, Snapshot, serve_cached, walk, walk_described
from .trainer.refetch import RefetchServer
from .trainer.stream import StreamSources

logger = logging.getLogger(__name__)

MODES = ("direct", "cached")
#: After a publish whose diff found no bucket where a delta paid, this many publishes are
#: not diffed: in ``direct`` mode they go without the kept copy (sent straight from the
#: tensors, as with ``delta=False``; the next one refreshes the copy and the one after
#: diffs again), in ``cached`` mode they copy into the cache without comparing.
PLAIN_AFTER_NO_GAIN = 8


class PublisherState(Enum):
    """Where a :class:`WeightPublisher` stands; it only moves forward, OPEN -> CLOSING ->
    CLOSED (in the manner of FSDP2's ``TrainingState``)."""

    OPEN = auto()
    """Publishes and ``set_rollouts`` are taken."""
    CLOSING = auto()
    """``close`` was called: the worker was told to stop after the queued rounds but has
    not been joined yet (a ``close`` that timed out leaves it here; calling ``close``
    again waits again). Nothing new is taken."""
    CLOSED = auto()
    """The worker was joined and the transport and host cache let go."""


@dataclass
class PublishTimings:
    """Where one publish's time went on this trainer rank, in seconds from the call; each
    field is filled in when its phase ends (``None`` until then, or if it failed)."""

    nbytes: int = 0
    """Payload bytes this rank sent (unchanged tensors left out are not counted)."""
    blocked: float | None = None
    """Time the caller's thread spent in ``publish`` (waiting for the previous round too)."""
    staged: float | None = None
    """Until ``staged``: the weights may change from then on."""
    delivered: float | None = None
    """Until ``delivered``: every rollout acknowledged the version."""
    dense_bytes: int = 0
    """Bytes of this rank's buckets: what sending every byte of them would move."""
    changed_fraction: float | None = None
    """Fraction of the 8-byte words diffed that changed since the base (``None``: nothing
    was diffed, e.g. the first publish or ``delta=False``)."""
    diff_seconds: float = 0.0
    """Time spent diffing against the base (on the caller's thread)."""
    transport: str = ""
    """The transport the publish went over (:attr:`WeightPublisher.transport`: ``ipc``,
    ``cma``, ``shm``, ``relay`` or ``broadcast``)."""


@dataclass
class PublishHandle:
    """``staged``: the trainer may change its weights. ``delivered``: every rollout that took
    part holds ``version`` (its result is the version); ``absent`` names the rollouts found
    dead before the round, which did not take part. Both are ``concurrent.futures.Future``;
    ``timings`` fills in as they resolve."""

    version: int
    staged: Future[None] = field(default_factory=Future)
    delivered: Future[int] = field(default_factory=Future)
    timings: PublishTimings = field(default_factory=PublishTimings)
    absent: dict[int, str] = field(default_factory=dict)
    """Rollouts left out of this publish because they were found dead, with why."""
    started: float = field(default_factory=time.perf_counter, repr=False)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def wait(self, timeout: float | None = None) -> int:
        return self.delivered.result(timeout)


class WeightPublisher:
    """Publishes named tensors from ``trainer_ranks`` to ``rollout_ranks`` over ``group``.

    Every trainer rank constructs one (with the same arguments) and calls :meth:`publish`
    with the same names, shapes, dtypes and version. Construction settles the kind of
    transport with the rollouts (over ``ipc`` and ``cma`` it waits, up to the group's
    timeout, for them to try opening a buffer it shares or reading this process's memory);
    the transport itself is built for the rollouts of the first round, and again whenever
    they change.

    ``transport``: ``"auto"`` picks ``"ipc"`` when every rollout shares this host (and
    could open a buffer this rank shared, else ``"shm"`` for host weights and
    ``"broadcast"`` for device weights): this rank's bucket slots are shared once through
    torch's tensor sharing (shared memory, or CUDA IPC when the group's device is a GPU)
    and the rollouts copy straight out of them.
    ``"cma"`` (rollouts copy out of this process's memory, where the kernel lets them read
    it) and ``"shm"`` (a ring in a shared-memory file) serve host weights on one host when
    asked for. Across hosts ``"auto"`` picks ``"relay"`` (this
    rank sends each message once, to the first rollout, and each rollout passes it on to
    the next) for host tensors and ``"broadcast"`` (one collective per message) for device
    tensors. :attr:`transport` holds the choice. Over relay and broadcast, a slice of at
    least ``separate_min_bytes`` travels as a message of its own, straight from the
    trainer's tensor into the rollout's, skipping the bucket copy on both sides; smaller
    slices are packed into buckets. ``"auto"`` means 1 MiB over relay and 16 MiB over
    broadcast (where a message costs more); ``None`` packs everything.

    ``delta`` (host weights): keep the bytes the rollouts hold as a base (the cache in
    ``cached`` mode, a copy of the last version sent in ``direct`` mode, see
    :attr:`base_bytes`) and send each owned bucket as its changed 8-byte words where that
    is at most a quarter of its bytes (:mod:`.layout.delta`); rollouts apply deltas in place and
    only onto the exact base they were computed from. Left out (``None``), it is on in
    ``cached`` mode, whose cache is the base, and off in ``direct`` mode, where the base
    would be a second copy of the weights and publishes would no longer send straight
    from the tensors: pass ``delta=True`` there to trade that memory for fewer bytes.

    ``channel`` names this publisher/subscriber set: its store keys, process groups and
    shared-memory ring are its own, so several sets (several models) run on one group at
    once. Left out, it is numbered in creation order among this process's unnamed sets of the
    same trainer and rollout ranks: every rank must then create them in the same order (or
    pass the same names). :attr:`channel` holds the name.

    Tensors published under several names (sharing storage, offset, shape, stride and
    dtype, e.g. tied embeddings in ``model.state_dict()``) are sent once; the plan lists
    their other names and the rollouts apply them under each.

    Invariants: versions strictly increase (a repeated or lower one is refused before
    anything is sent); a round starts only once every rollout not
    found dead asked for it; ``staged`` resolves only after the last byte this rank reads
    from the caller's tensors has been copied, sent or read by every member.
    """

    def __init__(
        self,
        group: SyncGroup,
        trainer_ranks: Sequence[int],
        rollout_ranks: Sequence[int],
        bucket_bytes: int = 64 * 2**20,
        mode: str = "direct",
        transport: str = "auto",
        num_slots: int = 2,
        timeout: float | None = None,
        channel: str | None = None,
        history: int = 8,
        separate_min_bytes: int | None | Literal["auto"] = "auto",
        delta: bool | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if group.rank not in trainer_ranks:
            raise ValueError(f"rank {group.rank} is not among trainer_ranks {list(trainer_ranks)}")
        if set(trainer_ranks) & set(rollout_ranks):
            raise ValueError("a rank cannot be both a trainer and a rollout")
        if num_slots < 2:
            raise ValueError("num_slots must be at least 2 to overlap packing and sending")
        self.group = group.open_channel(channel, trainer_ranks, rollout_ranks)
        self.channel = self.group.channel_name.removeprefix("channel/")
        self.rank = group.rank
        self.trainer_ranks = list(trainer_ranks)
        self.rollout_ranks = list(rollout_ranks)
        self.leader = self.trainer_ranks[0]
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.timeout = group.timeout if timeout is None else timeout
        self.history = history
        if delta is None:  # on where the base costs nothing more: the cache is the base
            delta = mode == "cached"
        self.delta = delta and self.group.device.type == "cpu"
        self._differ = Differ() if self.delta else None
        self._plain_publishes = 0
        self._versions = RolloutVersions(self.rollout_ranks)
        self.bytes_sent = 0
        self.peak_gathered_bytes = 0
        self._round = 0
        self._last_version: int | None = None
        self._plan: BucketPlan | None = None
        #: a trainer's rank in the default process group -> its trainer rank here
        self._trainer_of: dict[int, int] | None = None
        if dist.is_available() and dist.is_initialized():  # read at the first DTensor plan
            self.group.post(Keys.world_rank(self.rank), str(dist.get_rank()))
        self._announced: set[str] = set()
        self._checksums: dict[int, dict[int, int]] = {}
        self._last_round: Future[int] | None = None
        self._jobs: queue.Queue[tuple[Callable[[], int], PublishHandle, int] | None] = queue.Queue()
        self.state = PublisherState.OPEN
        self._offer = negotiate(
            self.group,
            self.rollout_ranks,
            candidates(self.group, transport, self.rollout_ranks),
            mode,
            bucket_bytes,
            num_slots,
            separate_min_bytes,
            self.timeout,
        )
        self.transport = self._offer.kind
        assert self._offer.shape is not None
        self.separate_min_bytes = self._offer.shape.separate_min
        self._rounds = TrainerRound(
            self.group,
            self.trainer_ranks,
            self.rollout_ranks,
            self._offer,
            self.timeout,
            self._versions,
        )
        self._cache = HostCache(self.rank, self.timeout)
        self._refetch = RefetchServer(
            self.group,
            self._cache,
            self.rollout_ranks,
            self.transport,
            separate_min_bytes,
            self.timeout,
            self._versions,
        )
        self._thread = threading.Thread(
            target=self._work, name="slipstream-sync-publisher", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------------------- publish
    @tracing.spanned("slipstream.sync.publish")
    def publish(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> PublishHandle:
        """Send ``named_tensors`` as ``version`` to every rollout not found dead.

        ``version``: left out (``None``), the next number: one more than the last version
        published, 0 for the first (:attr:`next_version`; ``handle.version`` holds it). A
        version given must be larger than the last: a repeated or lower one is refused with
        ``ValueError`` before anything is sent or read, and the publisher and the group stay
        as they were (a framework whose step numbers may repeat passes ``None``). So a
        rollout only ever moves forward: every version it holds is newer than the last.

        ``direct``: returns once nothing more is read from ``named_tensors`` (``staged``
        resolved): this rank packed its last bucket and the slices sent straight from the
        tensors have left; the packed buckets still in flight finish in the background.
        ``cached``: returns once the weights are snapshotted into the host cache; the worker
        thread sends from the cache. With deltas on (``delta=True``) each owned bucket is
        diffed against the bytes the rollouts hold and sent as its changed words where that
        is smaller (``handle.timings`` reports the dense bytes, the changed fraction and the
        diff's time). ``named_tensors`` may be (part of) a snapshot from
        :func:`slipstream.stage`: it is held, so not restaged, while this call reads it.

        Streaming: ``named_tensors`` that is neither a mapping nor a list or tuple (a
        generator, say one that gathers a ``full_tensor()`` per step) is read as it
        yields: buckets are packed and sent as their tensors come, and a yielded tensor is
        let go once its last bucket is packed, so about two buckets' worth of them are
        alive at once, never the whole model. Once a layout is known (from
        :meth:`set_layout` or the last publish) it must yield the layout's tensors in its
        order, under their names, shapes and dtypes (tied names may follow the tensor they
        share, and are skipped); anything else fails the publish with
        :class:`~slipstream.sync.LayoutMismatch` naming the tensor (the round is
        given up for every rollout, and the next publish goes on). Without a layout, in
        ``direct`` mode, the iterator's buckets describe it as they go
        (:mod:`.layout.described`): the layout it yields is this publisher's from then on. In
        ``cached`` mode the first iterator is read whole (as a mapping would be) and gives
        its layout.
        """
        if self.state is not PublisherState.OPEN:
            raise SyncError(f"publish on a WeightPublisher that is {self.state.name.lower()}")
        if version is None:
            version = self.next_version
        elif self._last_version is not None and version <= self._last_version:
            raise ValueError(
                f"versions must increase: got {version} after {self._last_version} (pass "
                f"version=None for the next one, {self.next_version}); nothing was sent"
            )
        iterator = not isinstance(named_tensors, (Mapping, Sequence))
        streamed = self._plan is not None and iterator
        layout: GrowingLayout | None = None
        items: Iterator[tuple[str, torch.Tensor]] = iter(())
        if self._plan is None and iterator and self.mode == "direct":
            any_item, items = nonempty(iter(cast(Iterable[Any], named_tensors)))
            if any_item:  # described: the layout travels with the buckets
                layout = GrowingLayout(self.bucket_bytes, self.trainer_ranks)
            named_tensors = items
        handle = PublishHandle(version)
        handle.timings.transport = self.transport
        self._wait_previous_round()
        sent_before = self._rounds.sent_bytes()
        snapshot = named_tensors if isinstance(named_tensors, Holdable) else None
        hold = snapshot.hold(f"publish of version {version}") if snapshot is not None else None
        try:
            job: Callable[[], int]
            if layout is not None:
                self._last_version = version
                job = self._publish_described(layout, items, version, handle)
            else:
                sources: Sources
                if streamed:
                    assert self._plan is not None
                    plan = self._plan
                    items = iter(cast(Iterable[Any], named_tensors))
                    sources = StreamSources(plan, items, self.rank)
                else:
                    specs, tensors = unique_tensors(named_items(named_tensors))
                    plan = self._plan_for(specs, self._holders(specs, tensors))
                    sources = BucketSources(plan, tensors, self.rank)
                self._last_version = version
                handle.timings.dense_bytes = self._dense_bytes(plan)
                if self.mode == "direct":

                    def send(requests: dict[int, Request]) -> None:
                        self._pack_and_send(plan, sources, requests, version, handle.timings)

                    job = self._run_direct(plan.plan_id, send, version, handle)
                    handle.timings.staged = handle.elapsed()
                    handle.staged.set_result(None)
                else:
                    differ = self._differ if self._plain_publishes == 0 else None
                    self._plain_publishes = max(0, self._plain_publishes - 1)
                    peak, deltas, stats = self._snapshot(plan, sources, version, differ)
                    # the round is taken once the snapshot is whole: a failed one starts none
                    k = self._round
                    self._round += 1
                    self.peak_gathered_bytes = max(self.peak_gathered_bytes, peak)
                    _record_diff(handle.timings, stats)
                    self._note_gain(stats)
                    handle.timings.staged = handle.elapsed()
                    handle.staged.set_result(None)
                    job = functools.partial(self._serve_cached, k, version, plan, handle, deltas)
        except BaseException as exc:
            fail_unfinished(exc, handle.staged, handle.delivered)
            raise
        finally:
            if snapshot is not None and hold is not None:
                snapshot.release(hold)
        self._last_round = handle.delivered
        self._jobs.put((job, handle, sent_before))
        handle.timings.blocked = handle.elapsed()
        return handle

    def set_rollouts(self, rollout_ranks: Sequence[int]) -> None:
        """Publish to ``rollout_ranks`` from the next publish on, on this channel.

        Rollouts join and leave without a new channel: a rank added (one past the group's
        first world size too, once it joined with :func:`.group.init_group`, see
        :mod:`.group`) builds its :class:`~slipstream.sync.WeightSubscriber` on this
        channel and takes part from the next publish on (every byte, since it holds no
        version), or in ``cached`` mode refetches the cache's version at once; a rank
        dropped is no longer waited for (its subscriber, if it lives on, receives nothing
        until it is added again, then what changed since the version it holds). Every
        trainer rank calls this with the same ranks, between publishes (it waits for the
        last round to be delivered). What the publisher keeps stays: the version, the plan,
        the host cache and delta base (rounds whose rollouts all hold it send deltas
        again), the checksums of the versions rollouts hold.

        The kind of transport negotiated when the publisher started stays: a colocated one
        (``cma``, ``shm``) needs every added rollout on this host (``ValueError`` names
        those that are not; open a new channel for them)."""
        ranks = list(rollout_ranks)
        if self.state is not PublisherState.OPEN:
            raise SyncError(f"set_rollouts on a WeightPublisher that is {self.state.name.lower()}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"a rollout rank appears twice in {ranks}")
        if set(ranks) & set(self.trainer_ranks):
            raise ValueError("a rank cannot be both a trainer and a rollout")
        self._wait_previous_round()
        added = [r for r in ranks if r not in self.rollout_ranks]
        if added and self.transport in LOCAL_TRANSPORTS:
            self.group.wait_joined(added, f"rollout rank(s) {added} to join the sync group")
            away = [r for r in added if not self.group.colocated([r])]
            if away:
                raise ValueError(
                    f"rollout rank(s) {away} are not on trainer rank {self.rank}'s host: "
                    f"channel {self.channel!r} publishes over {self.transport!r}, which "
                    "needs every rollout there; open a new channel for them"
                )
        self._versions.set_members(ranks)
        self.rollout_ranks = ranks
        self._rounds.rollout_ranks = list(ranks)
        self._refetch.set_rollouts(ranks)

    def _dense_bytes(self, plan: BucketPlan) -> int:
        return sum(plan.buckets[g].nbytes for g in plan.owned(self.rank))

    def _run_direct(
        self,
        plan_id: str,
        send: Callable[[dict[int, Request]], None],
        version: int,
        handle: PublishHandle,
    ) -> Callable[[], int]:
        """Start a ``direct`` round of ``plan_id`` and run ``send`` (given the members'
        requests) in it; return the job that waits for its acknowledgements."""
        k = self._round
        self._round += 1
        start, requests = self._rounds.start(k, version, plan_id)
        handle.absent = start.absent_ranks()
        self._rounds.guarded(k, start, lambda: send(requests))
        return functools.partial(self._rounds.finish, k, start)

    def _publish_described(
        self,
        layout: GrowingLayout,
        items: Iterator[tuple[str, torch.Tensor]],
        version: int,
        handle: PublishHandle,
    ) -> Callable[[], int]:
        """A described round (:mod:`.layout.described`): the layout is learned from ``items`` as
        they are sent and travels in the buckets' headers; then it is this publisher's
        plan, posted for rollouts that join later."""
        sources = DescribedSources(layout, items, self.rank)
        sums: dict[int, int] = {}

        def send(requests: dict[int, Request]) -> None:
            sums.update(self._send_described(layout, sources))

        job = self._run_direct(DESCRIBED, send, version, handle)
        plan = self._plan_for(layout.final().specs)
        self._remember(version, sums)
        handle.timings.dense_bytes = self._dense_bytes(plan)
        handle.timings.staged = handle.elapsed()
        handle.staged.set_result(None)
        return job

    def set_layout(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Fix the layout (names, global shapes, dtypes, ties) that streamed publishes must
        follow, from tensors shaped as the published ones will be: e.g. the model's
        ``state_dict()`` (DTensors give their global shape; meta tensors are fine, though
        their ties cannot be seen; DTensors placed by rows or columns, :mod:`.layout.holders`,
        are planned to be sent by shard). Nothing is read from their bytes and nothing is
        sent."""
        specs, tensors = unique_tensors(named_items(named_tensors))
        self._plan_for(specs, self._holders(specs, tensors))

    def _wait_previous_round(self) -> None:
        previous = self._last_round
        if previous is None:
            return
        try:
            previous.exception(timeout=self.timeout)
        except TimeoutError:
            raise PeerTimeoutError(
                f"trainer rank {self.rank}: the previous publish was not delivered within "
                f"{self.timeout:.1f} s; rollout versions: {self.rollout_versions}"
            ) from None

    def _holders(
        self, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor]
    ) -> Holders | None:
        """Which trainer sends which bytes of the DTensors among ``tensors`` (each its own
        shard's, :mod:`.layout.holders`); ``None`` when there are none."""
        if not any(is_dtensor(t) for t in tensors):
            return None
        if self._trainer_of is None:
            self._trainer_of = self._exchange_world_ranks()
        return holders_of(specs, tensors, self._trainer_of)

    def _exchange_world_ranks(self) -> dict[int, int]:
        """Each trainer's rank in the default process group -> its trainer rank here (posted
        by every trainer, when it made its publisher or now, and read by each once)."""
        self.group.post(Keys.world_rank(self.rank), str(dist.get_rank()))
        keys = {r: Keys.world_rank(r) for r in self.trainer_ranks}
        self.group.wait_keys(keys, "the trainers' ranks in their process group", self.timeout)
        return {int(self.group.read(key)): r for r, key in keys.items()}

    def _plan_for(self, specs: Sequence[TensorSpec], holders: Holders | None = None) -> BucketPlan:
        plan = self._plan
        if plan is None or plan.specs != tuple(specs) or plan.holders != holders:
            plan = BucketPlan.build(specs, self.bucket_bytes, self.trainer_ranks, holders)
            if plan.max_header_bytes > HEADER_CAP:
                raise ValueError(
                    f"a bucket holds {plan.max_header_bytes - 8} slices, more than "
                    f"{HEADER_CAP - 8}; use a smaller bucket_bytes"
                )
            self._plan = plan
            self._checksums.clear()
        if self.rank == self.leader and plan.plan_id not in self._announced:
            self.group.post(
                Keys.plan(plan.plan_id),
                layout_json(plan.specs, plan.bucket_bytes, plan.trainer_ranks, plan.holders),
            )
            self._announced.add(plan.plan_id)
        return plan

    def _unchanged_fn(self, helds: dict[int, int | None]) -> Callable[[int, int | None], bool]:
        held_sums = []
        for v in set(helds.values()):
            sums = self._checksums.get(v) if v is not None else None
            if sums is None:
                return lambda i, cs: False
            held_sums.append(sums)
        if not held_sums:
            return lambda i, cs: False
        return lambda i, cs: cs is not None and all(s.get(i) == cs for s in held_sums)

    def _remember(self, version: int, sums: dict[int, int]) -> None:
        self._checksums[version] = sums
        while len(self._checksums) > self.history:
            del self._checksums[min(self._checksums)]

    def _deltas_for(self, requests: dict[int, Request]) -> bool:
        """Whether this round's buckets may go as deltas: every member recorded the tokens
        of the version the base holds (so none restarted, missed it or refetched since)."""
        base = self._cache.base_version
        return (
            self.delta
            and base is not None
            and bool(requests)
            and all(q.delta_base == base for q in requests.values())
        )

    @tracing.spanned("slipstream.sync.publish.send")
    def _pack_and_send(
        self,
        plan: BucketPlan,
        sources: Sources,
        requests: dict[int, Request],
        version: int,
        timings: PublishTimings,
    ) -> None:
        if self.delta and self._plain_publishes == 0:
            self._diff_and_send(plan, sources, requests, version, timings)
            return
        if self.delta:  # deltas did not pay lately: the kept copy is not brought along
            self._plain_publishes -= 1
            self._cache.version = None
        sender = self._rounds.sender
        unchanged = self._unchanged_fn({r: q.held for r, q in requests.items()})
        stage = Pack(sender, self._rounds.routes, unchanged)
        peak = walk(plan, sources, self.rank, stage)
        if stage.sent_from_tensors and sender is not None:  # they read the caller's tensors
            sender.flush()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, peak)
        self._remember(version, stage.sums)

    @tracing.spanned("slipstream.sync.publish.send")
    def _send_described(self, layout: GrowingLayout, sources: DescribedSources) -> dict[int, int]:
        """Send a described round's buckets as ``sources`` grows ``layout``: bucket g
        leaves once every tensor that starts in it was read, with its description in its
        header; every slice is in its payload. Returns the slices' checksums."""
        sender = self._rounds.sender
        stage = Pack(sender, None, _never)
        peak = walk_described(layout, sources, self.rank, stage)
        if stage.sent_from_tensors and sender is not None:  # they read the caller's tensors
            sender.flush()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, peak)
        return stage.sums

    @tracing.spanned("slipstream.sync.publish.diff_and_send")
    def _diff_and_send(
        self,
        plan: BucketPlan,
        sources: Sources,
        requests: dict[int, Request],
        version: int,
        timings: PublishTimings,
    ) -> None:
        """``direct`` mode with deltas: bring each owned bucket of the kept copy (the base)
        to the new version, diffing it when every member holds the base, and send it (as
        a delta where that is smaller) before reading the next: diffing bucket g+1 overlaps
        bucket g on the wire. Nothing is sent from the caller's tensors."""
        cache = self._cache
        cache.acquire()
        try:
            cache.begin(plan)
            differ = self._differ if self._deltas_for(requests) else None
            stage = Refresh(
                cache,
                differ,
                self._rounds.sender,
                self._rounds.routes,
                self._unchanged_fn({r: q.held for r, q in requests.items()}),
                self.group.device,
                version,
            )
            peak = walk(plan, sources, self.rank, stage)
            cache.finish(plan, version)
        finally:
            cache.lock.release()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, peak)
        self._remember(version, stage.sums)
        _record_diff(timings, stage.stats)
        self._note_gain(stage.stats)

    @tracing.spanned("slipstream.sync.publish.snapshot")
    def _snapshot(
        self, plan: BucketPlan, sources: Sources, version: int, differ: Differ | None
    ) -> tuple[int, dict[int, BucketDelta | None], DeltaStats]:
        """``cached``: bring this rank's buckets of ``sources`` into the host cache, diffing
        them against the previous version when ``differ`` is given and the cache holds one
        of this plan. Returns the most DTensor bytes materialised at once, each owned
        bucket's delta (``None``: not diffed, or dense was smaller) and the diff stats."""
        cache = self._cache
        cache.acquire()
        try:
            cache.begin(plan)
            stage = Snapshot(cache, differ)
            peak = walk(plan, sources, self.rank, stage)
            cache.finish(plan, version)
            return peak, stage.deltas, stage.stats
        finally:
            cache.lock.release()

    def _note_gain(self, stats: DeltaStats) -> None:
        """After a diff in which no bucket gained, skip diffing for a while."""
        if stats.compared_words and not stats.delta_buckets:
            self._plain_publishes = PLAIN_AFTER_NO_GAIN

    def _serve_cached(
        self,
        k: int,
        version: int,
        plan: BucketPlan,
        handle: PublishHandle,
        deltas: dict[int, BucketDelta | None],
    ) -> int:
        start, requests = self._rounds.start(k, version, plan.plan_id, idle=self._poll_refetches)
        handle.absent = start.absent_ranks()

        @tracing.spanned("slipstream.sync.publish.send")
        def send() -> None:
            sender = self._rounds.sender
            if sender is None:
                return
            unchanged = self._unchanged_fn({r: q.held for r, q in requests.items()})
            with self._cache.lock:
                sums = serve_cached(
                    self._cache,
                    sender,
                    plan,
                    self.rank,
                    deltas if self._deltas_for(requests) else None,
                    unchanged,
                    self.group.device,
                    version,
                    self._rounds.routes,
                )
            self._remember(version, sums)

        self._rounds.guarded(k, start, send)
        return self._rounds.finish(k, start)

    # ------------------------------------------------------------------- worker thread
    def _work(self) -> None:
        poll = 0.05 if self.mode == "cached" else None
        while True:
            try:
                item = self._jobs.get(timeout=poll)
            except queue.Empty:
                self._poll_refetches()
                continue
            if item is None:
                return
            job, handle, sent_before = item
            try:
                version = job()
            except BaseException as exc:
                handle.delivered.set_exception(exc)
                continue
            timings = handle.timings
            self.bytes_sent = self._rounds.sent_bytes()
            timings.nbytes = self.bytes_sent - sent_before
            timings.delivered = handle.elapsed()
            changed = timings.changed_fraction
            logger.info(
                "trainer rank %d published version %d: %.3f GiB sent of %.3f GiB dense "
                "(%s of the words changed, diffed in %.3f s), blocked %.3f s, staged in "
                "%.3f s, delivered in %.3f s",
                self.rank,
                version,
                timings.nbytes / 2**30,
                timings.dense_bytes / 2**30,
                "not diffed" if changed is None else f"{changed:.2%}",
                timings.diff_seconds,
                timings.blocked or 0.0,
                timings.staged or 0.0,
                timings.delivered,
            )
            handle.delivered.set_result(version)

    def _poll_refetches(self) -> None:
        """Serve the rollouts that asked again. Whatever this raises is the asking
        rollout's trouble, never the worker's: it is logged and the worker goes on, so the
        publishes queued behind it still run."""
        try:
            self._refetch.poll()
        except Exception:
            logger.exception("trainer rank %d: looking for refetches failed", self.rank)

    @property
    def next_version(self) -> int:
        """The version a publish with ``version=None`` takes: one more than the last
        version published (0 before the first)."""
        return 0 if self._last_version is None else self._last_version + 1

    @property
    def base_bytes(self) -> int:
        """Host bytes kept as the base of deltas: in ``direct`` mode a copy of the last
        version sent (``delta=True``), in ``cached`` mode the cache itself."""
        return self._cache.nbytes

    @property
    def buffer_bytes(self) -> int:
        """Bytes of transfer buffers, host cache and kept base this publisher holds."""
        sender = self._rounds.sender.buffer_bytes if self._rounds.sender is not None else 0
        return sender + self._cache.nbytes

    @property
    def rollout_versions(self) -> dict[int, int | None]:
        """Per rollout, the version it acknowledged last (``None``: holds no complete
        version, or was left out as dead): a copy, consistent at one moment."""
        return self._versions.snapshot()

    def staleness(self) -> dict[int, int | None]:
        """Versions behind the last publish, per rollout (``None``: holds no complete version)."""
        last = self._last_version
        return {
            r: None if v is None or last is None else last - v
            for r, v in self.rollout_versions.items()
        }

    def close(self, timeout: float | None = None) -> None:
        """Finish queued rounds (up to ``timeout``, the publisher's when left out), stop and
        join the worker, free the transport and the host cache.

        When the worker is still running a round at the timeout, raises
        :class:`~slipstream.errors.PeerTimeoutError` and frees nothing it may still use:
        the publisher stays CLOSING (no publish is taken) and calling ``close`` again
        waits again, and frees everything once the worker ended. Once CLOSED, ``close``
        does nothing."""
        if self.state is PublisherState.CLOSED:
            return
        if self.state is PublisherState.OPEN:
            self.state = PublisherState.CLOSING
            self._jobs.put(None)
        wait = self.timeout if timeout is None else timeout
        self._thread.join(wait)
        if self._thread.is_alive():
            raise PeerTimeoutError(
                f"trainer rank {self.rank}: the publisher's worker did not finish within "
                f"{wait:.1f} s (a rollout is not receiving?); rollout versions: "
                f"{self.rollout_versions}; call close() again to keep waiting"
            )
        self._rounds.close()
        self._cache.clear()
        self.state = PublisherState.CLOSED

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Close; when the block raised, its error is the one that propagates and a
        failure to close is logged (and, on Python 3.11+, added to it as a note), never
        put in its place."""
        try:
            self.close()
        except Exception as close_error:
            if exc is None:
                raise
            logger.error(
                "trainer rank %d: closing the publisher failed: %s", self.rank, close_error
            )
            if sys.version_info >= (3, 11):
                exc.add_note(f"closing the publisher then failed too: {close_error}")


def _never(slice_index: int, checksum: int | None) -> bool:
    """No slice of a described round is left out: no rollout holds this layout yet."""
    return False


def _record_diff(timings: PublishTimings, stats: DeltaStats) -> None:
    """Put a publish's diff stats in its timings (nothing was diffed: left as they are)."""
    if stats.compared_words:
        timings.changed_fraction = stats.changed_fraction
    timings.diff_seconds = stats.seconds
