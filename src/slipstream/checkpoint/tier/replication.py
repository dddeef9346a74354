"""Copies of a node's local-tier files on peer ranks, over slipstream's own peer link.

Each rank runs one :class:`~slipstream.core.peer_link.PeerServer` for as long as its local
tier is open, serving :class:`TierFiles`: replicas streamed in by peers are written into
this node's local tier (``step_<k>/<file>``), and peers that lost their own node read files
from it. Servers find each other through the job's store (:class:`PeerDirectory`); no
collective runs on any process group.

Invariant: a file a peer has acknowledged is whole under its name on this node's storage
(the writer finished before the acknowledgement); a write cut short is never acknowledged,
and a step is listed only once a marker written after every acknowledgement names it (see
:mod:`.local_tier`).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
from collections.abc import Callable

from ...core.peer_auth import LinkAuth
from ...core.peer_link import CHUNK_BYTES, PeerClient
from ...core.waits import Deadline
from ..save.channel import LIVENESS_CHECK_SECONDS, RankChannel
from ..storage import LocalStorage, Storage
from ..storage.recycle import claim
from .messages import PeerAddress, TierTopics

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^(step_\d+)/([^/]+)$")
LOOK_SECONDS = LIVENESS_CHECK_SECONDS / 2
"""How often the peers of the requests in flight are looked at (as the channel's waits do)."""


def split_name(name: str) -> tuple[str, str]:
    """``step_<k>/<file>`` as its two parts; anything else is refused, naming it."""
    match = _NAME.match(name)
    if match is None or match.group(2) in (".", ".."):
        raise ValueError(f"{name!r} is not a local-tier file name (step_<k>/<file>)")
    return match.group(1), match.group(2)


class TierFiles:
    """This node's local tier as a peer link handler; step locations are opened once and
    kept until :meth:`forget` (retention) or :meth:`close`, so their file handles are too."""

    def __init__(self, root: Storage) -> None:
        self.root = root
        self._steps: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def step(self, step_name: str) -> Storage:
        with self._lock:
            location = self._steps.get(step_name)
            if location is None:
                location = self._steps[step_name] = self.root.child(step_name)
            return location

    def forget(self, step_name: str) -> None:
        with self._lock:
            location = self._steps.pop(step_name, None)
        if location is not None:
            location.close()

    def receive(self, name: str, length: int, chunks: Callable[[memoryview], int]) -> None:
        step_name, file = split_name(name)
        location = self.step(step_name)
        location.prepare()
        if isinstance(location, LocalStorage):
            _receive_mapped(location, file, length, chunks)
            return
        buf = memoryview(bytearray(min(CHUNK_BYTES, max(length, 1))))
        with location.open_writer(file, memoryview(b"")) as out:
            try:
                done = 0
                while done < length:
                    n = chunks(buf[: min(len(buf), length - done)])
                    out.append(buf[:n], done)
                    done += n
                out.finish()
            except BaseException:
                out.abort()
                raise

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        step_name, file = split_name(name)
        self.step(step_name).read_into(file, offset, out)

    def file_of(self, name: str) -> str | None:
        step_name, file = split_name(name)
        location = self.step(step_name)
        if not isinstance(location, LocalStorage):
            return None
        return os.path.join(location.path, file)

    def close(self) -> None:
        with self._lock:
            steps, self._steps = list(self._steps.values()), {}
        for location in steps:
            location.close()


def _receive_mapped(
    location: LocalStorage, file: str, length: int, chunks: Callable[[memoryview], int]
) -> None:
    """Receive straight into the file's pages (one copy, off the socket): its space is
    allocated first, so a full filesystem is an ``OSError`` here, never a fault on a
    mapped page; a spare of the same name is written over where there is one."""
    path = os.path.join(location.path, file)
    if location.spare_dir is not None:
        claim(location.spare_dir, file, path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, length)
        if length:
            os.posix_fallocate(fd, 0, length)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            with mmap.mmap(fd, length, flags=flags) as mapped:
                view = memoryview(mapped)
                try:
                    done = 0
                    while done < length:
                        done += chunks(view[done : min(length, done + CHUNK_BYTES)])
                finally:
                    view.release()
        os.fsync(fd)
    except BaseException:
        try:
            os.remove(path)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def send_file(client: PeerClient, location: Storage, name: str, file: str, size: int) -> None:
    """Put ``size`` bytes of ``file`` of ``location`` to ``client``'s peer as ``name``."""
    if isinstance(location, LocalStorage):
        client.put_file(name, os.path.join(location.path, file), size)
    else:
        client.put(name, size, lambda offset, buf: location.read_into(file, offset, buf))


class PeerDirectory:
    """Every rank's peer link address, posted once to the channel and read when first
    needed; one pooled client per peer, authenticated by ``auth``.

    Invariant: a request to a peer waits no longer than the channel's liveness takes to
    find that peer dead. A host that vanished (its link cut, its processes stopped) resets
    no connection, so a blocked send or receive to it would last the whole timeout; while
    any request is in flight, the directory's watch thread asks the channel about the
    peers those requests go to every :data:`LOOK_SECONDS`, and cuts the requests to one
    found dead (:meth:`PeerClient.cut`), which then fail with a :class:`PeerDiedError`
    naming it and why. A directory with no request in flight asks the store nothing; the
    thread belongs to the directory and :meth:`close` joins it."""

    def __init__(
        self, channel: RankChannel, address: tuple[str, int], timeout: float, auth: LinkAuth
    ) -> None:
        self.channel = channel
        self.timeout = timeout
        self._auth = auth
        self._clients: dict[int, PeerClient] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        channel.post(TierTopics.address(), PeerAddress(address[0], address[1]))
        self._watch = threading.Thread(
            target=self._cut_the_dead, name="slipstream-peer-watch", daemon=True
        )
        self._watch.start()

    def _cut_the_dead(self) -> None:
        while not self._closed.wait(LOOK_SECONDS):
            with self._lock:
                busy = {rank: c for rank, c in self._clients.items() if c.busy()}
            if not busy:
                continue
            try:
                dead = self.channel.dead_among(sorted(busy))
            except Exception as exc:  # the store: the requests keep their own timeouts
                logger.debug("rank %d could not look at its peers: %s", self.channel.rank, exc)
                continue
            for rank, why in dead.items():
                busy[rank].cut(f"rank {self.channel.rank} found rank {rank} dead ({why})")

    def client(self, rank: int) -> PeerClient:
        with self._lock:
            client = self._clients.get(rank)
        if client is not None:
            return client
        posted = self.channel.receive(
            TierTopics.address(),
            PeerAddress.from_json,
            rank,
            Deadline(self.timeout),
            "publish its local-tier address",
        )
        address = (posted.host, posted.port)
        who = f"rank {rank} ({address[0]}:{address[1]})"
        client = PeerClient(address, who, rank, self.timeout, self._auth)
        with self._lock:
            return self._clients.setdefault(rank, client)

    def send(self, ranks: list[int], location: Storage, step_name: str, file: str) -> int:
        """Copy ``file`` of ``location`` to each of ``ranks``' nodes as ``step_name/file``;
        returns its size once every peer has stored it whole."""
        size = location.size(file)
        for rank in ranks:
            send_file(self.client(rank), location, f"{step_name}/{file}", file, size)
        return size

    def close(self) -> None:
        self._closed.set()
        self._watch.join(LOOK_SECONDS + self.timeout)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
