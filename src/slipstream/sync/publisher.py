"""The trainer side: :class:`WeightPublisher`.

One publish is one *round* ``k`` (rounds are counted identically on every rank):

1. every rollout writes a request ``req/{r}/{k}`` with the version it holds completely
   (so a publish waits while a rollout is still applying the previous one);
2. the lead trainer (``trainer_ranks[0]``) writes ``round/{k}`` = version and plan id (the
   plan's metadata crosses the store once per layout, under ``plan/{id}``);
3. each trainer packs the buckets it owns and sends them (pipelined over ``num_slots``
   reused buffers); a slice whose checksum matches the one it had in the version every
   rollout holds is left out;
4. every rollout acknowledges with ``ack/{r}/{k}``; then ``delivered`` resolves.

Every key lives under the publisher/subscriber set's channel (``channel/{name}/``), as do
its process groups, so sets on one group never meet.

A rollout may also ask again for the version the trainers hold in their caches (``cached``
mode) without waiting for a publish: it writes ``again/{r}/{n}`` and bumps the counter
``again/requests``. Each trainer answers ``again/{r}/{n}/from/{t}`` with the version in
its cache (or why it cannot serve it); the rollout checks that every trainer offers the same
version and that its plan fits the target, and writes ``again/{r}/{n}/go``; then each
trainer sends its buckets from the cache over a process group of just the two of them (over
``cma`` the rollout reads them out of the cache itself), and the rollout acknowledges with
``again/{r}/{n}/ack``.

Threads: in ``direct`` mode the caller's thread packs (reading live tensors, gathering
DTensors on the user's mesh) and issues asynchronous sends on the sync group; in ``cached``
mode the caller's thread only snapshots into a reused host cache and the publisher's one
worker thread, ``slipstream-sync-publisher``, does steps 1-4 from that cache, and, between
rounds and while it waits for a round's requests, serves the rollouts that ask again. The
cache is rewritten only under a lock that a request served from it holds. The worker
only ever talks to the sync group's own store and process groups, never to a group the user
also uses. :meth:`WeightPublisher.close` (or the context manager) joins it.
"""

from __future__ import annotations

import functools
import logging
import platform
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..core.buffers import StagingPool
from ..core.copy import copy_in_slices
from ..core.dtypes import dtype_name
from ..core.handles import fail_unfinished
from ..errors import PeerTimeoutError, SyncError
from .cma import CmaSender
from .group import SyncGroup
from .packing import (
    NO_BYTES,
    BucketSources,
    is_dtensor,
    pack_slices,
    packs_any,
    payload_segments,
    segment_parts,
    slice_checksum,
)
from .plan import BucketPlan, Slice, TensorSpec, encode_header, layout_json
from .shm import ORDERED_STORES, ShmSender, new_ring_path
from .transport import (
    RELAY_SEPARATE_MIN_BYTES,
    SEPARATE_MIN_BYTES,
    BroadcastSender,
    Sender,
)

logger = logging.getLogger(__name__)

MODES = ("direct", "cached")
TRANSPORTS = ("auto", "relay", "broadcast", "shm", "cma")
#: Transports over the sync group's process groups (the others need one host).
NETWORK_TRANSPORTS = ("relay", "broadcast")
#: What ``auto`` tries on one host, best first (``cma`` only where the rollouts may read
#: the trainer's memory).
LOCAL_TRANSPORTS = ("cma", "shm")
HEADER_CAP = 64 * 1024
#: How often a ``cached`` publisher's worker looks for rollouts that ask again, in seconds
#: (a look is one store request; a refetch waits at most this long to be noticed).
ASK_AGAIN_POLL = 0.05
ASK_AGAIN_COUNT = "again/requests"
#: Buffers per side of a refetch's transfer (allocated for its duration).
REFETCH_SLOTS = 2


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


@dataclass
class PublishHandle:
    """``staged``: the trainer may change its weights. ``delivered``: every rollout holds
    ``version`` (its result is the version). Both are ``concurrent.futures.Future``;
    ``timings`` fills in as they resolve."""

    version: int
    staged: Future = field(default_factory=Future)
    delivered: Future = field(default_factory=Future)
    timings: PublishTimings = field(default_factory=PublishTimings)
    started: float = field(default_factory=time.perf_counter, repr=False)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def wait(self, timeout: float | None = None) -> int:
        return self.delivered.result(timeout)


