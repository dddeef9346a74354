"""The rollout side: :class:`WeightSubscriber`.

:meth:`WeightSubscriber.receive` runs on the caller's thread (the subscriber starts no
thread) and only uses the sync group's own store and process groups. One call takes part in
one round (see :mod:`.publisher`; asking for it, its epoch's receivers and naming who broke
it are :mod:`.round.rollout_round`'s): it asks for a version newer than the one it holds, checks
the plan against the target before any byte moves (:mod:`.rollout.sinks` say where bytes go),
receives bucket g while unpacking bucket g-1 (two reused buffers per trainer), then
acknowledges. Over relay or broadcast, slices
sent on their own land straight in their final place (the parameter, or the atomic stream
buffer) and are never copied again; over relay this rank also passes every message on to
the next rollout. :meth:`WeightSubscriber.refetch`
asks the trainers for the version in their caches again, without waiting for a publish.

Invariant: :attr:`WeightSubscriber.version` is either a version whose every byte reached the
target, or ``None``. A transfer that breaks part-way marks the subscriber as holding no
complete version (``version is None``) until a later receive completes; with
``atomic=True`` every byte is received into a host buffer first, so a broken transfer
leaves the target and ``version`` exactly as they were.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core import tracing
from ..core.buffers import StagingPool
from ..core.checksum import checksum
from ..errors import SyncError
from .group import SyncGroup
from .layout.delta import DELTA, BaseMismatch, apply_delta, decode_delta, root_token
from .layout.described import DESCRIBED, DESCRIBED_HEADER_BYTES, GrowingLayout
from .layout.plan import BucketPlan, decode_header, payload_offsets, plan_from_json
from .layout.runs import Runs
from .layout.segments import payload_segments, routed_segments
from .rollout.apply import (
    CallableTarget,
    Keeps,
    LoadWeights,
    ModuleTarget,
    NameMap,
    make_target,
    raise_problems,
)
from .rollout.sinks import BucketsSink, DrainSink, Sink, StreamSink, TargetSink
from .round.negotiation import NETWORK_TRANSPORTS, network_receiver, read_offer, unwatched
from .round.protocol import (
    Ack,
    AgainGo,
    AgainOffer,
    AgainRequest,
    Keys,
    RoundStart,
    Wants,
    encode,
    wants_of_plan,
)
from .round.rollout_round import RolloutRound
from .round.state import EpochState
from .transport.cma import CacheReader
from .transport.network import BroadcastReceiver, Pending, Receiver

logger = logging.getLogger(__name__)


class WeightSubscriber:
    """Receives the weights that ``trainer_ranks`` publish, on one of ``rollout_ranks``.

    Construct on every rollout rank while the trainers construct their publishers (each
    side waits for the other up to the group's timeout), with the publishers' ``channel``:
    left out on both sides, the n-th subscriber created for these trainer and rollout ranks
    meets the n-th publisher (see :class:`.publisher.WeightPublisher`).

    A process that replaced a dead rollout builds its subscriber the same way, after
    :func:`.group.init_group` with the old rank: the trainers' publishers go on, and its
    first :meth:`receive` takes part in the next publish (every byte), or its first
    :meth:`refetch` gets the version in the trainers' caches at once.
    """

    def __init__(
        self,
        group: SyncGroup,
        trainer_ranks: Sequence[int],
        rollout_ranks: Sequence[int],
        timeout: float | None = None,
        channel: str | None = None,
    ) -> None:
        if group.rank not in rollout_ranks:
            raise ValueError(f"rank {group.rank} is not among rollout_ranks {list(rollout_ranks)}")
        self.group = group.open_channel(channel, trainer_ranks, rollout_ranks)
        self.channel = self.group.channel_name.removeprefix("channel/")
        self.rank = group.rank
        self.trainer_ranks = list(trainer_ranks)
        self.rollout_ranks = list(rollout_ranks)
        self.leader = self.trainer_ranks[0]
        self.timeout = group.timeout if timeout is None else timeout
        #: payload bytes taken so far: over a transport read where it lies (``ipc``, ``shm``)
        #: only those this rank copied out (a tensor-parallel target's own box), else every
        #: byte that arrived
        self.bytes_received = 0
        self._version: int | None = None
        self._complete = False
        self._held_by: tuple[str, bool] | None = None
        self._plans: dict[str, BucketPlan] = {}
        self._pool = StagingPool()
        #: the wants this rank posted, by name (:meth:`_post_wants`)
        self._wants: dict[str, dict[int, Runs]] = {}
        self._assembly: dict[tuple[str, int], torch.Tensor] = {}
        self._offers = {t: read_offer(self.group, t, self.timeout) for t in self.trainer_ranks}
        self.transports: dict[int, str] = {t: o.kind for t, o in self._offers.items()}
        self.modes: dict[int, str] = {t: o.mode for t, o in self._offers.items()}
        self._rounds = RolloutRound(self.group, self.trainer_ranks, self._offers, self.timeout)
        self._tokens: dict[int, int] = {}
        """Each bucket's token (:mod:`.layout.delta`) as last applied in place, for plan
        ``_token_plan`` at version ``_delta_version`` (``None``: none recorded whole)."""
        self._token_plan: str | None = None
        self._delta_version: int | None = None
        self._items: list[tuple[str, torch.Tensor]] = []
        """What the running receive gathered for :meth:`receive_iter` to yield next."""

    @property
    def version(self) -> int | None:
        """The version this rank holds completely, or ``None``."""
        return self._version if self._complete else None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of receive buffers, atomic staging and reassembly buffers this rank holds."""
        receivers = sum(r.buffer_bytes for r in self._rounds.receivers.values())
        assembly = sum(t.numel() for t in self._assembly.values())
        return receivers + self._pool.live_bytes + assembly

    @property
    def complete(self) -> bool:
        """False from the first byte of a receive applied until that receive completes."""
        return self._complete

    def receive(
        self,
        target: nn.Module | LoadWeights,
        name_map: NameMap = None,
        atomic: bool = False,
        full: bool = False,
        keeps: Keeps | None = None,
        expect_version: int | None = None,
    ) -> int:
        """Wait for the next published version and apply it to ``target``; return it.

        ``name_map`` maps published names to the target's (a dict or a function; a name
        mapped to ``None`` is not applied). ``full=True`` asks for every byte (use it when
        ``target`` does not hold :attr:`version`, e.g. a fresh engine); otherwise tensors
        unchanged since the held version are not resent. ``keeps`` (a ``load_weights``
        target only): the part of a tensor it reads, by (mapped) name, a
        :class:`~slipstream.sync.Narrow`; only those bytes are received (over relay and
        broadcast, only those are sent), and the tensor passed holds them in that part,
        zeros elsewhere; or a function of the version's layout (``{name: (shape, dtype)}``)
        that returns them, called before any byte of a version with a new layout.
        ``expect_version``: the version this receive is for; a round of another one is
        refused (:class:`~slipstream.errors.SyncError`) before any byte is applied, so a
        caller that asks late never applies a later version under an earlier number.

        When another member of the round dies while it runs, raises
        :class:`~slipstream.errors.PeerDiedError` naming it within seconds (the target
        then holds no complete version, or with ``atomic=True`` its previous one).
        """
        with tracing.span("slipstream.sync.receive"):
            sink = make_target(target, name_map, self._assembly, keeps)
            rounds = self._receive(sink, atomic, full, expect_version)
            while True:
                try:
                    next(rounds)
                except StopIteration as done:
                    return int(done.value)

    def receive_iter(
        self, name_map: NameMap = None, atomic: bool = False, full: bool = False
    ) -> Generator[tuple[str, torch.Tensor], None, int | None]:
        """Wait for the next published version and yield it as ``(name, tensor)`` pairs,
        every name of every sent tensor (aliases too, the same tensor), as its buckets
        arrive; the generator returns the version (and :attr:`version` holds it).

        The round starts at the first ``next()``. Each tensor is a view of a receive or
        reassembly buffer, valid until the next item is asked for: copy what you keep.
        ``name_map`` and ``full`` are as for :meth:`receive`; unchanged tensors are not
        resent (so not yielded) unless ``full=True``. A broken round raises from
        ``next()`` as :meth:`receive` would raise it. ``atomic=True`` receives every byte
        into a host buffer before the first item: a broken round raises before any tensor
        of the version is yielded. Closing the generator early (``close()``, or
        ``contextlib.closing``) drains the rest of the round, so the group stays in step,
        and acknowledges it as not applied.
        """
        return self._receive(make_target(self._collect, name_map, self._assembly), atomic, full)

    async def areceive_iter(
        self, name_map: NameMap = None, atomic: bool = False, full: bool = False
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """:meth:`receive_iter` for asyncio callers: each step of the receive runs on one
        worker thread of its own (``slipstream-sync-receive``) while the event loop runs;
        the round advances only when the next item is awaited, so each item is valid until
        then. Closing it (or cancelling the consumer) drains the rest of the round on that
        thread, which is joined before it returns."""
        rounds = self.receive_iter(name_map, atomic, full)
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, thread_name_prefix="slipstream-sync-receive") as worker:
            try:
                while True:
                    item = await loop.run_in_executor(worker, _next_or_end, rounds)
                    if item is _END:
                        return
                    yield item  # type: ignore[misc]
            finally:  # after the step in flight (one thread), drain what is left
                await asyncio.shield(loop.run_in_executor(worker, rounds.close))

    def _collect(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self._items.extend(batch)

    def _receive(
        self,
        sink: ModuleTarget | CallableTarget,
        atomic: bool,
        full: bool,
        expect_version: int | None = None,
    ) -> Generator[tuple[str, torch.Tensor], None, int | None]:
        """One receive as a generator: it yields what the sink gathered for the caller
        (receive_iter's items) after each bucket, and returns the version received."""
        started = time.perf_counter()
        received_before = self.bytes_received
        held_key = (sink.kind, atomic)
        held = self.version if (not full and self._held_by == held_key) else None
        in_place = isinstance(sink, ModuleTarget) and not atomic
        delta_base = self._delta_version if (in_place and held is not None) else None
        network = self._offers[self.leader].kind in NETWORK_TRANSPORTS
        wants = self._post_wants(sink) if network else None
        partial = network and sink.keeps_part()
        k, start = self._rounds.join(held, delta_base, wants, partial)
        version = start.version
        base_tokens = self._tokens if self._token_plan == start.plan else {}
        self._forget_tokens()
        items = self._items
        items.clear()
        stopped = False
        try:
            layout = self._layout() if start.plan == DESCRIBED else None
            plan = self._plan(start.plan) if layout is None else layout.as_plan()
            runs = self._round_runs(k, start, plan, sink, wants, partial)
            problems = self._problems(plan, sink, version)
            if expect_version is not None and version != expect_version:
                problems.append(f"it was asked for version {expect_version}")
            if runs and not problems and self._partial_runs(sink, plan) != runs:
                problems.append("its tensors' shards changed since it asked for this version")
            if problems:  # drain the round so the group stays usable, apply nothing
                drain = _Round(plan, DrainSink(), self._rounds.receivers, layout=layout, runs=runs)
                self._transfer(k, drain)
                raise_problems(problems, version, self.rank)
            rnd = _Round(
                plan,
                self._sink(plan, sink, atomic, layout),
                self._rounds.receivers,
                version=version,
                layout=layout,
                target=sink,
                runs=runs,
            )
            if in_place:
                rnd.base_tokens, rnd.tokens = base_tokens, {}
            if atomic:  # every byte in the host buffer before the first item
                self._transfer(k, rnd)
            else:
                self._complete = False
            pipeline = _Pipeline(self, rnd)
            while True:
                if items and not stopped:
                    try:
                        yield from items
                    except GeneratorExit:  # drain the rest of the round, yield nothing more
                        stopped = True
                items.clear()
                if atomic or not self._rounds.guarded(k, pipeline.step, pipeline.forget):
                    break
            if rnd.refused is not None:  # drained to the end of the round: raise it now
                raise rnd.refused
            if stopped:
                raise SyncError(
                    f"rollout rank {self.rank}: the consumer stopped before the last tensor "
                    f"of version {version}"
                )
        except BaseException as exc:
            items.clear()
            broken = self._rounds.state is EpochState.BROKEN  # the transport was let go
            self._rounds.ack_round(k, Ack(self.version, str(exc)[:2000], broken))
            if stopped:
                return None
            raise
        if layout is not None:  # the layout is whole: from now on it is a plan like any
            plan = layout.final()
            self._plans = {plan.plan_id: plan}
            if isinstance(sink, CallableTarget):
                sink.adopt(plan.plan_id)
            if rnd.tokens is not None:
                rnd.tokens = {g: root_token(plan.plan_id, g, version) for g in rnd.tokens}
        whole = not isinstance(sink, ModuleTarget) or sink.whole  # shards take no deltas
        if rnd.tokens is not None and len(rnd.tokens) == len(plan.buckets) and whole:
            self._tokens, self._token_plan, self._delta_version = rnd.tokens, plan.plan_id, version
        self._hold(version, held_key)
        self._rounds.ack_round(k, Ack(version))
        self._log("received", version, received_before, started)
        return version

    def _post_wants(self, sink: ModuleTarget | CallableTarget) -> str | None:
        """When ``sink`` keeps only part of the last plan's tensors (a tensor-parallel
        target): post which bytes it keeps (once per layout) and return the name its
        request gives them; else ``None``."""
        plan = next(iter(self._plans.values()), None)
        if plan is None or sink.check(plan):
            return None
        runs = self._partial_runs(sink, plan)
        if not runs:
            return None
        text = _wants_text(plan, runs)
        token = f"{plan.plan_id}-{checksum(text.encode()):016x}"
        if token not in self._wants:
            self.group.post(Keys.wants(self.rank, token), text)
            self._wants[token] = runs
        return token

    @staticmethod
    def _partial_runs(sink: ModuleTarget | CallableTarget, plan: BucketPlan) -> dict[int, Runs]:
        """The runs of each tensor of ``plan`` (checked against ``sink``) it keeps in part."""
        stages = sink.stages(plan).items()
        return {i: d.runs for i, d in sorted(stages) if not d.runs.whole}

    def _round_runs(
        self,
        k: int,
        start: RoundStart,
        plan: BucketPlan,
        sink: ModuleTarget | CallableTarget,
        wants: str | None,
        partial: bool,
    ) -> dict[int, Runs] | None:
        """The runs this rank is sent in round ``k`` (laid out by ``plan``): ``None`` when
        it is not routed; the ones it asked with when they are of the plan; when it said it
        may keep part, those it keeps of the plan, posted now for the trainers (every byte,
        posted as such, when ``sink`` does not fit the plan: the round is then drained);
        else none (every byte)."""
        if not start.routed:
            return None
        token = wants_of_plan(wants, start.plan)
        if token is not None:
            return self._wants[token]
        if not partial:
            return {}
        runs: dict[int, Runs] = {}
        try:
            if not sink.check(plan):
                runs = self._partial_runs(sink, plan)
        finally:  # the trainers wait for it before they send
            self.group.post(Keys.round_wants(self.rank, k), _wants_text(plan, runs))
        return runs

    def _forget_tokens(self) -> None:
        self._tokens, self._token_plan, self._delta_version = {}, None, None

    def _transfer(self, k: int, rnd: _Round) -> None:
        """Receive (and apply) a round; when it breaks, drop the epoch's receivers and
        raise naming the rank that broke it."""
        self._rounds.guarded(k, lambda: self._take(rnd), rnd.forget_receivers)

    @tracing.spanned("slipstream.sync.refetch")
    def refetch(
        self,
        target: nn.Module | LoadWeights,
        name_map: NameMap = None,
        atomic: bool = False,
    ) -> int:
        """Fetch again, every byte, the version the trainers hold in their host caches, without
        waiting for a publish; apply it to ``target`` and return it.

        For a rollout whose weights were lost or left incomplete (a restarted engine, a
        broken transfer). The trainers must publish in ``cached`` mode; their worker threads
        serve the request while the trainers train. Raises :class:`SyncError` (and applies
        nothing) when a trainer cannot serve it: ``direct`` mode, nothing published yet, or a
        newer version being snapshotted, which :meth:`receive` then delivers.
        """
        direct = [t for t, mode in self.modes.items() if mode != "cached"]
        if direct:
            raise SyncError(
                f"rollout rank {self.rank} cannot refetch: trainer rank(s) {direct} publish in "
                "direct mode and keep no copy to serve again (use mode='cached', or receive() "
                "the next publish)"
            )
        started = time.perf_counter()
        received_before = self.bytes_received
        sink = make_target(target, name_map, self._assembly)
        self._forget_tokens()  # the cache's bytes come without their tokens: dense next
        n = self.group.count(Keys.again_count(self.rank), 1) - 1
        offers = self._ask_again(n)
        first = next(iter(offers.values()))
        version, plan_id = first.version, first.plan
        problems = [f"plan {plan_id} could not be read"]
        try:
            plan = self._plan(plan_id)
            problems = self._problems(plan, sink, version)
        finally:
            self.group.post(Keys.again_go(self.rank, n), encode(AgainGo(not problems)))
        raise_problems(problems, version, self.rank)
        receivers = {t: self._refetch_receiver(t, plan, o) for t, o in offers.items()}
        ack_key = Keys.again_ack(self.rank, n)
        try:
            self._take(_Round(plan, self._sink(plan, sink, atomic), receivers))
        except BaseException as exc:
            self._rounds.ack(ack_key, Ack(self.version, str(exc)[:2000]))
            for t, o in offers.items():
                if o.cache is None:
                    self.group.drop_subgroup([t, self.rank], self._again_tag(), broken=True)
            raise
        finally:
            for receiver in receivers.values():
                receiver.close()
        self._hold(version, (sink.kind, atomic))
        self._rounds.ack(ack_key, Ack(version))
        self._log("refetched", version, received_before, started)
        return version

    def _again_tag(self) -> str:
        return f"again-i{self.group.incarnation}"

    def _refetch_receiver(self, trainer: int, plan: BucketPlan, offer: AgainOffer) -> Receiver:
        """Read a colocated trainer's cache directly where it offers that, else receive its
        messages over a group of the two of us."""
        cache = offer.cache
        if cache is None:
            assert offer.shape is not None
            relay = offer.kind == "relay"
            return network_receiver(
                self.group,
                trainer,
                [self.rank],
                offer.shape,
                relay,
                self._again_tag(),
                self.timeout,
                unwatched,
            )
        offsets = {int(g): off for g, off in cache.offsets.items()}
        return CacheReader(trainer, cache.pid, plan, cache.address, offsets)

    def _ask_again(self, n: int) -> dict[int, AgainOffer]:
        """Ask every trainer to serve its cache again (request ``n``); return their offers,
        which name one version and plan. When a trainer cannot serve, or the caches hold
        different versions, tell the trainers not to send and raise."""
        # a ticket orders this request among every rollout's: the trainers serve them in
        # that one order, so two rollouts refetching at once never wait on each other
        ticket = self.group.count(Keys.ASK_AGAIN_COUNT, 1)
        request = AgainRequest(self.group.incarnation, self.rank, n)
        self.group.post(Keys.again_ticket(ticket), encode(request))
        offers = {
            t: AgainOffer.read(
                self.group.get_text(
                    Keys.again_offer(self.rank, n, t),
                    t,
                    f"trainer rank {t} to answer a refetch",
                    self.timeout,
                )
            )
            for t in self.trainer_ranks
        }
        problems = [f"trainer rank {t}: {o.error}" for t, o in offers.items() if o.error]
        versions = {t: (o.version, o.plan) for t, o in offers.items() if not o.error}
        if not problems and len(set(versions.values())) > 1:
            held = {t: v for t, (v, _) in versions.items()}
            problems.append(f"the trainers' caches differ ({held}): receive() the new version")
        if problems:
            self.group.post(Keys.again_go(self.rank, n), encode(AgainGo(False)))
            raise SyncError(f"rollout rank {self.rank} cannot refetch: " + "; ".join(problems))
        return offers

    def _problems(self, plan: BucketPlan, sink: ModuleTarget | CallableTarget, version: int):
        """Why ``version`` (laid out by ``plan``) cannot be applied to ``sink``, if at all."""
        problems = sink.check(plan)
        if self._version is not None and version < self._version:
            problems.insert(0, f"it holds the newer version {self._version}")
        return problems

    def _take(self, rnd: _Round) -> None:
        """Receive a round and apply it; the held version is incomplete from the first byte
        applied until the caller records the new one."""
        if not rnd.sink.buffered:
            self._complete = False
        pipeline = _Pipeline(self, rnd)
        while pipeline.step():
            pass
        self._complete = False
        rnd.sink.finish()

    def _sink(
        self,
        plan: BucketPlan,
        target: ModuleTarget | CallableTarget,
        atomic: bool,
        layout: GrowingLayout | None = None,
    ) -> Sink:
        if not atomic:
            return TargetSink(plan, target)
        return StreamSink(plan, target, self._pool) if layout is None else BucketsSink(plan, target)

    def _layout(self) -> GrowingLayout:
        """The layout a described round grows as its headers arrive."""
        shape = self._offers[self.leader].shape
        assert shape is not None
        return GrowingLayout(shape.bucket_bytes, self.trainer_ranks)

    def _learn(self, rnd: _Round, g: int, header: torch.Tensor) -> None:
        """In a described round, read bucket ``g``'s header into the layout (once) and
        check the tensors it adds against the target: a mismatch is refused, the rest of
        the round drained, nothing more applied."""
        layout = rnd.layout
        if layout is None:
            return
        first = len(layout.specs)
        if not layout.learn(g, header, layout.owner(g)) or rnd.target is None:
            return
        if rnd.refused is None and not isinstance(rnd.sink, DrainSink):
            problems = rnd.target.check(rnd.plan, first)
            if problems:
                error = SyncError(
                    f"rollout rank {self.rank} rejected version {rnd.version} at bucket {g} "
                    f"(buckets before it were applied): " + "; ".join(problems)
                )
                rnd.refused, rnd.sink, rnd.tokens = error, DrainSink(), None

    def _mask(self, rnd: _Round, g: int, header: torch.Tensor) -> list[int]:
        """Bucket ``g``'s include mask (every slice, in a described round)."""
        slices = rnd.plan.bucket_slices(g)
        if rnd.layout is not None:
            return [1] * len(slices)
        return decode_header(header, len(slices))[1]

    def _hold(self, version: int, held_key: tuple[str, bool]) -> None:
        self._version = version
        self._complete = True
        self._held_by = held_key

    def _log(self, what: str, version: int, received_before: int, started: float) -> None:
        logger.info(
            "rollout rank %d %s version %d: %.3f GiB in %.3f s (waiting included)",
            self.rank,
            what,
            version,
            (self.bytes_received - received_before) / 2**30,
            time.perf_counter() - started,
        )

    def _plan(self, plan_id: str) -> BucketPlan:
        leader = self.leader
        plan = self._plans.get(plan_id)
        if plan is None:
            meta = self.group.get_text(Keys.plan(plan_id), leader, f"plan {plan_id}", self.timeout)
            plan = plan_from_json(meta.decode())
            if plan.plan_id != plan_id:
                raise SyncError(f"plan {plan_id} from trainer rank {leader} does not match its id")
            self._plans = {plan_id: plan}
        return plan

    def _place(
        self,
        rnd: _Round,
        g: int,
        separate_min: int | None,
        header: torch.Tensor,
        payload: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Where bucket ``g``'s payload segments land: a slice sent on its own goes straight
        to its final bytes when it has some on this device (recorded in ``rnd.landed``)."""
        self._learn(rnd, g, header)
        slices = rnd.plan.bucket_slices(g)
        mask = self._mask(rnd, g, header)
        if mask and mask[0] == DELTA:  # one segment, applied from the receive buffer
            return [payload]
        buffers = []
        for seg in payload_segments(slices, mask, separate_min):
            dest = None if seg.slice is None else rnd.sink.land(g, slices[seg.slice])
            if dest is not None and seg.slice is not None and dest.device == payload.device:
                rnd.landed.add((g, seg.slice))
                buffers.append(dest)
            else:
                buffers.append(payload[seg.start : seg.start + seg.nbytes])
        return buffers

    def _place_routed(
        self, rnd: _Round, g: int, header: torch.Tensor, payload: torch.Tensor
    ) -> list[torch.Tensor]:
        """Where this rank's segments of bucket ``g`` land in a routed round: each slice's
        kept bytes straight into their final place where the sink has one here."""
        assert rnd.runs is not None
        slices = rnd.plan.bucket_slices(g)
        segments, _ = routed_segments(slices, self._mask(rnd, g, header), rnd.runs)
        buffers = []
        for seg in segments:
            assert seg.slice is not None
            s = slices[seg.slice]
            partial = s.tensor in rnd.runs
            dest = rnd.sink.land_kept(g, s) if partial else rnd.sink.land(g, s)
            if dest is not None and dest.device == payload.device:
                rnd.landed.add((g, seg.slice))
                buffers.append(dest)
            else:
                buffers.append(payload[seg.start : seg.start + seg.nbytes])
        return buffers

    def _unpack_routed(self, rnd: _Round, g: int, header: torch.Tensor, payload: torch.Tensor):
        """Apply bucket ``g`` of a routed round: of each slice, the bytes this rank keeps."""
        assert rnd.runs is not None
        slices = rnd.plan.bucket_slices(g)
        mask = self._mask(rnd, g, header)
        segments, size = routed_segments(slices, mask, rnd.runs)
        if size != payload.numel():
            raise SyncError(
                f"bucket {g} from trainer rank {rnd.plan.buckets[g].owner} holds "
                f"{payload.numel()} bytes for rollout rank {self.rank}, its share is {size}"
            )
        self.bytes_received += sum(seg.nbytes for seg in segments)  # each its own message
        if rnd.tokens is not None:
            rnd.tokens[g] = root_token(rnd.plan.plan_id, g, rnd.version)
        at = {seg.slice: seg for seg in segments}
        sink = rnd.sink
        for k, s in enumerate(slices):
            seg = at.get(k)
            if seg is None:  # left out as unchanged, or nothing of it is kept here
                sink.take(g, s, None, False)
                continue
            data = payload[seg.start : seg.start + seg.nbytes]
            landed = (g, k) in rnd.landed
            if s.tensor in rnd.runs:
                sink.take_kept(g, s, data, landed)
            else:
                sink.take(g, s, data, landed)
        sink.bucket_done(g)

    @tracing.spanned("slipstream.sync.receive.bucket")
    def _unpack(self, rnd: _Round, g: int, pending: Pending) -> None:
        plan = rnd.plan
        header, payload = pending.finish()
        if rnd.runs is not None:
            self._unpack_routed(rnd, g, header, payload)
            return
        self._learn(rnd, g, header)
        slices = plan.bucket_slices(g)
        mask = self._mask(rnd, g, header)
        if mask and mask[0] == DELTA:
            self._apply_delta(rnd, g, payload)
            return
        if rnd.tokens is not None:
            rnd.tokens[g] = root_token(plan.plan_id, g, rnd.version)
        offsets, size = payload_offsets(slices, mask)
        if size != payload.numel():
            raise SyncError(
                f"bucket {g} from trainer rank {plan.buckets[g].owner} holds "
                f"{payload.numel()} bytes, the plan expects {size}"
            )
        sink = rnd.sink
        in_place = rnd.receivers[rnd.owner(g)].reads_in_place
        for k, (s, keep, off) in enumerate(zip(slices, mask, offsets, strict=True)):
            data = payload[off : off + s.nbytes] if keep else None
            if in_place and keep:
                self.bytes_received += sink.kept(g, s)
            sink.take(g, s, data, (g, k) in rnd.landed)
        if not in_place:
            self.bytes_received += size
        sink.bucket_done(g)

    @tracing.spanned("slipstream.sync.receive.apply_delta")
    def _apply_delta(self, rnd: _Round, g: int, message: torch.Tensor) -> None:
        """Apply bucket ``g``'s delta in place, once its base is checked to be the bytes
        this rank holds (a delta for other bytes is refused, nothing applied)."""
        self.bytes_received += message.numel()
        if isinstance(rnd.sink, DrainSink):
            return
        owner = rnd.plan.buckets[g].owner
        header, payload = decode_delta(message)
        where = f"rollout rank {self.rank}, bucket {g} from trainer rank {owner}"
        sink = rnd.sink
        if (
            rnd.tokens is None
            or not isinstance(sink, TargetSink)
            or not isinstance(sink.target, ModuleTarget)
        ):
            raise SyncError(f"{where}: a delta arrived for a receive that takes dense bytes only")
        try:
            header.check_base(rnd.base_tokens.get(g), where)
        except BaseMismatch as exc:  # apply nothing more; drain the round, stay in step
            rnd.refused, rnd.sink, rnd.tokens = exc, DrainSink(), None
            return
        apply_delta(payload, header.count, rnd.plan.bucket_slices(g), sink.target.views)
        rnd.tokens[g] = header.token

    def close(self) -> None:
        """Unmap shared memory and free buffers (the group stays open)."""
        self._rounds.drop_receivers()
        self._pool.clear()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pipeline:
    """A round's buckets, received in order: each :meth:`step` starts the receive of
    bucket g and unpacks bucket g-1 meanwhile. The buffer of the bucket last unpacked is
    handed back only at the next step, so what it yielded stays valid until then."""

    def __init__(self, subscriber: WeightSubscriber, rnd: _Round) -> None:
        self.subscriber = subscriber
        self.rnd = rnd
        self.next = 0
        self.pending: tuple[int, Pending] | None = None
        self.unpacked: Pending | None = None

    @tracing.spanned("slipstream.sync.receive.transfer")
    def step(self) -> bool:
        """One step; ``False`` once every bucket was unpacked (nothing was done)."""
        if self.unpacked is not None:
            self.unpacked.release()
            self.unpacked = None
        rnd = self.rnd
        exists = rnd.exists(self.next)
        if exists is None:  # a described round: the pending bucket's header tells
            assert self.pending is not None
            self.subscriber._unpack(rnd, *self.pending)
            self.unpacked, self.pending = self.pending[1], None
            return True
        current = None
        if exists:
            g = self.next
            receiver = rnd.receivers[rnd.owner(g)]
            after = g + len(self.subscriber.trainer_ranks)  # the same owner's next bucket
            following = rnd.header_bytes(after) if rnd.exists(after) else None
            if rnd.runs is None:
                place = functools.partial(self.subscriber._place, rnd, g, receiver.separate_min)
                current = (g, receiver.start(rnd.header_bytes(g), following, place))
            else:  # routed: this rank's own bytes, straight from the trainer
                assert isinstance(receiver, BroadcastReceiver)
                place = functools.partial(self.subscriber._place_routed, rnd, g)
                current = (g, receiver.start_routed(rnd.header_bytes(g), following, place))
            self.next += 1
        pending, self.pending = self.pending, current
        if pending is None:
            return current is not None
        self.subscriber._unpack(rnd, *pending)
        self.unpacked = pending[1]
        return True

    def forget(self) -> None:
        """Let go of the messages in flight and the receivers (the round broke: nothing
        here may keep their connections open, or a member blocked on them waits)."""
        self.pending = self.unpacked = None
        self.rnd.forget_receivers()


_END = object()


def _next_or_end(items: Iterator[tuple[str, torch.Tensor]]) -> object:
    """The next item, or ``_END`` (a StopIteration cannot cross a future)."""
    return next(items, _END)


@dataclass
class _Round:
    """One receive: its plan, where its bytes go (``sink``), its receiver per trainer, and
    the slices (bucket, index in the bucket) that landed in their final place on arrival."""

    plan: BucketPlan
    sink: Sink
    receivers: dict[int, Receiver]
    landed: set[tuple[int, int]] = field(default_factory=set)
    version: int = 0
    base_tokens: dict[int, int] = field(default_factory=dict)
    """Each bucket's token before this round (what a delta must be computed from)."""
    tokens: dict[int, int] | None = None
    """Each bucket's token as this round leaves it; ``None``: not recorded (dense only)."""
    refused: Exception | None = None
    """A delta refused for its base, or a described round's tensor for the target: the rest
    of the round was drained, nothing more applied."""
    layout: GrowingLayout | None = None
    """A described round's layout, grown as its headers arrive (``plan`` reads it)."""
    target: ModuleTarget | CallableTarget | None = None
    runs: dict[int, Runs] | None = None
    """A routed round's (:attr:`.round.protocol.RoundStart.routed`): the runs of each tensor
    this rank is sent in part (the others whole); ``None``: not routed."""

    def owner(self, g: int) -> int:
        return self.plan.buckets[g].owner if self.layout is None else self.layout.owner(g)

    def header_bytes(self, g: int) -> int:
        if self.layout is not None:
            return DESCRIBED_HEADER_BYTES
        return self.plan.buckets[g].header_bytes

    def exists(self, g: int) -> bool | None:
        """Whether bucket ``g`` exists (``None``: a described round's header before it
        must be read first)."""
        return g < len(self.plan.buckets) if self.layout is None else self.layout.exists(g)

    def forget_receivers(self) -> None:
        """Let go of the receivers (the round broke: their connections must close)."""
        self.receivers = {}


def _wants_text(plan: BucketPlan, runs: dict[int, Runs]) -> str:
    return encode(Wants(plan.plan_id, {str(i): r.to_list() for i, r in runs.items()}))
