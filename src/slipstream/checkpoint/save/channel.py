"""Messages between the ranks of a save, through the job's key-value store.

Checkpoint coordination never runs a collective on the user's process group: ranks post
small JSON messages (the dataclasses of :mod:`.messages`, under the topics it builds) to
the store that ``init_process_group`` already created (under a prefix of their own).

**One coordinator per exchange.** Where every rank needs a decision made from every rank's
message (a layout's plan, a load's outcome), ranks post, rank 0 gathers them, decides and
posts one verdict (or one per rank), and every other rank waits for that one key
(:meth:`RankChannel.exchange`): a rank makes the same few store requests at 16 ranks as at
10,000, rank 0 a few per rank.

**Waiting.** A wait is one blocking ``store.wait`` on a client of the waiting thread's own
(:class:`~slipstream.core.store_watch.WaitingClients`, opened with the channel, never inside
a wait), so it holds up no other thread and costs one request however long it lasts; the
words it waits for are read in one more. A wait that finds every such client lent (two
waits of one process at once) polls one ``check`` of its keys on the shared client.
A wait ends at its deadline with :class:`~slipstream.errors.MissingRanksError` naming the
ranks that did not answer.

**Liveness.** A process with a channel of more than one rank runs one
:class:`~slipstream.core.store_watch.StoreWatch` per store, shared by all its channels
(:data:`WATCHES`), on a client of its own: it adds one to its global rank's counter every
:data:`BEAT_SECONDS`, and while waits are open it reads, in one request every
:data:`LIVENESS_CHECK_SECONDS`, the counters of the ranks they wait for and the job's log
of deaths (:data:`DEATHS_KEY`). A rank silent for :data:`SILENT_AFTER_SECONDS` (on the
watching process's clock, so hosts' clocks need not agree) belongs to a process that died
or stopped (SIGKILL, SIGSTOP, a lost host): the watch posts, in that rank's place (write
once), that it died, which ends every wait on it, on every rank, with
:class:`~slipstream.errors.PeerDiedError` naming it; a coordinator's wait for all ranks
ends at once too, and its verdict fails every rank. Every channel reads the same counters,
so a rank that beat for any channel is judged on a channel it has not opened yet; a rank
that has never beaten at all gets the whole timeout. The beat runs at the caller's
priority, not the saver's lowered one: a rank whose cores are all busy training still beats.

Every channel of a group gets a namespace of its own (the group's ranks and the
channel's number among that group's channels in this process), so two savers of one
group (a ``Checkpointer`` beside ``ss.async_save``) never read each other's messages.
Channels are numbered in creation order: every rank must create its savers in the same
order, as SPMD code does; if they do not, saves time out naming the ranks, rather than
mixing messages.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch.distributed as dist

from ...core.control_plane import (
    POLL_FIRST_SECONDS,
    POLL_MAX_SECONDS,
    died_error,
    ranks_text,
    store_key,
)
from ...core.store_watch import (
    NEVER_SECONDS,
    StoreWatch,
    StoreWatches,
    WaitingClients,
    Watched,
    block_until,
    poll_until,
)
from ...core.waits import Deadline
from ...errors import (
    CheckpointError,
    CorruptCheckpointError,
    MissingRanksError,
    PeerDiedError,
    PeerTimeoutError,
    UnsafeCheckpointError,
)

BEAT_SECONDS = 1.0
SILENT_AFTER_SECONDS = 3.0
"""Silence that marks a rank dead: three missed beats, so a rank that vanished (its host cut
off or frozen) is noticed within :data:`SILENT_AFTER_SECONDS` plus a beat and a look (under
five seconds), as the sync group notices its own."""

_M = TypeVar("_M")
Decoder = Callable[[bytes, str], _M]
"""A message class's ``from_json``: the message in the bytes posted, or an error naming
the message (the text given) and the field at fault."""


class Message(Protocol):
    """What :meth:`RankChannel.post` sends: one of the dataclasses of :mod:`.messages`."""

    def to_json(self) -> str: ...


LIVENESS_CHECK_SECONDS = 0.5
"""How often a process with waits open reads the heartbeats of the ranks they wait for
(one read for all of them, see :class:`~slipstream.core.store_watch.StoreWatch`)."""
DEATHS_KEY = store_key("slipstream", "deaths")
"""The job's log of deaths: who saw which rank go (see :meth:`RankChannel.report_dead`)."""


def alive_key(rank: int) -> str:
    """The heartbeat counter of the job's rank ``rank``."""
    return store_key("slipstream", "alive", rank)


