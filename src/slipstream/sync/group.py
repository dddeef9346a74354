"""The sync group: a store and process groups of slipstream's own, never the default group.

Trainer and rollout processes call :func:`init_group` with the same address, port and world
size; rank 0 hosts a ``TCPStore``. Process groups over subsets of the ranks are built from
that store on demand (:meth:`SyncGroup.subgroup`), so the process's default process group,
if it has one, is never touched and no collective of the user's ever shares a group with ours.
Each is built on a store connection of its own: its rendezvous blocks in the store, and must
not hold the connection other threads poll with.

Each publisher/subscriber set opens a channel (:meth:`SyncGroup.open_channel`): its keys and
process groups are scoped under its name, given or numbered in creation order per (trainer
ranks, rollout ranks), and a process opens a name at most once per group.

Membership: every rank beats (a thread adds to ``alive/{rank}`` every :data:`BEAT_SECONDS`),
and a rank is dead (:meth:`SyncGroup.dead`) when its process is gone (same host) or its
beat has been still for :data:`SILENT_AFTER_SECONDS`. A process that restarts calls
:func:`init_group` again with its old rank: it posts a new ``hello`` (its pid, its
incarnation number) and beats on the same key, so every rank sees it alive again and reads
its new pid; the store, hosted by rank 0, outlives it.

Waits: a wait for one rank's key blocks in one ``store.wait`` on a client of its channel's
own, ended early by the process's :class:`~.liveness.SyncWatch` when it finds that rank
dead; a wait for many keys, or one that finds its channel's client lent, polls through the
control plane (:func:`..core.control_plane.wait_for_keys`).

Invariant: every wait on the store has a timeout, its error names the ranks that did not
answer, and a rank found dead ends it within seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ..core.control_plane import (
    Heartbeat,
    died_error,
    ranks_text,
    store_key,
    wait_for_keys,
)
from ..core.fork_closed import (
    SYNC_SOCKETS,
    NewSockets,
    TcpSocket,
    group_connections,
    open_sockets,
    tcp_sockets,
)
from ..core.store_watch import WaitingClients, block_until
from ..core.strays import release_apart
from ..core.waits import Deadline
from ..errors import MissingRanksError, PeerTimeoutError, SyncError
from .liveness import Awaited, SyncWatch, read_dead_word
from .members import Member, host_identity, process_start
from .members import process_alive as process_alive  # sync/'s folders import from the group

STORE_PREFIX = "slipstream/sync/"
BEAT_SECONDS = 0.5
#: The rank whose process hosts the group's store: with it gone, nothing can be posted.
STORE_HOST = 0
SILENT_AFTER_SECONDS = 3.0
"""Silence that marks a rank on another host dead (six missed beats): with a look every
quarter second (a polling wait) or every second (a blocking one), a death is noticed within
four seconds; on the same host within a look."""

_T = TypeVar("_T")
#: A process group's backend (gloo or nccl): torch's stubs give them no common base with
#: the methods used here (send, recv, broadcast).
Backend = Any
_GLOO: Any = dist.ProcessGroupGloo


class _Membership:
    """This process's heartbeat and its view of everyone's (shared by every channel), each
    on a client of the group's store of its own."""

    def __init__(self, beat_store: dist.Store, watch_store: dist.Store, rank: int) -> None:
        self.watch = SyncWatch(watch_store, self.hello_key, self.alive_key, SILENT_AFTER_SECONDS)
        self.heartbeat = Heartbeat(beat_store, self.alive_key(rank), BEAT_SECONDS)

    @staticmethod
    def alive_key(rank: int) -> str:
        return store_key("alive", rank)

    @staticmethod
    def hello_key(rank: int) -> str:
        return store_key("hello", rank)

    def close(self) -> None:
        self.heartbeat.close()
        self.watch.close()


