"""Sockets a forked child lets go of: :class:`ForkClosedSockets`.

A process that forks without exec (an inference engine starting its workers, a
``multiprocessing`` fork) hands its children every descriptor it has open. When it then
dies, the sockets of its transfer process groups live on in the children, so its peers'
connections do not close, and a peer blocked on one of them (gloo's waits cannot be polled
or cut short) waits out the group's timeout instead of failing at once. The connections a
process group opened are recorded here when it is built; in a forked child (an
``os.register_at_fork`` hook, installed once) each is pointed at ``/dev/null``, so the
parent's death closes the connection as if it had no children.

Which sockets are a group's own (:func:`group_connections`): of the sockets opened while it
was built, the TCP connections whose other end is a connection another member opened
meanwhile (each member posts its :class:`NewSockets`), accepted on a listener of that group
at one of the two (the listener its transport opened, each member posting its own). Whatever
another thread opened in that window is left out: a UNIX socket (a ``multiprocessing.Pipe``,
a socketpair), a connection to anything but a member, one between members on a listener
older than the window (the sync group's store), and the connections of another group built
at the same time between the same members (on that group's listeners).

Invariant: only a descriptor that still names the very socket recorded (the same inode)
is touched in the child, and it stays open there (on ``/dev/null``), so a descriptor
number the child's own code may still close is never handed to something else. A socket
is recorded only when both its ends were opened while the group was built, one of them on a
listener of that group's.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import threading
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

_FD_DIR = "/proc/self/fd"
_TCP_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_LISTEN = "0A"  # a socket's state in those tables: TCP_LISTEN
_ANY = ("0.0.0.0", "::")

#: An address (IPv4-mapped IPv6 written as IPv4) and a port.
Endpoint = tuple[str, int]


def open_sockets() -> dict[int, str]:
    """This process's open sockets: descriptor -> its link (``socket:[inode]``); empty
    where ``/proc`` is not there."""
    found = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue  # closed meanwhile (or the listing's own descriptor)
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


@dataclass(frozen=True)
class TcpSocket:
    """A TCP socket's endpoints (the remote one ``("0.0.0.0", 0)`` or ``("::", 0)`` while
    not connected) and whether it listens."""

    local: Endpoint
    remote: Endpoint
    listening: bool


def tcp_sockets(sockets: Mapping[int, str]) -> dict[int, TcpSocket]:
    """Those of ``sockets`` (descriptor -> link, as :func:`open_sockets` gives them) that are
    TCP sockets of this network namespace, with their endpoints; empty where ``/proc`` is
    not there."""
    by_link = {}
    for table in _TCP_TABLES:
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            by_link[f"socket:[{fields[9]}]"] = TcpSocket(
                _endpoint(fields[1]), _endpoint(fields[2]), fields[3] == _LISTEN
            )
    return {fd: by_link[link] for fd, link in sockets.items() if link in by_link}


def _endpoint(text: str) -> Endpoint:
    """An endpoint as ``/proc/net/tcp`` writes it (``0100007F:1F90``): the address as 32-bit
    words in hex, each in host byte order, then the port in hex."""
    address, port = text.split(":")
    raw = b"".join(
        struct.pack("=I", int(address[i : i + 8], 16)) for i in range(0, len(address), 8)
    )
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


@dataclass(frozen=True)
class NewSockets:
    """The TCP sockets one member opened while a process group was built, as it posts them
    to the others: its connections (local, remote) and the endpoints it listens on."""

    connections: frozenset[tuple[Endpoint, Endpoint]]
    listening: frozenset[Endpoint]

    @classmethod
    def of(cls, sockets: Iterable[TcpSocket]) -> NewSockets:
        sockets = list(sockets)
        return cls(
            frozenset((s.local, s.remote) for s in sockets if not s.listening),
            frozenset(s.local for s in sockets if s.listening),
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "connections": sorted([*local, *remote] for local, remote in self.connections),
                "listening": sorted(list(e) for e in self.listening),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> NewSockets:
        posted = json.loads(text)
        return cls(
            frozenset(((a, p), (b, q)) for a, p, b, q in posted["connections"]),
            frozenset((a, p) for a, p in posted["listening"]),
        )

    def accepts(self, endpoint: Endpoint) -> bool:
        """Whether one of its listeners takes connections at ``endpoint``."""
        address, port = endpoint
        return any(p == port and a in (address, *_ANY) for a, p in self.listening)


def group_connections(
    mine: Mapping[int, TcpSocket], own: NewSockets, others: Iterable[NewSockets]
) -> dict[int, TcpSocket]:
    """Those of ``mine`` (the TCP sockets this member opened while a process group was built)
    that connect it to another member's new connection (one of ``others``, what the other
    members posted), accepted on a listener of the group's at one of the two (``own``:
    what this member posted)."""
    others = list(others)
    return {
        fd: s
        for fd, s in mine.items()
        if not s.listening
        and any(
            (s.remote, s.local) in other.connections
            and (own.accepts(s.local) or other.accepts(s.remote))
            for other in others
        )
    }


class ForkClosedSockets:
    """Sockets, recorded under a key (a process group), that a forked child lets go of."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: dict[Hashable, dict[int, str]] = {}
        os.register_at_fork(after_in_child=self._in_child)

    def add(self, key: Hashable, sockets: dict[int, str]) -> None:
        """Record ``sockets`` (descriptor -> link, as :func:`open_sockets` gives them)."""
        with self._lock:
            self._sockets[key] = dict(sockets)

    def discard(self, key: Hashable) -> None:
        """Forget the sockets recorded under ``key`` (their process group was let go)."""
        with self._lock:
            self._sockets.pop(key, None)

    def shut_down(self, key: Hashable) -> None:
        """Shut down (both ways) every socket recorded under ``key`` that is still the one
        recorded, leaving the descriptors open for their owner: a send or receive blocked
        on one fails at once, and each peer sees its connection end, even one whose host
        vanished (no reset would ever come)."""
        with self._lock:
            recorded = dict(self._sockets.get(key, {}))
        for fd, link in recorded.items():
            try:
                if os.readlink(f"{_FD_DIR}/{fd}") != link:
                    continue
                borrowed = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                borrowed.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            finally:
                borrowed.detach()

    def _in_child(self) -> None:
        """In a forked child (its only thread): point each recorded socket that is still
        the one recorded at ``/dev/null``. The lock may have been held by a parent's
        thread that does not exist here, so it is replaced, not taken."""
        self._lock = threading.Lock()
        recorded = [s for group in self._sockets.values() for s in group.items()]
        self._sockets = {}
        if not recorded:
            return
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd, link in recorded:
                try:
                    if os.readlink(f"{_FD_DIR}/{fd}") == link:
                        os.dup2(null, fd)
                except OSError:
                    continue
        finally:
            os.close(null)


#: The sockets of every sync process group of this process.
SYNC_SOCKETS = ForkClosedSockets()