def _watch_for(store: dist.Store) -> StoreWatch:
    return StoreWatch(
        store, alive_key, DEATHS_KEY, BEAT_SECONDS, LIVENESS_CHECK_SECONDS, SILENT_AFTER_SECONDS
    )


WATCHES = StoreWatches(_watch_for, linger=10.0)
"""This process's liveness thread and client, one per store, shared by its channels."""
_waiting: dict[int, WaitingClients] = {}
_waiting_lock = threading.Lock()
_channels_made: dict[tuple[int, ...], int] = {}
_channels_lock = threading.Lock()

_DEAD = "slipstream_dead"
_WAKE = "slipstream_wake"
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CorruptCheckpointError,
        UnsafeCheckpointError,
        PeerTimeoutError,
        MissingRanksError,
        PeerDiedError,
    )
}


def waiting_clients(store: dist.Store) -> WaitingClients:
    """This process's clients of ``store`` for blocking waits, shared by its channels."""
    with _waiting_lock:
        found = _waiting.get(id(store))
        if found is None or found.store is not store:
            found = _waiting[id(store)] = WaitingClients(store)
        return found


def _marker(raw: bytes) -> tuple[str, str] | None:
    """``(kind, why)`` where ``raw`` is what a watch posted in a rank's place."""
    if not raw.startswith(b'{"slipstream_'):
        return None
    found = json.loads(raw)
    for kind in (_DEAD, _WAKE):
        if kind in found:
            return kind, str(found[kind])
    return None


def verdict_failure(exc: BaseException) -> str:
    """The verdict that fails an exchange on every rank with ``exc``'s class and words."""
    failed: dict[str, object] = {"kind": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, MissingRanksError):
        failed.update(ranks=list(exc.ranks), what=exc.what, waited=exc.waited)
    return json.dumps({"failed": failed})


