"""Messages between the ranks of a save, through the job's key-value store.

Checkpoint coordination never runs a collective on the user's process group: ranks post
small JSON messages (the dataclasses of :mod:`.messages`, under the topics it builds) to
the store that ``init_process_group`` already created (under a prefix of their own) and
wait for each other's through the control plane
(:mod:`...core.control_plane`): polled with a deadline, so background threads may share the
user's store client, and a missing rank is named in the timeout error instead of hanging.

**Liveness.** A process with a channel of more than one rank beats, once for all its
channels on one store (:data:`BEATS`): a thread adds one to its global rank's counter in the
store every :data:`BEAT_SECONDS`. A rank waiting on others reads the
counters of those it is waiting for; one that has not moved for :data:`SILENT_AFTER_SECONDS`
(as seen on the waiting rank's own clock, so hosts' clocks need not agree) belongs to a
process that died or stopped (SIGKILL, SIGSTOP, a lost host), and the wait fails at once
naming it, instead of running on until its timeout. The beat goes through a store client of
its own (:func:`~slipstream.core.control_plane.own_client`), so a request blocked on the
shared client cannot silence a live rank. Every channel reads the same counters, so a rank
that beat for any channel is judged on a channel it has not opened yet (a node lost before
a new ``Checkpointer`` is made there); a rank that has never beaten at all gets the whole
timeout. The mechanism is the control plane's
(:class:`~slipstream.core.control_plane.Heartbeat`,
:class:`~slipstream.core.control_plane.LivenessWatch`); the beat runs at the caller's
priority, not the saver's lowered one: a rank whose cores are all busy training still beats.

Every channel of a group gets a namespace of its own (the group's ranks and the
channel's number among that group's channels in this process), so two savers of one
group (a ``Checkpointer`` beside ``ss.async_save``) never read each other's messages.
Channels are numbered in creation order: every rank must create its savers in the same
order, as SPMD code does; if they do not, saves time out naming the ranks, rather than
mixing messages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch.distributed as dist

from ...core.control_plane import (
    LivenessWatch,
    SharedHeartbeats,
    store_key,
    wait_for_keys,
)
from ...core.waits import Deadline
from ...errors import MissingRanksError, PeerDiedError

BEAT_SECONDS = 0.5
SILENT_AFTER_SECONDS = 3.0
"""Silence that marks a rank dead: six missed beats, so a rank that vanished (its host cut
off or frozen) is noticed within :data:`SILENT_AFTER_SECONDS` plus one check (under five
seconds), as the sync group notices its own."""

_M = TypeVar("_M")
Decoder = Callable[[bytes, str], _M]
"""A message class's ``from_json``: the message in the bytes posted, or an error naming
the message (the text given) and the field at fault."""


class Message(Protocol):
    """What :meth:`RankChannel.post` sends: one of the dataclasses of :mod:`.messages`."""

    def to_json(self) -> str: ...


LIVENESS_CHECK_SECONDS = 0.5
"""How often a wait reads the heartbeats of the ranks it is still waiting for (a read per
rank: rank 0 gathering from thousands of ranks must not flood the store)."""
BEATS = SharedHeartbeats(BEAT_SECONDS)
"""This process's heartbeats, one per (store, global rank), shared by its channels."""
_channels_made: dict[tuple[int, ...], int] = {}
_channels_lock = threading.Lock()


