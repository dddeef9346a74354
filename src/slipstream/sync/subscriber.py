"""The rollout side: :class:`WeightSubscriber`.

:meth:`WeightSubscriber.receive` runs on the caller's thread (the subscriber starts no
thread) and only uses the sync group's own store and process groups. One call takes part in
one round (see :mod:`.publisher`): it asks for a version newer than the one it holds, checks
the plan against the target before any byte moves, receives bucket g while unpacking bucket
g-1 (two reused buffers per trainer), then acknowledges. Over relay or broadcast, slices
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

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core import process_memory
from ..core.buffers import StagingPool
from ..core.copy import copy_in_slices
from ..errors import SyncError
from .apply import CallableTarget, LoadWeights, ModuleTarget, NameMap, make_target, raise_problems
from .cma import CacheReader, CmaReceiver
from .group import SyncGroup
from .packing import payload_segments
from .plan import BucketPlan, Slice, decode_header, payload_offsets, plan_from_json
from .publisher import ASK_AGAIN_COUNT, NETWORK_TRANSPORTS
from .shm import ShmReceiver
from .transport import BroadcastReceiver, Pending, Receiver

logger = logging.getLogger(__name__)


class WeightSubscriber:
    """Receives the weights that ``trainer_ranks`` publish, on one of ``rollout_ranks``.

    Construct on every rollout rank while the trainers construct their publishers (each
    side waits for the other up to the group's timeout), with the publishers' ``channel``:
    left out on both sides, the n-th subscriber created for these trainer and rollout ranks
    meets the n-th publisher (see :class:`.publisher.WeightPublisher`).
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
        self.timeout = group.timeout if timeout is None else timeout
        self.bytes_received = 0
        self._round = 0
        self._asked_again = 0
        self._version: int | None = None
        self._complete = False
        self._held_by: tuple[str, bool] | None = None
        self._plans: dict[str, BucketPlan] = {}
        self._pool = StagingPool()
        self._assembly: dict[tuple[str, int], torch.Tensor] = {}
        self.transports: dict[int, str] = {}
        self.modes: dict[int, str] = {}
        self._receivers: dict[int, Receiver] = {t: self._connect(t) for t in self.trainer_ranks}

    def _connect(self, trainer: int) -> Receiver:
        what = f"trainer rank {trainer}'s publisher"
        probe = self.group.get_json(f"transport/{trainer}/probe", trainer, what, self.timeout)
        if probe is not None:
            error = process_memory.probe(probe["pid"], probe["addr"], bytes(probe["bytes"]))
            self.group.set_json(f"transport/{trainer}/probed/{self.rank}", {"error": error})
        info = self.group.get_json(f"transport/{trainer}", trainer, what, self.timeout)
        if "error" in info:
            raise SyncError(f"rollout rank {self.rank}: {info['error']}")
        self.transports[trainer] = info["kind"]
        self.modes[trainer] = info["mode"]
        if info["kind"] in NETWORK_TRANSPORTS:
            return self._broadcast_receiver(trainer, self.rollout_ranks, info)
        ring_receiver = CmaReceiver if info["kind"] == "cma" else ShmReceiver
        receiver = ring_receiver(
            info["path"],
            self.rollout_ranks.index(self.rank),
            len(self.rollout_ranks),
            trainer,
            info["pid"],
            info["bucket_bytes"],
            info["header_cap"],
            info["num_slots"],
            self.timeout,
        )
        self.group.set_json(f"transport/{trainer}/opened/{self.rank}", True)
        return receiver

    def _broadcast_receiver(
        self, trainer: int, rollouts: Sequence[int], shape: dict
    ) -> BroadcastReceiver:
        """A receiver of what ``trainer`` sends over the group of ``trainer`` and
        ``rollouts``, with the buffers ``shape`` (the trainer's announcement) names, relayed
        along ``rollouts`` when ``shape`` says so."""
        members = [trainer, *rollouts]
        return BroadcastReceiver(
            self.group.subgroup(members),
            trainer,
            shape["bucket_bytes"],
            shape["header_cap"],
            shape["num_slots"],
            self.timeout,
            self.group.device,
            shape["separate_min"],
            chain=members if shape.get("kind") == "relay" else None,
        )

    @property
    def version(self) -> int | None:
        """The version this rank holds completely, or ``None``."""
        return self._version if self._complete else None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of receive buffers, atomic staging and reassembly buffers this rank holds."""
        receivers = sum(r.buffer_bytes for r in self._receivers.values())
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
    ) -> int:
        """Wait for the next published version and apply it to ``target``; return it.

        ``name_map`` maps published names to the target's (a dict or a function; a name
        mapped to ``None`` is not applied). ``full=True`` asks for every byte (use it when
        ``target`` does not hold :attr:`version`, e.g. a fresh engine); otherwise tensors
        unchanged since the held version are not resent.
        """
        started = time.perf_counter()
        received_before = self.bytes_received
        sink = make_target(target, name_map, self._assembly)
        held_key = (sink.kind, atomic)
        held = self.version if (not full and self._held_by == held_key) else None
        k = self._round
        self._round += 1
        self.group.set_json(f"req/{self.rank}/{k}", {"held": held})
        leader = self.trainer_ranks[0]
        info = self.group.get_json(
            f"round/{k}", leader, f"lead trainer rank {leader} to start round {k}", self.timeout
        )
        version = info["version"]
        try:
            plan = self._plan(info["plan"], leader)
            problems = self._problems(plan, sink, version)
            if problems:  # drain the round so the group stays usable, apply nothing
                self._receive_all(_Round(plan, sink, "drain", self._receivers))
                raise_problems(problems, version, self.rank)
            self._take(_Round(plan, sink, "stream" if atomic else "target", self._receivers))
        except BaseException as exc:
            self._ack(f"ack/{self.rank}/{k}", {"holds": self.version, "error": str(exc)[:2000]})
            raise
        self._hold(version, held_key)
        self._ack(f"ack/{self.rank}/{k}", {"holds": version})
        self._log("received", version, received_before, started)
        return version

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
        key = f"again/{self.rank}/{self._asked_again}"
        self._asked_again += 1
        offers = self._ask_again(key)
        version, plan_id = next((o["version"], o["plan"]) for o in offers.values())
        problems = [f"plan {plan_id} could not be read"]
        try:
            plan = self._plan(plan_id, self.trainer_ranks[0])
            problems = self._problems(plan, sink, version)
        finally:
            self.group.set_json(f"{key}/go", {"go": not problems})
        raise_problems(problems, version, self.rank)
        receivers = {t: self._refetch_receiver(t, plan, o) for t, o in offers.items()}
        try:
            self._take(_Round(plan, sink, "stream" if atomic else "target", receivers))
        except BaseException as exc:
            self._ack(f"{key}/ack", {"holds": self.version, "error": str(exc)[:2000]})
            raise
        finally:
            for receiver in receivers.values():
                receiver.close()
        self._hold(version, (sink.kind, atomic))
        self._ack(f"{key}/ack", {"holds": version})
        self._log("refetched", version, received_before, started)
        return version

    def _refetch_receiver(self, trainer: int, plan: BucketPlan, offer: dict) -> Receiver:
        """Read a colocated trainer's cache directly where it offers that, else receive its
        broadcasts over a group of the two of us."""
        cache = offer.get("cache")
        if cache is None:
            return self._broadcast_receiver(trainer, [self.rank], offer)
        offsets = {int(g): off for g, off in cache["offsets"].items()}
        return CacheReader(trainer, cache["pid"], plan, cache["address"], offsets)

    def _ask_again(self, key: str) -> dict[int, dict]:
        """Ask every trainer to serve its cache again under ``key``; return their offers,
        which name one version and plan. When a trainer cannot serve, or the caches hold
        different versions, tell the trainers not to send and raise."""
        self.group.set_json(key, {})
        self.group.count(ASK_AGAIN_COUNT, 1)
        offers = {
            t: self.group.get_json(
                f"{key}/from/{t}", t, f"trainer rank {t} to answer a refetch", self.timeout
            )
            for t in self.trainer_ranks
        }
        problems = [f"trainer rank {t}: {o['error']}" for t, o in offers.items() if "error" in o]
        versions = {t: (o["version"], o["plan"]) for t, o in offers.items() if "error" not in o}
        if not problems and len(set(versions.values())) > 1:
            held = {t: v for t, (v, _) in versions.items()}
            problems.append(f"the trainers' caches differ ({held}): receive() the new version")
        if problems:
            self.group.set_json(f"{key}/go", {"go": False})
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
        if rnd.into == "stream":
            self._receive_all(rnd)
            self._complete = False
            self._apply_stream(rnd)
        else:
            self._complete = False
            self._receive_all(rnd)

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

    def _ack(self, key: str, value: dict) -> None:
        try:
            self.group.set_json(key, value)
        except (RuntimeError, SyncError):
            pass

    def _plan(self, plan_id: str, leader: int) -> BucketPlan:
        plan = self._plans.get(plan_id)
        if plan is None:
            meta = self.group.get_json(f"plan/{plan_id}", leader, f"plan {plan_id}", self.timeout)
            plan = plan_from_json(meta)
            if plan.plan_id != plan_id:
                raise SyncError(f"plan {plan_id} from trainer rank {leader} does not match its id")
            self._plans = {plan_id: plan}
        return plan

    def _receive_all(self, rnd: _Round) -> _Round:
        """Receive every bucket, pipelined: bucket g arrives while bucket g-1 is unpacked.

        ``rnd.into``: ``"target"`` applies each bucket as it lands; ``"stream"`` copies it
        into a host buffer laid out as the plan's stream (applied later); ``"drain"``
        discards.
        """
        plan = rnd.plan
        if rnd.into == "stream":
            rnd.stream = self._pool.acquire("sync-atomic", max(plan.stream_bytes, 1))
            self._pool.release("sync-atomic")
        pending = None
        step = len(plan.trainer_ranks)  # the same owner's next bucket
        for bucket in plan.buckets:
            g = bucket.index
            receiver = rnd.receivers[bucket.owner]
            after = g + step
            following = plan.buckets[after].header_bytes if after < len(plan.buckets) else None
            place = functools.partial(self._place, rnd, g, receiver.separate_min)
            current = (g, receiver.start(bucket.header_bytes, following, place))
            if pending is not None:
                self._unpack(rnd, *pending)
            pending = current
        if pending is not None:
            self._unpack(rnd, *pending)
        return rnd

    @staticmethod
    def _place(
        rnd: _Round,
        g: int,
        separate_min: int | None,
        header: torch.Tensor,
        payload: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Where bucket ``g``'s payload segments land: a slice sent on its own goes straight
        to its final bytes when it has some on this device (recorded in ``rnd.landed``)."""
        slices = rnd.plan.bucket_slices(g)
        _, mask = decode_header(header, len(slices))
        buffers = []
        for seg in payload_segments(slices, mask, separate_min):
            dest = None
            if seg.slice is not None:
                s = slices[seg.slice]
                if rnd.into == "target":
                    dest = rnd.sink.direct_view(s)
                elif rnd.into == "stream":
                    start = g * rnd.plan.bucket_bytes + s.bucket_offset
                    dest = rnd.stream[start : start + s.nbytes]
            if dest is not None and dest.device == payload.device:
                rnd.landed.add((g, seg.slice))
                buffers.append(dest)
            else:
                buffers.append(payload[seg.start : seg.start + seg.nbytes])
        return buffers

    def _unpack(self, rnd: _Round, g: int, pending: Pending) -> None:
        plan, sink, into = rnd.plan, rnd.sink, rnd.into
        header, payload = pending.finish()
        slices = plan.bucket_slices(g)
        _, mask = decode_header(header, len(slices))
        offsets, size = payload_offsets(slices, mask)
        if size != payload.numel():
            raise SyncError(
                f"bucket {g} from trainer rank {plan.buckets[g].owner} holds "
                f"{payload.numel()} bytes, the plan expects {size}"
            )
        self.bytes_received += size
        whole: dict[int, torch.Tensor] = {}
        for k, (s, keep, off) in enumerate(zip(slices, mask, offsets, strict=True)):
            if keep:
                data = payload[off : off + s.nbytes]
                landed = (g, k) in rnd.landed
                rnd.dirty.add(s.tensor)
                if into == "stream":
                    if not landed:
                        start = g * plan.bucket_bytes + s.bucket_offset
                        copy_in_slices(rnd.stream[start : start + s.nbytes], data)
                    rnd.slices.append((g, s))
                elif into == "target":
                    if landed:
                        sink.landed(s)
                    else:
                        sink.write(s, data)
                    if isinstance(sink, CallableTarget):
                        if s.nbytes == plan.specs[s.tensor].nbytes:
                            whole[s.tensor] = data
                        else:
                            buf = sink.assembly(s.tensor, plan.specs[s.tensor])
                            copy_in_slices(buf[s.tensor_offset : s.tensor_offset + s.nbytes], data)
            if into == "target" and s.tensor in rnd.dirty and plan.last_bucket[s.tensor] == g:
                if isinstance(sink, CallableTarget) and s.tensor not in whole:
                    sink.assembly(s.tensor, plan.specs[s.tensor])
                sink.tensor_done(s.tensor, plan.specs[s.tensor], whole.get(s.tensor))
        if into == "target":
            sink.flush()
        pending.release()

    @staticmethod
    def _apply_stream(rnd: _Round) -> None:
        """Apply what :meth:`_receive_all` gathered into the stream buffer."""
        plan, sink, stream = rnd.plan, rnd.sink, rnd.stream
        for g, s in rnd.slices:
            start = g * plan.bucket_bytes + s.bucket_offset
            sink.write(s, stream[start : start + s.nbytes])
        for i in sorted(rnd.dirty):
            start = plan.stream_offset[i]
            sink.tensor_done(i, plan.specs[i], stream[start : start + plan.specs[i].nbytes])
        sink.flush()

    def close(self) -> None:
        """Unmap shared memory and free buffers (the group stays open)."""
        for receiver in self._receivers.values():
            receiver.close()
        self._receivers.clear()
        self._pool.clear()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Round:
    """One receive: its plan, target, destination (``into``) and receiver per trainer, and
    what it gathered: tensors with new bytes, (buffered) the stream, and the slices (bucket,
    index in the bucket) that landed in their final place on arrival."""

    plan: BucketPlan
    sink: ModuleTarget | CallableTarget
    into: str
    receivers: dict[int, Receiver]
    dirty: set[int] = field(default_factory=set)
    slices: list[tuple[int, Slice]] = field(default_factory=list)
    stream: torch.Tensor | None = None
    landed: set[tuple[int, int]] = field(default_factory=set)