@dataclass
class SyncGroup:
    """Membership of one sync group as seen from one rank.

    ``store`` is the group's own (prefixed) store; :meth:`member` reads a rank's current
    process (host, pid, incarnation) from it, so a rank whose process was replaced is seen
    with its new pid. ``world_size`` is the size this rank joined with: ranks past it may
    join later (:func:`init_group`). Process groups made by :meth:`subgroup` are cached and
    belong to this object.
    """

    store: dist.Store
    rank: int
    world_size: int
    timeout: float
    backend: str
    addr: str
    incarnation: int
    _tcp_store: dist.Store
    _root_store: dist.Store
    _membership: _Membership
    channel_name: str = ""
    waiting_clients: WaitingClients | None = None
    """Clients of ``store`` for this channel's blocking waits (:meth:`get_text`): opened
    by :meth:`open_channel`, never inside a wait; with none, a wait polls."""
    _root_prefix: str = ""
    """What ``store`` puts before a key, in the root store's keys."""
    _subgroups: dict[tuple[str, str, tuple[int, ...]], Backend] = field(default_factory=dict)
    # shared by every channel view of this group (dataclasses.replace keeps the references)
    _channels: _Channels = field(default_factory=lambda: _Channels(), repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        """Where transfer buffers live: host memory for gloo, the current GPU for nccl."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def subgroup(self, ranks: Sequence[int], tag: str = "") -> Backend:
        """A process group over ``ranks`` (this rank must be one), built from the group's store.

        Every member must call this with the same ranks and ``tag``; construction waits for
        all of them. A new ``tag`` (an epoch) builds a new group over the same ranks: torch
        process groups cannot change members, so a rank whose process was replaced is met
        in a group of a new tag.
        """
        key = tuple(ranks)
        cached = self._subgroups.get((self.channel_name, tag, key))
        if cached is not None:
            return cached
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not a member of subgroup {list(key)}")
        name = store_key("pg", self.channel_name, tag, "_".join(map(str, key))) + "/"
        # the rendezvous blocks in the store: on a client of its own, so that it never holds
        # the one other threads (other channels, the publisher's worker) poll with
        prefix = dist.PrefixStore(STORE_PREFIX + name, self._store_client())
        rank_in_group = key.index(self.rank)
        before = open_sockets()
        listeners: dict[int, TcpSocket] | None = None  # the group's own (gloo's device's)
        try:
            if self.backend == "gloo":
                opts = _GLOO._Options()
                opts._timeout = timedelta(seconds=self.timeout)
                device, listeners = _device_and_listeners(self.addr)
                opts._devices = [device]
                pg: Backend = _GLOO(prefix, rank_in_group, len(key), opts)
            else:
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timedelta(seconds=self.timeout)
                pg = dist.ProcessGroupNCCL(prefix, rank_in_group, len(key), nccl_opts)
        except RuntimeError as exc:
            raise PeerTimeoutError(
                f"rank {self.rank}: building the sync subgroup over ranks {list(key)} failed "
                f"within {self.timeout} s (a member did not join?): {exc}"
            ) from exc
        # gloo connects every pair while it is built: a forked child lets go of those
        # connections (core.fork_closed), told apart from what other threads opened meanwhile
        opened = {fd: s for fd, s in open_sockets().items() if before.get(fd) != s}
        SYNC_SOCKETS.add(id(pg), self._group_connections(name, key, opened, listeners))
        self._subgroups[(self.channel_name, tag, key)] = pg
        return pg

    def _group_connections(
        self,
        name: str,
        ranks: tuple[int, ...],
        opened: dict[int, str],
        listeners: dict[int, TcpSocket] | None,
    ) -> dict[int, str]:
        """Those of ``opened`` (the sockets this process opened while the group ``name`` over
        ``ranks`` was built) that are its connections to the other members: every member
        posts its new TCP connections and the group's own ``listeners`` (``None``: every
        listener opened meanwhile) and reads the others'
        (:func:`..core.fork_closed.group_connections`)."""
        mine = tcp_sockets(opened)
        if listeners is None:
            listeners = {fd: s for fd, s in mine.items() if s.listening}
        conns = [s for s in mine.values() if not s.listening]
        own = NewSockets.of([*conns, *listeners.values()])
        self.post(f"{name}sockets/{self.rank}", own.to_json())
        keys = {r: f"{name}sockets/{r}" for r in ranks if r != self.rank}
        self.wait_keys(keys, f"the new sockets of subgroup {list(ranks)}")
        others = [NewSockets.from_json(self.read(k)) for k in keys.values()]
        return {fd: opened[fd] for fd in group_connections(mine, own, others)}

    def drop_subgroup(self, ranks: Sequence[int], tag: str = "", broken: bool = False) -> None:
        """Forget the process group of ``ranks`` and ``tag`` and let it go: its connections
        are shut down now (whatever still references the group: a broken transfer's
        frames, its pending messages), so every member blocked on one of its messages
        fails at once. A ``broken`` transfer's group may still have receives queued, which
        its destructor runs, each until it fails or times out: that group is destroyed
        apart (:func:`~slipstream.core.strays.release_apart`)."""
        box = [self._subgroups.pop((self.channel_name, tag, tuple(ranks)), None)]
        if box[0] is None:
            return
        SYNC_SOCKETS.shut_down(id(box[0]))
        SYNC_SOCKETS.discard(id(box[0]))
        if broken:
            release_apart(box, self.timeout, f"slipstream-sync-drop-{tag}")

    def cut_subgroup(self, ranks: Sequence[int], tag: str = "") -> None:
        """Shut the connections of the process group of ``ranks`` and ``tag`` down (it
        stays cached until dropped): every wait on it fails at once, here and at each
        member that is still reachable."""
        pg = self._subgroups.get((self.channel_name, tag, tuple(ranks)))
        if pg is not None:
            SYNC_SOCKETS.shut_down(id(pg))

    def _store_client(self) -> dist.Store:
        """A new connection to the group's store (its own lock, its own blocking waits)."""
        return clone_store(self._tcp_store)

    def channel(self, name: str) -> SyncGroup:
        """The same group with keys and process groups of its own, scoped under ``name``.

        One channel serves one set of publishers and subscribers, so two channels never
        issue collectives on the same process group from different threads.
        """
        store = dist.PrefixStore(f"{name}/", self.store)
        return dataclasses.replace(
            self,
            store=store,
            channel_name=name,
            waiting_clients=WaitingClients(store),
            _root_prefix=f"{self._root_prefix}{name}//",  # a prefix store adds a "/"
        )

    def open_channel(
        self, name: str | None, trainer_ranks: Sequence[int], rollout_ranks: Sequence[int]
    ) -> SyncGroup:
        """The channel of one publisher/subscriber set of ``trainer_ranks`` and
        ``rollout_ranks``: ``name``, or when it is ``None`` the next default name for those
        ranks (:func:`default_channel_name`, numbered in this process's creation order).

        Raises ``ValueError`` when this process already opened a channel of that name on this
        group: its store keys would meet the old set's (a closed set's keys stay behind).
        """
        view = self.channel(f"channel/{self._channels.claim(name, trainer_ranks, rollout_ranks)}")
        assert view.waiting_clients is not None
        view.waiting_clients.prime()
        return view

    def post(self, key: str, text: str) -> None:
        """Write ``text`` (an encoded :mod:`.round.protocol` message) at ``key``."""
        self._call(lambda: self.store.set(key, text), f"writing {key}")

    def post_first(self, key: str, text: str) -> bytes:
        """Write ``text`` at ``key`` unless some rank wrote it first; return what is there."""
        result: bytes = self._call(lambda: self.store.compare_set(key, "", text), f"writing {key}")
        return result

    def append(self, key: str, text: str) -> None:
        """Append ``text`` to ``key`` (made empty when absent)."""
        store = cast(Any, self.store)
        self._call(lambda: store.append(key, text.encode()), f"appending to {key}")

    def set_json(self, key: str, value: object) -> None:
        self._call(lambda: self.store.set(key, json.dumps(value)), f"writing {key}")

    def get_json(self, key: str, rank: int, what: str, timeout: float | None = None) -> Any:
        """The JSON value at ``key``, written by ``rank``; waits up to ``timeout``."""
        return json.loads(self.get_text(key, rank, what, timeout))

    def get_text(self, key: str, rank: int, what: str, timeout: float | None = None) -> bytes:
        """The bytes at ``key``, written by ``rank``; waits up to ``timeout`` (or until
        ``rank`` is found dead: :class:`~slipstream.errors.PeerDiedError` naming it).

        The wait blocks in one ``store.wait`` on a client of the channel's own, this
        process's :class:`~.liveness.SyncWatch` posting in ``rank``'s place once it finds
        it dead; where every such client is lent (another thread of this channel waits),
        it polls (:meth:`wait_keys`)."""
        timeout = self.timeout if timeout is None else timeout
        started = time.monotonic()
        waiting = self.waiting_clients
        if waiting is None or waiting.store is not self.store:  # a view of another store
            return self._polled_text(key, rank, what, timeout, started)
        with waiting.lend() as own:
            if own is None:
                return self._polled_text(key, rank, what, timeout, started)
            client = own
            raw = self._call(lambda: self._blocked_text(client, key, rank, what, timeout), what)
        return self._answer(raw, what, started)

    def _polled_text(self, key: str, rank: int, what: str, timeout: float, started: float) -> bytes:
        self.wait_keys({rank: key}, what, timeout)
        return self._answer(self._call(lambda: self.store.get(key), what), what, started)

    def _blocked_text(
        self, client: dist.Store, key: str, rank: int, what: str, timeout: float
    ) -> bytes:
        """Block on ``client`` until ``key`` exists (``rank``'s answer, or the word of its
        death) and read it: two requests, however long the wait."""
        watch = self._membership.watch
        number = watch.watch(Awaited(rank, self._root_prefix + key))
        started = time.monotonic()
        try:
            if not block_until(client, [key], timeout) and not client.check([key]):
                raise MissingRanksError(
                    f"{ranks_text([rank])} did not answer within {timeout:.1f} s while "
                    f"rank {self.rank} waited for {what}",
                    [rank],
                    what,
                    time.monotonic() - started,
                )
        finally:
            watch.unwatch(number)
        raw: bytes = client.get(key)
        return raw

    def _answer(self, raw: bytes, what: str, started: float) -> bytes:
        """``raw``, read from a key; the death it names raised where a watch posted one."""
        dead = read_dead_word(raw)
        if dead is not None:
            waited = time.monotonic() - started
            raise died_error({dead[0]: dead[1]}, what, waited, f"rank {self.rank}")
        return raw

    def read_all(self, keys: Sequence[str]) -> list[bytes]:
        """The bytes at each of ``keys``, which a wait found there: one request; the death
        a watch posted in one's place raised."""
        if not keys:
            return []
        started = time.monotonic()
        found: list[bytes] = self._call(lambda: self.store.multi_get(list(keys)), "reading")
        return [
            self._answer(raw, f"reading {key}", started)
            for key, raw in zip(keys, found, strict=True)
        ]

    def has(self, key: str) -> bool:
        return self._call(lambda: self.store.check([key]), f"looking for {key}")

    def read(self, key: str) -> bytes:
        """The bytes at ``key``, which :meth:`has` found there (no wait); the death it
        names raised where a watch posted one."""
        result: bytes = self._call(lambda: self.store.get(key), f"reading {key}")
        return self._answer(result, f"reading {key}", time.monotonic())

    def count(self, key: str, delta: int = 0) -> int:
        """Add ``delta`` to the counter at ``key`` (created at 0) and return its new value."""
        return int(self._call(lambda: self.store.add(key, delta), f"counter {key}"))

    def wait_keys(
        self,
        keys: dict[int, str],
        what: str,
        timeout: float | None = None,
        idle: Callable[[], None] | None = None,
        drop_dead: bool = False,
    ) -> dict[int, str]:
        """Wait until every ``keys[rank]`` exists (:func:`..core.control_plane.wait_for_keys`,
        with this group's liveness): a rank found dead ends the wait at once with
        :class:`~slipstream.errors.PeerDiedError` naming it, or with ``drop_dead`` is no
        longer waited for (returned, with why). ``idle`` runs between polls."""
        timeout = self.timeout if timeout is None else timeout
        return self._call(
            lambda: wait_for_keys(
                self.store,
                keys,
                what,
                Deadline(timeout),
                f"rank {self.rank}",
                self.dead,
                idle,
                drop_dead,
            ),
            what,
        )

    def _call(self, fn: Callable[[], _T], what: str) -> _T:
        try:
            return fn()
        except dist.DistNetworkError as exc:
            raise SyncError(
                f"rank {self.rank} lost the sync group's store (hosted by rank 0) during "
                f"{what}: {exc}"
            ) from exc

    def joined(self, rank: int) -> bool:
        """Whether a process ever joined at ``rank``."""
        key = f"hello/{rank}"
        return self._call(lambda: self._root_store.check([key]), "looking for a hello")

    def member(self, rank: int) -> Member:
        """Rank ``rank``'s current process, as it posted when it (re)joined."""
        return Member.of_hello(self._call(lambda: self._root_store.get(f"hello/{rank}"), "hello"))

    def members(self, ranks: Sequence[int]) -> dict[int, Member]:
        """The current process of each of ``ranks`` (every one joined): one request."""
        if not ranks:
            return {}
        keys = [f"hello/{r}" for r in ranks]
        hellos = self._call(lambda: self._root_store.multi_get(keys), "reading hellos")
        return {r: Member.of_hello(raw) for r, raw in zip(ranks, hellos, strict=True)}

    def wait_joined(self, ranks: Sequence[int], what: str, timeout: float | None = None) -> None:
        """Wait until a process joined at each of ``ranks`` (:func:`init_group`), up to
        ``timeout`` (the group's), naming the ranks that did not."""
        root = dataclasses.replace(self, store=self._root_store)
        root.wait_keys({r: f"hello/{r}" for r in ranks}, what, timeout)

    def colocated(self, ranks: Iterable[int]) -> bool:
        """True when every rank in ``ranks`` shares this rank's host."""
        here = host_identity()
        return all(self.member(r).host == here for r in ranks)

    def dead(self, ranks: Sequence[int]) -> dict[int, str]:
        """Those of ``ranks`` found dead, with why: a process of this host (same kernel and
        PID namespace, :func:`host_identity`) that is gone, or a rank whose heartbeat has
        been still for :data:`SILENT_AFTER_SECONDS`."""
        watch = self._membership.watch
        return self._call(lambda: watch.dead_among(ranks, self._root_store), "reading heartbeats")

    def close(self, timeout: float | None = None) -> None:
        """Leave the group: shut our subgroups down, stop beating, say goodbye on the store.

        Rank 0 hosts the store, so it waits (up to ``timeout``) until every other rank said
        goodbye or is found dead before it returns and may exit; a rank that never does is
        named.
        """
        for pg in self._subgroups.values():
            SYNC_SOCKETS.discard(id(pg))
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass
        self._subgroups.clear()
        self._membership.close()
        try:
            self._root_store.set(f"bye/{self.rank}", "1")
        except RuntimeError:
            return  # the store's host is gone: nobody is left to wait for us
        if self.rank == 0:
            root = dataclasses.replace(self, store=self._root_store)
            grown = int(self._root_store.get(WORLD_KEY))  # ranks past ours may have joined
            ranks = [r for r in range(max(grown, self.world_size)) if root.joined(r)]
            root.wait_keys(
                {r: f"bye/{r}" for r in ranks},
                "every rank to leave",
                timeout,
                drop_dead=True,
            )

    def __enter__(self) -> SyncGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def default_channel_name(trainer_ranks: Sequence[int], rollout_ranks: Sequence[int], n: int) -> str:
    """The name of the ``n``-th (from 0) channel opened without a name for these ranks."""
    trainers = "_".join(map(str, trainer_ranks))
    rollouts = "_".join(map(str, rollout_ranks))
    return f"weights-{n}-t{trainers}-r{rollouts}"


