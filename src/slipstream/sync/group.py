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

Invariant: every wait on the store has a timeout, and its error names the ranks that did
not answer.
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

import torch
import torch.distributed as dist

from ..errors import PeerTimeoutError, SyncError

STORE_PREFIX = "slipstream/sync/"


def host_identity() -> str:
    """Hostname plus boot id: equal exactly when two processes share a kernel (and /dev/shm)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass
class SyncGroup:
    """Membership of one sync group as seen from one rank.

    ``store`` is the group's own (prefixed) store; ``hosts[r]`` and ``pids[r]`` are rank ``r``'s
    host identity and process id.
    Process groups made by :meth:`subgroup` are cached and belong to this object.
    """

    store: dist.Store
    rank: int
    world_size: int
    timeout: float
    backend: str
    addr: str
    hosts: list[str]
    pids: list[int]
    _tcp_store: dist.Store
    _root_store: dist.Store
    channel_name: str = ""
    _subgroups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = field(default_factory=dict)
    # shared by every channel view of this group (dataclasses.replace keeps the references)
    _channels: _Channels = field(default_factory=lambda: _Channels(), repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        """Where transfer buffers live: host memory for gloo, the current GPU for nccl."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def subgroup(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """A process group over ``ranks`` (this rank must be one), built from the group's store.

        Every member must call this with the same ranks; construction waits for all of them.
        """
        key = tuple(ranks)
        cached = self._subgroups.get((self.channel_name, key))
        if cached is not None:
            return cached
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not a member of subgroup {list(key)}")
        name = f"pg/{self.channel_name}/" + "_".join(map(str, key)) + "/"
        # the rendezvous blocks in the store: on a client of its own, so that it never holds
        # the one other threads (other channels, the publisher's worker) poll with
        prefix = dist.PrefixStore(STORE_PREFIX + name, self._store_client())
        rank_in_group = key.index(self.rank)
        try:
            if self.backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timedelta(seconds=self.timeout)
                if self.addr in ("127.0.0.1", "localhost"):
                    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
                else:
                    device = dist.ProcessGroupGloo.create_default_device()
                opts._devices = [device]
                pg = dist.ProcessGroupGloo(prefix, rank_in_group, len(key), opts)
            else:
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timedelta(seconds=self.timeout)
                pg = dist.ProcessGroupNCCL(prefix, rank_in_group, len(key), nccl_opts)
        except RuntimeError as exc:
            raise PeerTimeoutError(
                f"rank {self.rank}: building the sync subgroup over ranks {list(key)} failed "
                f"within {self.timeout} s (a member did not join?): {exc}"
            ) from exc
        self._subgroups[(self.channel_name, key)] = pg
        return pg

    def _store_client(self) -> dist.Store:
        """A new connection to the group's store (its own lock, its own blocking waits)."""
        return self._tcp_store.clone()

    def channel(self, name: str) -> SyncGroup:
        """The same group with keys and process groups of its own, scoped under ``name``.

        One channel serves one set of publishers and subscribers, so two channels never
        issue collectives on the same process group from different threads.
        """
        return dataclasses.replace(
            self, store=dist.PrefixStore(f"{name}/", self.store), channel_name=name
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
        return self.channel(f"channel/{self._channels.claim(name, trainer_ranks, rollout_ranks)}")

    def set_json(self, key: str, value: object) -> None:
        self.store.set(key, json.dumps(value))

    def get_json(self, key: str, rank: int, what: str, timeout: float | None = None) -> object:
        """The JSON value at ``key``, written by ``rank``; waits up to ``timeout``."""
        self.wait_keys({rank: key}, what, timeout)
        return json.loads(self._call(lambda: self.store.get(key), what))

    def count(self, key: str, delta: int = 0) -> int:
        """Add ``delta`` to the counter at ``key`` (created at 0) and return its new value."""
        return int(self._call(lambda: self.store.add(key, delta), f"counter {key}"))

    def wait_keys(
        self,
        keys: dict[int, str],
        what: str,
        timeout: float | None = None,
        idle: Callable[[], None] | None = None,
    ) -> None:
        """Wait until every ``keys[rank]`` exists; on expiry name the ranks that did not write.

        Polls with ``check`` rather than a blocking ``wait``: a store client serves one
        request at a time, so a long blocking wait on one thread would stall every other
        thread of the process that uses the same store. ``idle`` runs between polls.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = dict(keys)
        sleep = 0.0005
        while pending:
            for r, k in list(pending.items()):
                if self._call(lambda k=k: self.store.check([k]), what):
                    del pending[r]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"rank {self.rank}: rank(s) {sorted(pending)} did not answer within "
                    f"{timeout:.1f} s while waiting for {what}"
                )
            if idle is not None:
                idle()
            time.sleep(sleep)
            sleep = min(0.02, sleep * 2)

    def _call(self, fn, what: str):
        try:
            return fn()
        except dist.DistNetworkError as exc:
            raise SyncError(
                f"rank {self.rank} lost the sync group's store (hosted by rank 0) during "
                f"{what}: {exc}"
            ) from exc

    def colocated(self, ranks: Iterable[int]) -> bool:
        """True when every rank in ``ranks`` shares this rank's host."""
        return all(self.hosts[r] == self.hosts[self.rank] for r in ranks)

    def exited(self, ranks: Iterable[int], grace: float = 1.0) -> list[int]:
        """Those of ``ranks`` on this host whose process is gone (others cannot be told),
        looking for up to ``grace`` seconds: a peer's sockets close while it exits, a moment
        before its process is gone."""
        local = [r for r in ranks if self.colocated([r])]
        if not local:
            return []
        deadline = time.monotonic() + grace
        while True:
            gone = [r for r in local if not process_alive(self.pids[r])]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.02)

    def close(self, timeout: float | None = None) -> None:
        """Leave the group: shut our subgroups down, then say goodbye on the store.

        Rank 0 hosts the store, so it waits (up to ``timeout``) until every other rank said
        goodbye before it returns and may exit; a rank that never does is named.
        """
        for pg in self._subgroups.values():
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError:
                    pass
        self._subgroups.clear()
        try:
            self._root_store.set(f"bye/{self.rank}", "1")
        except RuntimeError:
            return  # the store's host is gone: nobody is left to wait for us
        if self.rank == 0:
            root = dataclasses.replace(self, store=self._root_store)
            root.wait_keys(
                {r: f"bye/{r}" for r in range(self.world_size)}, "every rank to leave", timeout
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


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (possibly another user's); one that
    exited but was not yet reaped by its parent (a zombie) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def init_group(
    addr: str,
    port: int,
    world_size: int,
    rank: int,
    backend: str = "gloo",
    timeout: float | timedelta = 300.0,
) -> SyncGroup:
    """Join a sync group of ``world_size`` processes; rank 0 hosts its store at ``addr:port``.

    Does not touch the default process group. Returns once every rank has joined, or raises
    :class:`PeerTimeoutError` naming the ranks that did not within ``timeout`` seconds.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    tcp = dist.TCPStore(
        addr,
        port,
        world_size,
        rank == 0,
        timeout=timedelta(seconds=seconds),
        wait_for_workers=False,
    )
    store = dist.PrefixStore(STORE_PREFIX, tcp)
    store.set(f"hello/{rank}", json.dumps({"host": host_identity(), "pid": os.getpid()}))
    group = SyncGroup(store, rank, world_size, seconds, backend, addr, [], [], tcp, store)
    group.wait_keys({r: f"hello/{r}" for r in range(world_size)}, "every rank to join", seconds)
    hello = [json.loads(store.get(f"hello/{r}")) for r in range(world_size)]
    group.hosts = [h["host"] for h in hello]
    group.pids = [h["pid"] for h in hello]
    return group