class RankChannel:
    """Post and gather per-rank messages for one process group."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        namespace: str,
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.global_ranks = list(range(world_size) if global_ranks is None else global_ranks)
        """Each rank's rank in the job (whose counter it beats)."""
        self.dead: dict[int, str] = {}
        """Ranks found dead by their silence, with what was waiting for them."""
        self._liveness = LivenessWatch(
            store,
            self._alive_key,
            SILENT_AFTER_SECONDS,
            notice_of=lambda r: self._key("gone", r),
        )
        self._beating = world_size > 1
        if self._beating:
            # on a client of its own (the shared heartbeats make one): a blocking request of
            # another thread on the shared client (NCCL's lazy communicator setup waits in
            # ``store.get``) must not stop the beats, or the peers would take this rank for dead
            BEATS.acquire(store, self._alive_key(rank))

    def _alive_key(self, rank: int) -> str:
        return store_key("slipstream", "alive", self.global_ranks[rank])

    @classmethod
    def local(cls) -> RankChannel:
        """A channel of one rank, in this process only (no process group involved)."""
        return cls(dist.HashStore(), 0, 1, "slipstream/local")

    @classmethod
    def for_group(cls, process_group: dist.ProcessGroup | None) -> RankChannel:
        if not (dist.is_available() and dist.is_initialized()):
            return cls.local()
        group = process_group or dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        store = dist.distributed_c10d._get_default_store()
        with _channels_lock:
            number = _channels_made.get(ranks, 0)
            _channels_made[ranks] = number + 1
        namespace = f"slipstream/{'-'.join(map(str, ranks))}/{number}"
        return cls(store, dist.get_rank(group), dist.get_world_size(group), namespace, ranks)

    def _key(self, topic: str, rank: int) -> str:
        return store_key(self.namespace, topic, rank)

    def post(self, topic: str, message: Message) -> None:
        """Post this rank's ``message`` (one of :mod:`.messages`) under ``topic``."""
        self.store.set(self._key(topic, self.rank), message.to_json())

    def _wait(self, topic: str, ranks: list[int], deadline: Deadline, what: str) -> None:
        """Poll until every rank of ``ranks`` has posted ``topic``; fail naming the ranks
        that did not, at the deadline, or as soon as one of them stops beating."""
        try:
            wait_for_keys(
                self.store,
                {r: self._key(topic, r) for r in ranks},
                f"them to {what}",
                deadline,
                f"rank {self.rank}",
                self._liveness.dead,
                look_every=LIVENESS_CHECK_SECONDS,
            )
        except PeerDiedError as exc:
            self.dead.update(dict.fromkeys(exc.ranks, str(exc)))
            raise

    def known_dead(self) -> dict[int, str]:
        """Ranks found dead that are still dead (a rank that beats again is forgiven)."""
        if self.dead:
            still = self._liveness.dead(list(self.dead))
            self.dead = {r: m for r, m in self.dead.items() if r in still}
        return dict(self.dead)

    def dead_among(self, ranks: Sequence[int]) -> dict[int, str]:
        """Which of ``ranks`` are dead now, and why (a notice's words, or their silence)."""
        return self._liveness.dead(ranks)

    def report_dead(self, rank: int, why: str) -> None:
        """Tell every rank's waits that ``rank`` is gone (``why``: e.g. its connection
        dropped), so they name it at once instead of after :data:`SILENT_AFTER_SECONDS`;
        void as soon as the rank beats again."""
        self._liveness.notice(rank, why)
        self.dead[rank] = why

    def gather_living(
        self, topic: str, decode: Decoder[_M], deadline: Deadline, what: str
    ) -> tuple[dict[int, _M], dict[int, str], list[int]]:
        """After a rank was found dead (by a wait on ``topic``, or by this rank): wait on
        for the other ranks until each has posted or is found dead too (ranks that die
        together, such as a node's, are named together), at most until ``deadline``. The
        ranks that have not posted are looked at once at the start (a death is known
        already), then every :data:`LIVENESS_CHECK_SECONDS`. Returns the messages posted
        (by rank), the dead (rank: why) and the ranks that did neither by the deadline."""
        found: dict[int, str] = {}

        def look(ranks: Sequence[int]) -> dict[int, str]:
            dead = self._liveness.dead(ranks)
            found.update(dead)
            return dead

        keys = {r: self._key(topic, r) for r in range(self.world_size)}
        for rank in look([r for r, key in keys.items() if not self.store.check([key])]):
            del keys[rank]
        missing: list[int] = []
        try:
            wait_for_keys(
                self.store,
                keys,
                f"them to {what}",
                deadline,
                f"rank {self.rank}",
                look,
                drop_dead=True,
                look_every=LIVENESS_CHECK_SECONDS,
            )
        except MissingRanksError as exc:
            missing = list(exc.ranks)
        self.dead.update(found)
        posted = {
            r: self._read(topic, r, decode)
            for r in range(self.world_size)
            if r not in found and r not in missing
        }
        return posted, found, missing

    def close(self) -> None:
        """Let go of this process's heartbeat (it stops with the last channel)."""
        if self._beating:
            self._beating = False
            BEATS.release(self.store, self._alive_key(self.rank))

    def gather(self, topic: str, decode: Decoder[_M], deadline: Deadline, what: str) -> list[_M]:
        """Every rank's message for ``topic`` (index = rank), read by ``decode`` (a
        message class's ``from_json``)."""
        ranks = list(range(self.world_size))
        self._wait(topic, ranks, deadline, what)
        return [self._read(topic, r, decode) for r in ranks]

    def receive(
        self, topic: str, decode: Decoder[_M], from_rank: int, deadline: Deadline, what: str
    ) -> _M:
        """``from_rank``'s message for ``topic``, read by ``decode``."""
        self._wait(topic, [from_rank], deadline, what)
        return self._read(topic, from_rank, decode)

    def _read(self, topic: str, rank: int, decode: Decoder[_M]) -> _M:
        return decode(self.store.get(self._key(topic, rank)), f"rank {rank}'s {topic} message")

    def forget(self, topic: str, ranks: list[int] | None = None) -> None:
        for r in range(self.world_size) if ranks is None else ranks:
            self.store.delete_key(self._key(topic, r))