class _Channels:
    """The channel names this process opened on one group, and how many it opened without a
    name per (trainer ranks, rollout ranks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._used: set[str] = set()
        self._unnamed: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}

    def claim(
        self, name: str | None, trainer_ranks: Sequence[int], rollout_ranks: Sequence[int]
    ) -> str:
        with self._lock:
            if name is None:
                key = (tuple(trainer_ranks), tuple(rollout_ranks))
                n = self._unnamed.get(key, 0)
                self._unnamed[key] = n + 1
                name = default_channel_name(trainer_ranks, rollout_ranks, n)
            if not name:
                raise ValueError("a channel name must not be empty")
            if name in self._used:
                raise ValueError(
                    f"channel {name!r} was already opened on this sync group by this process; "
                    "every publisher/subscriber set needs a channel of its own (pass another "
                    "channel= name, or leave it out to number them in creation order)"
                )
            self._used.add(name)
            return name


#: Held while a gloo device is made, so the listener that appears meanwhile is its own.
_DEVICE_LOCK = threading.Lock()


def _device_and_listeners(addr: str) -> tuple[Any, dict[int, TcpSocket]]:
    """A new gloo device (:func:`gloo_device`) and the listening sockets it opened: the
    listener of the process group it is made for, told apart from another group's made
    on another thread at the same time (made one at a time here)."""
    with _DEVICE_LOCK:
        before = open_sockets()
        device = gloo_device(addr)
        new = {fd: s for fd, s in open_sockets().items() if before.get(fd) != s}
    return device, {fd: s for fd, s in tcp_sockets(new).items() if s.listening}


def gloo_device(addr: str) -> Any:
    """The gloo device of this rank's transfer groups: the interface ``GLOO_SOCKET_IFNAME``
    names (as torch's own groups use), else the address this host reaches the store's host
    ``addr`` from, so a rank listens where its peers can reach it whatever its hostname
    resolves to (a container's, a network namespace's)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return _GLOO.create_device(interface=interface.split(",")[0])
    if addr in ("127.0.0.1", "localhost"):
        return _GLOO.create_device(hostname="127.0.0.1")
    try:
        info = socket.getaddrinfo(addr, None, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as probe:
            probe.connect((info[4][0], 9))  # no packet leaves: connect only picks a route
            local = probe.getsockname()[0]
    except OSError:
        return _GLOO.create_default_device()
    return _GLOO.create_device(hostname=local)


def clone_store(store: dist.Store) -> dist.Store:
    """A new client of the TCP store ``store`` (torch's stubs do not list ``clone``)."""
    client: dist.Store = cast(Any, store).clone()
    return client


#: The largest world size a rank joined with: ranks past the first world size may join.
WORLD_KEY = "world_size"


def _grow(store: dist.Store, world_size: int) -> None:
    """Raise the group's recorded world size to ``world_size`` (never lower it)."""
    seen = store.compare_set(WORLD_KEY, "", str(world_size)).decode()
    while int(seen) < world_size:
        seen = store.compare_set(WORLD_KEY, seen, str(world_size)).decode()


def init_group(
    addr: str,
    port: int,
    world_size: int,
    rank: int,
    backend: str = "gloo",
    timeout: float | timedelta = 300.0,
    on_listening: Callable[[int], object] | None = None,
    idle: Callable[[], None] | None = None,
) -> SyncGroup:
    """Join a sync group of ``world_size`` processes; rank 0 hosts its store at ``addr:port``.

    Rank 0 may pass ``port=0``: its store then listens on a port the system picks, which
    ``on_listening`` is called with as soon as the store listens (before the wait for the
    other ranks), to tell them; no other process can take it in between. ``idle`` runs
    while this rank waits for the others: raising from it ends the wait (a caller that
    learnt some rank will not come).

    Does not touch the default process group. Returns once every rank has joined, or raises
    :class:`PeerTimeoutError` naming the ranks that did not within ``timeout`` seconds.

    A process that replaces a dead one calls this with the dead one's rank (the store's host,
    rank 0, must still run): it joins the running group; the others see its new process
    from then on (see :mod:`.publisher` for how it takes part in publishes again).

    A group grows: a process may join a running group at a rank past its first world size,
    passing a ``world_size`` that counts it (it waits for every rank below that to have
    joined); a publisher takes it in with :meth:`.publisher.WeightPublisher.set_rollouts`.
    Rank 0's :meth:`SyncGroup.close` waits for every rank that joined.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    if port == 0 and rank != 0:
        raise ValueError(f"rank {rank} must be given the port rank 0's store listens on")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    tcp = dist.TCPStore(
        addr,
        port,
        world_size,
        rank == 0,
        timeout=timedelta(seconds=seconds),
        wait_for_workers=False,
    )
    if on_listening is not None:
        on_listening(tcp.port)
    store = dist.PrefixStore(STORE_PREFIX, tcp)
    _grow(store, world_size)
    incarnation = store.add(f"incarnation/{rank}", 1)
    store.delete_key(f"bye/{rank}")
    pid = os.getpid()
    hello = {
        "host": host_identity(),
        "pid": pid,
        "start": process_start(pid),
        "incarnation": incarnation,
    }
    # both under the one prefix: a prefix store puts a "/" between its prefix and a key;
    # its first beat before the hello, so that a rank that joined has a counter to read
    membership = _Membership(
        dist.PrefixStore(STORE_PREFIX, clone_store(tcp)),
        dist.PrefixStore(STORE_PREFIX, clone_store(tcp)),
        rank,
    )
    store.set(f"hello/{rank}", json.dumps(hello))
    group = SyncGroup(
        store, rank, world_size, seconds, backend, addr, incarnation, tcp, store, membership
    )
    try:
        group.wait_keys(
            {r: f"hello/{r}" for r in range(world_size)}, "every rank to join", idle=idle
        )
    except BaseException:
        membership.close()
        raise
    return group