def _verdict(raw: bytes, what: str) -> str:
    """The text of a verdict, or its failure raised as the coordinator raised it."""
    found = json.loads(raw)
    if "failed" not in found:
        return str(found["ok"])
    failed = found["failed"]
    cls = _ERRORS.get(str(failed.get("kind")), CheckpointError)
    message = str(failed.get("message"))
    if issubclass(cls, MissingRanksError):
        raise cls(message, failed.get("ranks", []), failed.get("what", what), failed["waited"])
    raise cls(message)


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
        self._local_of = {g: r for r, g in enumerate(self.global_ranks)}
        self.dead: dict[int, str] = {}
        """Ranks found dead by their silence, with what was waiting for them."""
        self._watch: StoreWatch | None = None
        if world_size > 1:
            # on a client of its own (the watch makes one): a blocking request of another
            # thread on the shared client (NCCL's lazy communicator setup waits in
            # ``store.get``) must not stop the beats, or the peers would take this rank for dead
            self._watch = WATCHES.acquire(store)
            self._watch.beat(self.global_ranks[rank])
        self._waiting = waiting_clients(store)
        if world_size > 1:
            self._waiting.prime()
        self._decided: str | None = None
        """Rank 0: the last exchange whose verdict it posted (one verdict per exchange)."""

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

    def _key(self, topic: str, rank: int | str) -> str:
        return store_key(self.namespace, topic, rank)

    def post(self, topic: str, message: Message) -> None:
        """Post this rank's ``message`` (one of :mod:`.messages`) under ``topic``."""
        self.store.set(self._key(topic, self.rank), message.to_json())

    def _mark(self, rank: int, why: str) -> str:
        return json.dumps({_DEAD: why})

    def _await(
        self, keys: dict[int, str], deadline: Deadline, what: str, wake: bool = False
    ) -> dict[int, bytes]:
        """Block (one request, on this thread's own client) until every ``keys[rank]``
        exists, then read them all in one more; this process's watch posts, in the place of
        a rank found dead, a word saying so (and with ``wake``, a word in every other
        missing rank's place, so that the wait ends at once). Raises
        :class:`PeerDiedError` naming the dead, or :class:`MissingRanksError` naming the
        ranks that did not answer by ``deadline``."""
        with self._waiting.lend() as own:
            client, until = (self.store, poll_until) if own is None else (own, block_until)
            return self._await_on(client, until, keys, deadline, what, wake)

    def _await_on(
        self,
        client: dist.Store,
        until: Callable[[dist.Store, Sequence[str], float], bool],
        keys: dict[int, str],
        deadline: Deadline,
        what: str,
        wake: bool,
    ) -> dict[int, bytes]:
        start = time.monotonic()
        assert self._watch is not None, "a channel of one rank never waits"
        watched = Watched(
            {self.global_ranks[r]: k for r, k in keys.items()},
            self._mark,
            json.dumps({_WAKE: "a rank died"}) if wake and len(keys) > 1 else None,
        )
        number = self._watch.watch(watched)
        try:
            left = deadline.remaining()
            missing: list[int] = []
            if not until(
                client, list(keys.values()), NEVER_SECONDS if left is None else left
            ):  # those that came as it timed out did answer
                missing = sorted(r for r, k in keys.items() if not client.check([k]))
            if missing:
                limit = f"{deadline.timeout:.1f} s" if deadline.timeout is not None else "ever"
                raise MissingRanksError(
                    f"{ranks_text(missing)} did not answer within {limit} while rank "
                    f"{self.rank} waited for them to {what}",
                    missing,
                    f"them to {what}",
                    time.monotonic() - start,
                )
            raws = client.multi_get(list(keys.values()))
        finally:
            self._watch.unwatch(number)
        found = dict(zip(keys, raws, strict=True))
        dead, woken = {}, []
        for rank, raw in found.items():
            marked = _marker(raw)
            if marked is not None and marked[0] == _DEAD:
                dead[rank] = marked[1]
            elif marked is not None:
                woken.append(rank)
        if dead:
            self.dead.update(dead)
            raise died_error(dead, f"them to {what}", time.monotonic() - start, f"rank {self.rank}")
        if woken:  # a rank found dead beat again and answered: the others did not, yet
            raise MissingRanksError(
                f"{ranks_text(woken)} had not answered when rank {self.rank}'s wait for them "
                f"to {what} was ended by a death that was then voided",
                woken,
                f"them to {what}",
                time.monotonic() - start,
            )
        return found

    def known_dead(self) -> dict[int, str]:
        """Ranks found dead that are still dead (a rank that beats again is forgiven)."""
        if self.dead:
            still = self.dead_among(list(self.dead))
            self.dead = {r: m for r, m in self.dead.items() if r in still}
        return dict(self.dead)

    def dead_among(self, ranks: Sequence[int]) -> dict[int, str]:
        """Which of ``ranks`` are dead now, and why (a notice's words, or their silence):
        one read."""
        if self._watch is None:
            return {}
        found = self._watch.dead_among([self.global_ranks[r] for r in ranks], self.store)
        return {self._local_of[g]: why for g, why in found.items()}

    def report_dead(self, rank: int, why: str) -> None:
        """Tell every rank's waits that ``rank`` is gone (``why``: e.g. its connection
        dropped), so they name it at once instead of after :data:`SILENT_AFTER_SECONDS`;
        void as soon as the rank beats again."""
        if self._watch is not None:
            self._watch.notice(self.global_ranks[rank], why, self.store)
        self.dead[rank] = why

    def gather_living(
        self, topic: str, decode: Decoder[_M], deadline: Deadline, what: str
    ) -> tuple[dict[int, _M], dict[int, str], list[int]]:
        """After a rank was found dead (by a wait on ``topic``, or by this rank): wait on
        for the other ranks until each has posted or is found dead too (ranks that die
        together, such as a node's, are named together), at most until ``deadline``. The
        ranks that have not posted are looked at once at the start (a death is known
        already), then every :data:`LIVENESS_CHECK_SECONDS`; the keys are polled (a slow
        path, after a death), since a word that woke an earlier wait may stand in a key
        until its rank posts. Returns the messages posted (by rank), the dead (rank: why)
        and the ranks that did neither by the deadline."""
        found: dict[int, str] = {}
        posted_raw: dict[int, bytes] = {}
        pending = set(range(self.world_size))
        start = time.monotonic()
        next_look = start
        pause = POLL_FIRST_SECONDS
        while True:
            for rank in sorted(pending):
                key = self._key(topic, rank)
                if not self.store.check([key]):
                    continue
                raw = self.store.get(key)
                marked = _marker(raw)
                if marked is None:
                    posted_raw[rank] = raw
                    pending.discard(rank)
                elif marked[0] == _DEAD:
                    found[rank] = marked[1]
                    pending.discard(rank)
                # a word that woke a wait: the rank has not posted yet
            now = time.monotonic()
            if pending and now >= next_look:
                next_look = now + LIVENESS_CHECK_SECONDS
                for rank, why in self.dead_among(sorted(pending)).items():
                    found[rank] = why
                    pending.discard(rank)
            if not pending or deadline.expired():
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_SECONDS)
        self.dead.update(found)
        posted = {
            r: decode(raw, f"rank {r}'s {topic} message") for r, raw in sorted(posted_raw.items())
        }
        return posted, found, sorted(pending)

    def close(self) -> None:
        """Let go of this process's heartbeat and watch (they stop with the last channel)."""
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.unbeat(self.global_ranks[self.rank])
            WATCHES.release(self.store)

    def gather(self, topic: str, decode: Decoder[_M], deadline: Deadline, what: str) -> list[_M]:
        """Every rank's message for ``topic`` (index = rank), read by ``decode`` (a
        message class's ``from_json``): two requests however many ranks (the coordinator's
        side of an exchange; see :meth:`exchange` for every rank's)."""
        if self.world_size == 1:
            return [self._read(topic, 0, decode)]
        keys = {r: self._key(topic, r) for r in range(self.world_size)}
        raws = self._await(keys, deadline, what, wake=True)
        return [decode(raws[r], f"rank {r}'s {topic} message") for r in range(self.world_size)]

    def receive(
        self, topic: str, decode: Decoder[_M], from_rank: int, deadline: Deadline, what: str
    ) -> _M:
        """``from_rank``'s message for ``topic``, read by ``decode``."""
        if from_rank == self.rank:
            return self._read(topic, from_rank, decode)
        raw = self._await({from_rank: self._key(topic, from_rank)}, deadline, what)[from_rank]
        return decode(raw, f"rank {from_rank}'s {topic} message")

    def exchange(
        self,
        topic: str,
        message: Message,
        decode: Decoder[_M],
        decide: Callable[[list[_M]], str | list[str]],
        deadline: Deadline,
        what: str,
        per_rank: bool = False,
    ) -> str:
        """One coordinated round: every rank posts ``message``; rank 0 gathers them all,
        ``decide``s, and posts the verdict: one text for every rank (a ``str``, under
        ``{topic}/verdict``) or, with ``per_rank``, one per rank (a list by rank, under
        ``{topic}/verdict/{r}``, in one request); every rank returns its text. A failure
        anywhere (a rank's message unreadable, ``decide`` raising, a rank dead or late) is
        the verdict, raised on every rank with its class and words. Each rank deletes its
        message and its own verdict key once read; the shared verdict stays until
        :meth:`forget_verdict`.

        Invariant: every rank leaves with the same verdict, or with the same error."""
        self.post(topic, message)
        if self.world_size == 1:
            verdict = decide([self._read(topic, 0, decode)])
            self.store.delete_key(self._key(topic, 0))
            return verdict if isinstance(verdict, str) else verdict[0]
        shared = self._key(topic, "verdict")
        own = store_key(shared, self.rank)
        if self.rank == 0:
            try:
                verdict = decide(self.gather(topic, decode, deadline, what))
            except BaseException as exc:
                self.fail_exchange(topic, exc)
                raise
            self._decided = topic
            if not per_rank:
                assert isinstance(verdict, str), "decide gives one text without per_rank"
                text = json.dumps({"ok": verdict})
                posted = self.store.compare_set(shared, "", text)
                if posted != text.encode():
                    _verdict(posted, what)  # a peer took this rank for dead: its word stands
            else:
                cast(Any, self.store).multi_set(
                    [store_key(shared, r) for r in range(1, self.world_size)],
                    [json.dumps({"ok": v}) for v in verdict[1:]],
                )
                verdict = verdict[0]
            self.store.delete_key(self._key(topic, 0))
            return verdict
        key = own if per_rank else shared
        raw = self._await({0: key}, deadline, f"decide on {what}")[0]
        self.store.delete_key(self._key(topic, self.rank))
        if key == own:
            self.store.delete_key(own)
        return _verdict(raw, what)

    def fail_exchange(self, topic: str, exc: BaseException) -> None:
        """Rank 0: post ``exc`` as the verdict of ``topic``'s exchange, shared and each
        rank's (a rank 0 that failed before it could take part in one still ends it on
        every rank at once); nothing where this rank posted that verdict already."""
        if topic == self._decided:
            return
        self._decided = topic
        failure = verdict_failure(exc)
        shared = self._key(topic, "verdict")
        self.store.compare_set(shared, "", failure)
        if self.world_size > 1:
            cast(Any, self.store).multi_set(
                [store_key(shared, r) for r in range(1, self.world_size)],
                [failure] * (self.world_size - 1),
            )
        self.store.delete_key(self._key(topic, 0))

    def forget_verdict(self, topic: str) -> None:
        """Delete ``topic``'s shared verdict (once every rank has read it)."""
        self.store.delete_key(self._key(topic, "verdict"))

    def _read(self, topic: str, rank: int, decode: Decoder[_M]) -> _M:
        return decode(self.store.get(self._key(topic, rank)), f"rank {rank}'s {topic} message")

    def forget(self, topic: str, ranks: list[int] | None = None) -> None:
        for r in range(self.world_size) if ranks is None else ranks:
            self.store.delete_key(self._key(topic, r))