def named_items(named_tensors: Mapping | Iterable) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    seen = set()
    for name, t in items:
        if name in seen:
            raise ValueError(f"tensor name {name!r} is published twice")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
    return items


def spec_of(name: str, t: torch.Tensor, aliases: Sequence[str] = ()) -> TensorSpec:
    return TensorSpec(name, tuple(t.shape), dtype_name(t.dtype), tuple(aliases))


def alias_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors exactly when they are the same bytes seen the same way: the same
    storage, offset, shape, stride and dtype (a DTensor: the same local shard, global shape,
    stride and placements). A tensor without bytes of its own is only its own alias."""
    extra: tuple = ()
    local = t
    if is_dtensor(t):
        local = t._local_tensor  # type: ignore[attr-defined]
        extra = (tuple(t.stride()), tuple(map(str, t.placements)), id(t.device_mesh))
    if local.numel() == 0 or local.device.type == "meta" or local.data_ptr() == 0:
        return ("object", id(t))
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        t.dtype,
        tuple(t.shape),
        extra,
    )


def unique_tensors(
    items: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """The specs and tensors to send: each tensor once, under the first name it appears with,
    its spec listing its other names (aliases, e.g. tied embeddings) in order of appearance."""
    index: dict[tuple, int] = {}
    names: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    for name, t in items:
        key = alias_key(t)
        i = index.get(key)
        if i is None:
            index[key] = len(tensors)
            tensors.append(t)
            names.append([name])
        else:
            names[i].append(name)
    specs = [spec_of(ns[0], t, ns[1:]) for ns, t in zip(names, tensors, strict=True)]
    return specs, tensors


class WeightPublisher:
    """Publishes named tensors from ``trainer_ranks`` to ``rollout_ranks`` over ``group``.

    Every trainer rank constructs one (with the same arguments) and calls :meth:`publish`
    with the same names, shapes, dtypes and version. Construction sets up the transport
    and waits (up to the group's timeout) for the rollouts to construct their subscribers.

    ``transport``: ``"auto"`` picks ``"cma"`` (rollouts copy straight out of this process's
    memory) when every rollout shares this host and the kernel lets them read it, else
    ``"shm"`` (a shared-memory ring) on one host; across hosts it picks ``"relay"`` (this
    rank sends each message once, to the first rollout, and each rollout passes it on to
    the next) for host tensors and ``"broadcast"`` (one collective per message) for device
    tensors. :attr:`transport` holds the choice. Over relay and broadcast, a slice of at
    least ``separate_min_bytes`` travels as a message of its own, straight from the
    trainer's tensor into the rollout's, skipping the bucket copy on both sides; smaller
    slices are packed into buckets. ``"auto"`` means 1 MiB over relay and 16 MiB over
    broadcast (where a message costs more); ``None`` packs everything.

    ``channel`` names this publisher/subscriber set: its store keys, process groups and
    shared-memory ring are its own, so several sets (several models) run on one group at
    once. Left out, it is numbered in creation order among this process's unnamed sets of the
    same trainer and rollout ranks: every rank must then create them in the same order (or
    pass the same names). :attr:`channel` holds the name.

    Tensors published under several names (sharing storage, offset, shape, stride and
    dtype, e.g. tied embeddings in ``model.state_dict()``) are sent once; the plan lists
    their other names and the rollouts apply them under each.

    Invariants: versions strictly increase; a round starts only once every rollout asked
    for it; ``staged`` resolves only after the last byte this rank reads from the caller's
    tensors has been copied, sent or read by every rollout.
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
        self._separate_min_asked = separate_min_bytes
        self.separate_min_bytes: int | None = None
        self.rollout_versions: dict[int, int | None] = dict.fromkeys(self.rollout_ranks)
        self.bytes_sent = 0
        self.peak_gathered_bytes = 0
        self._round = 0
        self._last_version: int | None = None
        self._plan: BucketPlan | None = None
        self._announced: set[str] = set()
        self._checksums: dict[int, dict[int, int]] = {}
        self._pool = StagingPool(pin=torch.cuda.is_available())
        self._cache: torch.Tensor | None = None
        self._cache_offsets: dict[int, int] = {}
        self._cache_version: int | None = None
        self._cache_plan: BucketPlan | None = None
        self._cache_lock = threading.Lock()
        self._asks_seen = 0
        self._asks_looked = 0.0
        self._asks_next = dict.fromkeys(self.rollout_ranks, 0)
        self._last_round: Future | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self.transport = transport
        self._sender = self._make_sender(self._transport_candidates(transport), num_slots)
        self._thread = threading.Thread(
            target=self._work, name="slipstream-sync-publisher", daemon=True
        )
        self._thread.start()

    def _transport_candidates(self, transport: str) -> list[str]:
        """The transports to try, best first: ``auto`` picks a colocated one when every
        rollout shares this host (and the weights are in host memory), else relay (host
        memory) or broadcast (device memory)."""
        local = self.group.colocated(self.rollout_ranks) and self.group.device.type == "cpu"
        if transport in LOCAL_TRANSPORTS and not local:
            raise ValueError(
                f"transport={transport!r} needs every rollout on trainer rank {self.rank}'s "
                "host and host buffers"
            )
        if transport in LOCAL_TRANSPORTS and not ORDERED_STORES:
            raise ValueError(
                f"transport={transport!r} needs an x86 CPU: its handshake relies on ordered "
                f"stores, which {platform.machine()} does not guarantee; use 'broadcast'"
            )
        if transport != "auto":
            return [transport]
        if local and ORDERED_STORES:
            return list(LOCAL_TRANSPORTS)
        return ["relay" if self.group.device.type == "cpu" else "broadcast"]

    def _make_sender(self, candidates: list[str], num_slots: int) -> Sender:
        """Agree with the rollouts on the first of ``candidates`` they can all use, build
        this rank's sender for it and tell them (``transport/{rank}``)."""
        if "cma" in candidates:
            refused = self._probe_remote_reads()
        else:
            refused = {}
            self.group.set_json(f"transport/{self.rank}/probe", None)
        if refused:
            why = "; ".join(f"rollout rank {r}: {e}" for r, e in refused.items())
            if candidates == ["cma"]:
                error = (
                    f"transport='cma': rollouts cannot read trainer rank {self.rank}'s memory "
                    f"({why}); they need ptrace access to it (docs/sync.md), else use 'shm'"
                )
                self.group.set_json(f"transport/{self.rank}", {"error": error})
                raise SyncError(error)
            logger.info("trainer rank %d: no cross-memory reads (%s); using 'shm'", self.rank, why)
            candidates = [c for c in candidates if c != "cma"]
        self.transport = candidates[0]
        self.separate_min_bytes = self._separate_min(self.transport)
        info = {
            "kind": self.transport,
            "mode": self.mode,
            **self._receiver_shape(self.bucket_bytes, num_slots, self.separate_min_bytes),
        }
        if self.transport in NETWORK_TRANSPORTS:
            self.group.set_json(f"transport/{self.rank}", info)
            return self._broadcast_sender(
                self.rollout_ranks, self.bucket_bytes, num_slots, self.transport == "relay"
            )
        path = new_ring_path(self.rank)
        ring_sender = CmaSender if self.transport == "cma" else ShmSender
        sender = ring_sender(
            path,
            self.rank,
            self.bucket_bytes,
            HEADER_CAP,
            num_slots,
            self.rollout_ranks,
            [self.group.pids[r] for r in self.rollout_ranks],
            self.timeout,
        )
        info.update(path=path, pid=self.group.pids[self.rank])
        self.group.set_json(f"transport/{self.rank}", info)
        try:
            self.group.wait_keys(
                {r: f"transport/{self.rank}/opened/{r}" for r in self.rollout_ranks},
                f"rollouts to map trainer rank {self.rank}'s shared-memory ring",
                self.timeout,
            )
        finally:
            sender.unlink()
        return sender

    def _probe_remote_reads(self) -> dict[int, str]:
        """Ask every rollout to read a few random bytes from this process; return why each
        one that could not failed (empty when all could)."""
        probe = torch.randint(0, 256, (64,), dtype=torch.uint8)
        self.group.set_json(
            f"transport/{self.rank}/probe",
            {"pid": self.group.pids[self.rank], "addr": probe.data_ptr(), "bytes": probe.tolist()},
        )
        replies = {r: f"transport/{self.rank}/probed/{r}" for r in self.rollout_ranks}
        self.group.wait_keys(
            replies, f"rollouts to try reading trainer rank {self.rank}'s memory", self.timeout
        )
        refused = {}
        for r, key in replies.items():
            error = self.group.get_json(key, r, "a memory-read probe")["error"]
            if error:
                refused[r] = error
        return refused

    def _separate_min(self, transport: str) -> int | None:
        """The ``separate_min_bytes`` asked for, with ``"auto"`` resolved for ``transport``."""
        if self._separate_min_asked != "auto":
            return self._separate_min_asked
        return RELAY_SEPARATE_MIN_BYTES if transport == "relay" else SEPARATE_MIN_BYTES

    @staticmethod
    def _receiver_shape(bucket_bytes: int, num_slots: int, separate_min: int | None) -> dict:
        """What a rollout needs to build the receiver that matches this rank's sender."""
        return {
            "bucket_bytes": bucket_bytes,
            "num_slots": num_slots,
            "header_cap": HEADER_CAP,
            "separate_min": separate_min,
        }

    def _broadcast_sender(
        self,
        rollouts: Sequence[int],
        bucket_bytes: int,
        num_slots: int,
        relay: bool = False,
        separate_min: int | None = None,
    ) -> BroadcastSender:
        """A sender over the group of this rank and ``rollouts``, relaying along them with
        ``relay`` (the rollouts build the matching receivers from :meth:`_receiver_shape` of
        the same arguments); ``separate_min`` defaults to this publisher's."""
        return BroadcastSender(
            self.group.subgroup([self.rank, *rollouts]),
            self.rank,
            bucket_bytes,
            HEADER_CAP,
            num_slots,
            self.timeout,
            self.group.device,
            self.separate_min_bytes if separate_min is None else separate_min,
            rollouts,
            functools.partial(self.group.exited, rollouts),
            relay,
        )

    # ----------------------------------------------------------------------------- publish
    def publish(self, named_tensors: Mapping | Iterable, version: int) -> PublishHandle:
        """Send ``named_tensors`` as ``version`` to every rollout.

        ``direct``: returns once nothing more is read from ``named_tensors`` (``staged``
        resolved): this rank packed its last bucket and the slices sent straight from the
        tensors have left; the packed buckets still in flight finish in the background.
        ``cached``: returns once the weights are snapshotted into the host cache; the worker
        thread sends from the cache.
        """
        if self._closed:
            raise SyncError("publish on a closed WeightPublisher")
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"versions must increase: got {version} after {self._last_version}")
        items = named_items(named_tensors)
        handle = PublishHandle(version)
        self._wait_previous_round()
        sent_before = self._sender.bytes_sent
        try:
            specs, tensors = unique_tensors(items)
            plan = self._plan_for(specs)
            k = self._round
            self._round += 1
            self._last_version = version
            if self.mode == "direct":
                helds = self._start_round(k, version, plan)
                self._pack_and_send(plan, BucketSources(plan, tensors, self.rank), helds, version)
                handle.timings.staged = handle.elapsed()
                handle.staged.set_result(None)
                job = functools.partial(self._finish_round, k, version)
            else:
                self._snapshot(plan, tensors, version)
                handle.timings.staged = handle.elapsed()
                handle.staged.set_result(None)
                job = functools.partial(self._serve_cached, k, version, plan)
        except BaseException as exc:
            fail_unfinished(exc, handle.staged, handle.delivered)
            raise
        self._last_round = handle.delivered
        self._jobs.put((job, handle, sent_before))
        handle.timings.blocked = handle.elapsed()
        return handle

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

    def _plan_for(self, specs: list[TensorSpec]) -> BucketPlan:
        plan = self._plan
        if plan is None or plan.specs != tuple(specs):
            plan = BucketPlan.build(specs, self.bucket_bytes, self.trainer_ranks)
            if plan.max_header_bytes > HEADER_CAP:
                raise ValueError(
                    f"a bucket holds {plan.max_header_bytes - 8} slices, more than "
                    f"{HEADER_CAP - 8}; use a smaller bucket_bytes"
                )
            self._plan = plan
            self._checksums.clear()
        if self.rank == self.leader and plan.plan_id not in self._announced:
            self.group.set_json(
                f"plan/{plan.plan_id}",
                layout_json(plan.specs, plan.bucket_bytes, plan.trainer_ranks),
            )
            self._announced.add(plan.plan_id)
        return plan

    def _start_round(
        self, k: int, version: int, plan: BucketPlan, serve_asks: bool = False
    ) -> dict[int, int | None]:
        """Wait for every rollout's request, agree on the round, return what each holds.

        ``serve_asks`` (on the worker thread only): meanwhile serve rollouts that ask again.
        """
        self.group.wait_keys(
            {r: f"req/{r}/{k}" for r in self.rollout_ranks},
            f"rollouts to ask for version {version} (round {k})",
            self.timeout,
            idle=self._serve_asks_again if serve_asks else None,
        )
        helds: dict[int, int | None] = {}
        for r in self.rollout_ranks:
            helds[r] = self.group.get_json(f"req/{r}/{k}", r, "a rollout request")["held"]
        round_info = {"version": version, "plan": plan.plan_id}
        if self.rank == self.leader:
            self.group.set_json(f"round/{k}", round_info)
        else:
            agreed = self.group.get_json(
                f"round/{k}", self.leader, f"round {k} from the lead trainer"
            )
            if agreed != round_info:
                raise SyncError(
                    f"trainer rank {self.rank} publishes {round_info} but lead trainer rank "
                    f"{self.leader} publishes {agreed} in round {k}: ranks disagree on the "
                    "version or on the tensors' names/shapes/dtypes"
                )
        return helds

    def _unchanged_fn(self, helds: dict[int, int | None]):
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

    def _pack_and_send(
        self, plan: BucketPlan, sources: BucketSources, helds: dict[int, int | None], version: int
    ) -> None:
        unchanged = self._unchanged_fn(helds)
        separate_min = self._sender.separate_min
        sums: dict[int, int] = {}
        sent_from_tensors = False
        for bucket in plan.buckets:
            g = bucket.index
            sources.enter(g)
            if bucket.owner == self.rank:
                slices = plan.bucket_slices(g)
                out = self._sender.next_buffer() if packs_any(slices, separate_min) else NO_BYTES
                mask, nbytes, bucket_sums, separate = pack_slices(
                    slices, sources.slice_bytes, out, unchanged, bucket.first_slice, separate_min
                )
                sums.update(bucket_sums)
                sent_from_tensors |= bool(separate)
                header = encode_header(
                    torch.empty(bucket.header_bytes, dtype=torch.uint8), nbytes, mask
                )
                segments = payload_segments(slices, mask, separate_min)
                parts = segment_parts(segments, out[:nbytes], separate)
                self._sender.submit(header.to(out.device), parts)
            sources.leave(g)
        if sent_from_tensors:  # those sends read the caller's tensors: done before `staged`
            self._sender.flush()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sources.peak_gathered_bytes)
        self._remember(version, sums)

    def _snapshot(self, plan: BucketPlan, tensors: Sequence[torch.Tensor], version: int) -> None:
        """Copy this rank's buckets into the reused host cache (bucket-by-bucket gathers)."""
        if not self._cache_lock.acquire(timeout=self.timeout):
            raise PeerTimeoutError(
                f"trainer rank {self.rank}: a rollout that asked again held the cache for "
                f"more than {self.timeout:.1f} s"
            )
        try:
            self._cache_version = None  # torn until the copy below completes
            self._snapshot_locked(plan, tensors)
            self._cache_version, self._cache_plan = version, plan
        finally:
            self._cache_lock.release()

    def _snapshot_locked(self, plan: BucketPlan, tensors: Sequence[torch.Tensor]) -> None:
        owned = plan.owned(self.rank)
        offsets: dict[int, int] = {}
        total = 0
        for g in owned:
            offsets[g] = total
            total += plan.buckets[g].nbytes
        cache = self._pool.acquire("sync-cache", max(total, 1))
        self._pool.release("sync-cache")
        sources = BucketSources(plan, tensors, self.rank)
        for bucket in plan.buckets:
            g = bucket.index
            sources.enter(g)
            if bucket.owner == self.rank:
                base = offsets[g]
                for s in plan.bucket_slices(g):
                    start = base + s.bucket_offset
                    copy_in_slices(cache[start : start + s.nbytes], sources.slice_bytes(s))
            sources.leave(g)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sources.peak_gathered_bytes)
        self._cache, self._cache_offsets = cache, offsets

    # ------------------------------------------------------------------- worker thread
    def _work(self) -> None:
        poll = ASK_AGAIN_POLL if self.mode == "cached" else None
        while True:
            try:
                item = self._jobs.get(timeout=poll)
            except queue.Empty:
                self._serve_asks_again()
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
            timings.nbytes = self._sender.bytes_sent - sent_before
            timings.delivered = handle.elapsed()
            logger.info(
                "trainer rank %d published version %d: %.3f GiB sent, blocked %.3f s, "
                "staged in %.3f s, delivered in %.3f s",
                self.rank,
                version,
                timings.nbytes / 2**30,
                timings.blocked or 0.0,
                timings.staged or 0.0,
                timings.delivered,
            )
            handle.delivered.set_result(version)

    def _serve_cached(self, k: int, version: int, plan: BucketPlan) -> int:
        helds = self._start_round(k, version, plan, serve_asks=True)
        with self._cache_lock:
            sums = self._send_from_cache(self._sender, plan, self._unchanged_fn(helds))
        self._remember(version, sums)
        return self._finish_round(k, version)

    def _send_from_cache(
        self,
        sender: Sender,
        plan: BucketPlan,
        unchanged: Callable[[int, int | None], bool] | None = None,
    ) -> dict[int, int]:
        """Send this rank's buckets of the cache through ``sender``, leaving out the slices
        ``unchanged`` names; returns every slice's checksum. Without ``unchanged`` every byte
        is sent and nothing is hashed."""
        sums: dict[int, int] = {}
        cache = self._cache
        assert cache is not None
        for g in plan.owned(self.rank):
            bucket = plan.buckets[g]
            base = self._cache_offsets[g]
            view = cache[base : base + bucket.nbytes]

            def cached(s: Slice, view: torch.Tensor = view) -> torch.Tensor:
                return view[s.bucket_offset : s.bucket_offset + s.nbytes]

            slices = plan.bucket_slices(g)
            mask = [1] * len(slices)
            for j, s in enumerate(slices if unchanged is not None else ()):
                cs = slice_checksum(cached(s))
                if cs is not None:
                    sums[bucket.first_slice + j] = cs
                mask[j] = 0 if unchanged(bucket.first_slice + j, cs) else 1
            header = torch.empty(bucket.header_bytes, dtype=torch.uint8)
            segments = payload_segments(slices, mask, sender.separate_min)
            if all(mask) and view.device == self.group.device:
                # the cache already holds the payload where the transport reads: no copy
                parts = segment_parts(segments, view, {})
                sender.submit(encode_header(header, bucket.nbytes, mask), parts)
                continue
            out = sender.next_buffer()
            kept = [s for s, m in zip(slices, mask, strict=True) if m]
            _, nbytes, _, _ = pack_slices(kept, cached, out, lambda i, cs: False, 0)
            parts = segment_parts(segments, out[:nbytes], {})
            sender.submit(encode_header(header, nbytes, mask).to(out.device), parts)
        return sums

    # ------------------------------------------------------------- rollouts that ask again
    def _serve_asks_again(self) -> None:
        """Serve every rollout that asked again since the last look (worker thread only,
        ``cached`` mode; a look at most every ``ASK_AGAIN_POLL`` seconds).

        A request that cannot be served is answered with the reason; a failure while
        serving one is the asking rollout's error (it times out or sees a broken
        transfer), logged here, and never fails a publish.
        """
        now = time.monotonic()
        if now - self._asks_looked < ASK_AGAIN_POLL:
            return
        self._asks_looked = now
        try:
            count = self.group.count(ASK_AGAIN_COUNT)
            if count == self._asks_seen:
                return
            for r in self.rollout_ranks:
                while self.group.store.check([f"again/{r}/{self._asks_next[r]}"]):
                    key = f"again/{r}/{self._asks_next[r]}"
                    self._asks_next[r] += 1
                    try:
                        self._serve_again(r, key)
                    except (SyncError, RuntimeError) as exc:
                        logger.warning(
                            "trainer rank %d could not serve rollout rank %d's refetch: %s",
                            self.rank,
                            r,
                            exc,
                        )
            self._asks_seen = count
        except (SyncError, RuntimeError) as exc:
            logger.warning("trainer rank %d could not look for refetches: %s", self.rank, exc)

    def _serve_again(self, r: int, key: str) -> None:
        """Answer rollout ``r``'s request ``key`` with this rank's offer and, once the rollout
        accepts, send every byte of this rank's buckets from the cache (over ``cma`` the
        rollout reads them itself). The cache stays locked until the rollout acknowledged."""
        if not self._cache_lock.acquire(blocking=False):
            why = f"trainer rank {self.rank} is snapshotting a newer version; receive() it"
            self.group.set_json(f"{key}/from/{self.rank}", {"error": why})
            return
        try:
            offer = self._offer()
            self.group.set_json(f"{key}/from/{self.rank}", offer)
            if "error" in offer:
                return
            go = self.group.get_json(f"{key}/go", r, f"rollout rank {r} to accept version")
            if not go["go"]:
                return
            plan = self._cache_plan
            assert plan is not None
            if self.transport != "cma":
                relay = offer["kind"] == "relay"
                sender = self._broadcast_sender(
                    [r], plan.bucket_bytes, REFETCH_SLOTS, relay, offer["separate_min"]
                )
                try:
                    self._send_from_cache(sender, plan)
                    sender.flush()
                finally:
                    sender.close()
            ack = self.group.get_json(f"{key}/ack", r, f"rollout rank {r} to acknowledge")
        finally:
            self._cache_lock.release()
        self.rollout_versions[r] = ack.get("holds")
        logger.info(
            "trainer rank %d served version %s again to rollout rank %d from its cache",
            self.rank,
            offer["version"],
            r,
        )

    def _offer(self) -> dict:
        """What this rank can serve again: its cache's version and plan, or why not."""
        if self._cache_version is None or self._cache_plan is None:
            return {"error": f"trainer rank {self.rank} holds no complete version yet"}
        # a colocated rollout reads the cache itself; otherwise host weights travel to it
        # point to point (a collective of two costs more per message), device weights by
        # broadcast, as a publish would send them
        if self.transport == "cma":
            kind = "cma"
        else:
            kind = "relay" if self.group.device.type == "cpu" else "broadcast"
        offer = {
            "version": self._cache_version,
            "plan": self._cache_plan.plan_id,
            "kind": kind,
            **self._receiver_shape(
                self._cache_plan.bucket_bytes, REFETCH_SLOTS, self._separate_min(kind)
            ),
        }
        if self.transport == "cma":
            assert self._cache is not None  # a complete version is in it
            offer["cache"] = {
                "pid": self.group.pids[self.rank],
                "address": self._cache.data_ptr(),
                "offsets": {str(g): off for g, off in self._cache_offsets.items()},
            }
        return offer

    def _finish_round(self, k: int, version: int) -> int:
        """Wait until every send left and every rollout acknowledged round ``k``."""
        self._sender.flush()
        self.bytes_sent = self._sender.bytes_sent
        self.group.wait_keys(
            {r: f"ack/{r}/{k}" for r in self.rollout_ranks},
            f"rollouts to acknowledge version {version}",
            self.timeout,
        )
        errors = []
        for r in self.rollout_ranks:
            ack = self.group.get_json(f"ack/{r}/{k}", r, "an acknowledgement")
            self.rollout_versions[r] = ack.get("holds")
            if ack.get("error"):
                errors.append(f"rollout rank {r}: {ack['error']}")
        if errors:
            raise SyncError(f"version {version} was not applied everywhere: " + "; ".join(errors))
        return version

    @property
    def buffer_bytes(self) -> int:
        """Bytes of transfer buffers and host cache this publisher holds."""
        return self._sender.buffer_bytes + self._pool.live_bytes

    def staleness(self) -> dict[int, int | None]:
        """Versions behind the last publish, per rollout (``None``: holds no complete version)."""
        last = self._last_version
        return {
            r: None if v is None or last is None else last - v
            for r, v in self.rollout_versions.items()
        }

    def close(self, timeout: float | None = None) -> None:
        """Finish queued rounds (up to ``timeout``), stop and join the worker, free buffers."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(self.timeout if timeout is None else timeout)
        if self._thread.is_alive():
            raise PeerTimeoutError(
                f"trainer rank {self.rank}: the publisher's worker did not finish within "
                f"{self.timeout:.1f} s (a rollout is not receiving?)"
            )
        self._sender.close()
        self._pool.clear()
        self._cache = None

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
