"""A small byte transport between processes: TCP, authenticated, framed requests, owned
threads.

One :class:`PeerServer` per process listens on an address of its own (rendezvous is the
caller's business, e.g. through the job's store) and answers two requests, each given
to a :class:`PeerHandler`: ``put`` (a named object streamed in) and ``read`` (a byte range
of a named object streamed out). A :class:`PeerClient` talks to one server.

Every connection first runs the handshake of a :class:`~.peer_auth.LinkAuth` (both sides
prove they hold the job's secret, :mod:`.peer_auth`). Then frames: a 4-byte big-endian
length, that many bytes of JSON (the header), and the header's tag from the connection's
:class:`~.peer_auth.FrameSeal`; a ``put`` request and a successful ``read`` reply carry
``length`` payload bytes after their frame (those bytes are covered by the caller's own
digests, not by the link).

Invariants: the server reads no request from a peer that has not completed the handshake,
and tells it nothing (it closes the connection, and logs the address and the reason once
a minute per address); every field of a request is checked before use, and a frame that
is malformed, oversized, mis-tagged or too slow closes its own connection only; every
socket operation is bounded by a timeout and its error names the peer and the request;
every thread belongs to the server and is joined by :meth:`PeerServer.close` (which also
cuts the connections it serves); a ``put`` whose handler fails still reads the whole
payload, so the sender always gets the handler's error rather than a broken pipe.
Nothing here runs a collective.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import PeerDiedError, PeerTimeoutError, SlipstreamError
from .peer_auth import FrameSeal, HandshakeError, LinkAuth, recv_exact

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 * 1024 * 1024
"""Payload bytes a handler sees at a time (and a client's buffer for a ``put``)."""
_HEADER = struct.Struct("!I")
MAX_HEADER_BYTES = 64 * 1024
"""The longest frame header either side accepts."""
MAX_NAME_CHARS = 1024
MAX_OBJECT_BYTES = 1 << 48
"""The largest offset or length a request may name."""
HANDSHAKE_SECONDS = 10.0
"""The most a connecting peer may take to complete the handshake (capped by the timeout)."""
MAX_CONNECTIONS = 256
"""Connections a server serves at once; one more is closed at once (and logged)."""
REFUSAL_LOG_SECONDS = 60.0
_ACCEPT_POLL_SECONDS = 0.2


class PeerHandler(Protocol):
    """What a :class:`PeerServer` serves; names are the requests' own, checked by the handler."""

    def receive(self, name: str, length: int, chunks: Callable[[memoryview], int]) -> None:
        """Store object ``name`` of ``length`` bytes; ``chunks(buf)`` fills ``buf`` (or its
        head, returning how many bytes) with the next payload bytes. Raise to refuse it."""

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``."""

    def file_of(self, name: str) -> str | None:
        """A file holding exactly the bytes of ``name``, for reads the kernel sends from
        the page cache (``sendfile``); ``None`` where there is none (reads then go through
        :meth:`read_into`)."""


class PeerLinkError(SlipstreamError):
    """A request the peer answered with an error (its message is the peer's)."""


class PeerAuthError(PeerLinkError):
    """The server at a peer's address did not prove it holds the job's secret."""


class FrameError(ConnectionError):
    """A frame that is malformed, oversized or mis-tagged: its connection is closed."""


def _send_frame(sock: socket.socket, seal: FrameSeal, header: dict[str, Any]) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(data)) + data + seal.seal(data))


def _recv_frame(sock: socket.socket, seal: FrameSeal) -> dict[str, Any] | None:
    """The next header whose tag verifies, or ``None`` where the peer closed the connection
    between frames; a header that is too long, mis-tagged or not a JSON object is a
    :class:`FrameError` (nothing of it is parsed before its tag verifies)."""
    head = bytearray(_HEADER.size)
    first = sock.recv_into(head)
    if first == 0:
        return None
    if first < len(head):
        recv_exact(sock, memoryview(head)[first:])
    (length,) = _HEADER.unpack(head)
    if length > MAX_HEADER_BYTES:
        raise FrameError(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
    body = bytearray(length + seal.tag_bytes)
    recv_exact(sock, memoryview(body))
    data, tag = bytes(body[:length]), bytes(body[length:])
    if not seal.check(data, tag):
        raise FrameError("a header whose tag does not verify")
    try:
        header = json.loads(data)
    except ValueError as exc:
        raise FrameError(f"a header that is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("a header that is not a JSON object")
    return header


def _count(header: dict[str, Any], key: str) -> int:
    value = header.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_OBJECT_BYTES:
        raise FrameError(f"field {key!r} is not a byte count up to {MAX_OBJECT_BYTES}")
    return value


@dataclass(frozen=True)
class Request:
    """A request as the server checked it: ``put`` (``length`` bytes follow) or ``read``."""

    op: str
    name: str
    offset: int
    length: int

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Request:
        op, name = header.get("op"), header.get("name")
        if op not in ("put", "read"):
            raise FrameError("field 'op' is neither 'put' nor 'read'")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise FrameError(f"field 'name' is not a name of 1 to {MAX_NAME_CHARS} characters")
        offset = _count(header, "offset") if op == "read" else 0
        return cls(op, name, offset, _count(header, "length"))


class _Refusals:
    """Logs a refused peer's address and reason at most once per address per interval."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def log(self, peer: Any, reason: str, server: str) -> None:
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(host, -self.interval) < self.interval:
                return
            self._last = {h: t for h, t in self._last.items() if now - t < self.interval}
            self._last[host] = now
        logger.warning("peer link %s refused %s: %s", server, _address(peer), reason)


class PeerServer:
    """Serves ``handler`` on ``host`` (port chosen by the system) to peers that pass
    ``auth``'s handshake, until :meth:`close`."""

    def __init__(
        self,
        host: str,
        handler: PeerHandler,
        timeout: float,
        auth: LinkAuth,
        thread_start: Callable[[], None] | None = None,
    ) -> None:
        """``thread_start`` runs first on each thread serving a connection (to lower its
        priority, say)."""
        self.handler = handler
        self.timeout = timeout
        self._auth = auth
        self._thread_start = thread_start
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_POLL_SECONDS)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._refusals = _Refusals(REFUSAL_LOG_SECONDS)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._served: dict[socket.socket, threading.Thread] = {}
        self._accepting = threading.Thread(
            target=self._accept, name="slipstream-peer-accept", daemon=True
        )
        self._accepting.start()

    def _accept(self) -> None:
        where = f"{self.address[0]}:{self.address[1]}"
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                busy = len(self._served) >= MAX_CONNECTIONS
            if busy:
                conn.close()
                self._refusals.log(peer, f"{MAX_CONNECTIONS} connections open", where)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name="slipstream-peer-serve", daemon=True
            )
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._served[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        where = f"{self.address[0]}:{self.address[1]}"
        try:
            if self._thread_start is not None:
                self._thread_start()
            try:
                seal = self._auth.server(
                    conn, time.monotonic() + min(self.timeout, HANDSHAKE_SECONDS)
                )
            except (HandshakeError, OSError) as exc:
                self._refusals.log(peer, f"handshake failed: {exc}", where)
                return
            conn.settimeout(self.timeout)
            while not self._stop.is_set():
                readable, _, _ = select.select([conn], [], [], _ACCEPT_POLL_SECONDS)
                if not readable:
                    continue  # an idle pooled connection: kept until the client or close()
                header = _recv_frame(conn, seal)
                if header is None:
                    return
                self._answer(conn, seal, Request.parse(header))
        except FrameError as exc:
            self._refusals.log(peer, f"closed its connection: {exc}", where)
        except OSError:
            return  # the client went away or timed out: its own side reports it
        finally:
            with self._lock:
                self._served.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, seal: FrameSeal, request: Request) -> None:
        if request.op == "put":
            _send_frame(conn, seal, self._receive(conn, request.name, request.length))
        else:
            self._send_range(conn, seal, request.name, request.offset, request.length)

    def _receive(self, conn: socket.socket, name: str, length: int) -> dict[str, Any]:
        left = length

        def chunks(buf: memoryview) -> int:
            nonlocal left
            n = min(len(buf), left)
            recv_exact(conn, buf[:n])
            left -= n
            return n

        try:
            self.handler.receive(name, length, chunks)
            if left:
                raise ValueError(f"the handler left {left} of {length} bytes of {name} unread")
            return {"ok": True}
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (ConnectionError, TimeoutError)):
                raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        drain = bytearray(min(CHUNK_BYTES, max(left, 1)))
        while left:
            left -= chunks(memoryview(drain))
        return {"error": error}

    def _send_range(
        self, conn: socket.socket, seal: FrameSeal, name: str, offset: int, length: int
    ) -> None:
        try:
            path = self.handler.file_of(name)
            source = open(path, "rb") if path is not None else None  # noqa: SIM115
        except Exception as exc:
            _send_frame(conn, seal, {"error": f"{type(exc).__name__}: {exc}"})
            return
        if source is not None:
            with source:
                size = os.fstat(source.fileno()).st_size
                if offset + length > size:
                    error = f"{name}: [{offset}, {offset + length}) is past its end ({size} bytes)"
                    _send_frame(conn, seal, {"error": error})
                    return
                _send_frame(conn, seal, {"length": length})
                if length and conn.sendfile(source, offset, length) != length:
                    raise ConnectionError(f"{name}: sendfile stopped short")
            return
        buf = bytearray(min(CHUNK_BYTES, max(length, 1)))
        view = memoryview(buf)
        first = view[: min(len(buf), length)]
        try:
            self.handler.read_into(name, offset, first)
        except Exception as exc:
            _send_frame(conn, seal, {"error": f"{type(exc).__name__}: {exc}"})
            return
        _send_frame(conn, seal, {"length": length})
        conn.sendall(first)
        done = len(first)
        while done < length:
            part = view[: min(len(buf), length - done)]
            self.handler.read_into(name, offset + done, part)  # a failure cuts the connection
            conn.sendall(part)
            done += len(part)

    def connections(self) -> int:
        """Connections being served now (authenticated or still in their handshake)."""
        with self._lock:
            return len(self._served)

    def close(self) -> None:
        """Stop accepting, cut the connections being served, and join every thread."""
        self._stop.set()
        self._listener.close()
        self._accepting.join(10 * _ACCEPT_POLL_SECONDS + self.timeout)
        with self._lock:
            served = list(self._served.items())
        for conn, _ in served:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in served:
            thread.join(self.timeout)


def _address(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


class PeerClient:
    """Requests to the server at ``address`` (``who`` names it in errors; ``rank`` is the
    rank an error of a dead peer carries), over connections authenticated by ``auth``.
    Connections are pooled: each request borrows one, so several threads may issue
    requests at once.

    A request in flight can be ended from another thread by :meth:`cut` (its owner found
    the peer dead): a connection a request holds is shut down, the request fails with
    :class:`PeerDiedError` naming the peer and why it was cut, and a cut connection never
    goes back to the pool. A request holds its connection from the moment it is connected
    and authenticated until the request returns (a new connection's connect and handshake
    are bounded by the timeout only)."""

    def __init__(
        self, address: tuple[str, int], who: str, rank: int, timeout: float, auth: LinkAuth
    ) -> None:
        self.address = address
        self.who = who
        self.rank = rank
        self.timeout = timeout
        self._auth = auth
        self._idle: list[tuple[socket.socket, FrameSeal]] = []
        self._held: dict[socket.socket, str | None] = {}
        """The connections requests hold now, each with why it was cut (``None``: not)."""
        self._lock = threading.Lock()

    def _borrow(self) -> tuple[socket.socket, FrameSeal]:
        """A connection for one request, held (:meth:`cut` reaches it) until :meth:`_settle`."""
        with self._lock:
            if self._idle:
                conn = self._idle.pop()
                self._held[conn[0]] = None
                return conn
        sock = socket.create_connection(self.address, timeout=self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            seal = self._auth.client(sock, time.monotonic() + self.timeout)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._held[sock] = None
        return sock, seal

    def _settle(self, sock: socket.socket | None) -> str | None:
        """Release the request's hold on ``sock``; why it was cut, or ``None``."""
        if sock is None:
            return None
        with self._lock:
            return self._held.pop(sock, None)

    def busy(self) -> bool:
        """Whether a request holds a connection now."""
        with self._lock:
            return bool(self._held)

    def cut(self, why: str) -> None:
        """End every request in flight: shut their connections down (they fail naming
        ``why``); requests made later are not affected."""
        with self._lock:
            held = [sock for sock, cut in self._held.items() if cut is None]
            for sock in held:
                self._held[sock] = why
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _give_back(self, conn: tuple[socket.socket, FrameSeal]) -> None:
        with self._lock:
            self._idle.append(conn)

    def _call(self, what: str, exchange: Callable[[socket.socket, FrameSeal], Any]) -> Any:
        started = time.monotonic()
        conn: tuple[socket.socket, FrameSeal] | None = None
        try:
            conn = self._borrow()
            result = exchange(*conn)
        except BaseException as exc:
            why = self._settle(conn[0] if conn is not None else None)
            if conn is not None:
                conn[0].close()
            if why is not None:
                raise self._cut_off(what, started, why) from exc
            if isinstance(exc, HandshakeError):
                raise PeerAuthError(
                    f"{self.who} failed the peer link's handshake during {what}: {exc} (is it "
                    "a peer of this job?)"
                ) from exc
            if isinstance(exc, TimeoutError):
                raise PeerTimeoutError(
                    f"{self.who} did not answer within {self.timeout:.1f} s to {what}"
                ) from exc
            if isinstance(exc, OSError):
                waited = time.monotonic() - started
                raise PeerDiedError(
                    f"{self.who} is unreachable or went away during {what} after "
                    f"{waited:.1f} s: {exc}",
                    [self.rank],
                    what,
                    waited,
                ) from exc
            raise
        why = self._settle(conn[0])
        if why is None:
            self._give_back(conn)
        elif result is None:  # the cut ended the wait for the reply
            conn[0].close()
            raise self._cut_off(what, started, why)
        else:
            conn[0].close()
        return result

    def _cut_off(self, what: str, started: float, why: str) -> PeerDiedError:
        waited = time.monotonic() - started
        return PeerDiedError(
            f"{self.who} was cut off during {what} after {waited:.1f} s: {why}",
            [self.rank],
            what,
            waited,
        )

    def put(self, name: str, length: int, fill: Callable[[int, memoryview], None]) -> None:
        """Send object ``name`` of ``length`` bytes; ``fill(offset, buf)`` provides them.
        Returns once the peer has stored it; raises :class:`PeerLinkError` with the peer's
        error where it refused it."""
        what = f"a put of {name} ({length} bytes)"

        def exchange(sock: socket.socket, seal: FrameSeal) -> dict[str, Any] | None:
            _send_frame(sock, seal, {"op": "put", "name": name, "length": length})
            buf = memoryview(bytearray(min(CHUNK_BYTES, max(length, 1))))
            done = 0
            while done < length:
                part = buf[: min(len(buf), length - done)]
                fill(done, part)
                sock.sendall(part)
                done += len(part)
            return _recv_frame(sock, seal)

        self._check(self._call(what, exchange), what)

    def put_file(self, name: str, path: str, length: int) -> None:
        """:meth:`put` of the first ``length`` bytes of the file at ``path``, sent by the
        kernel from the page cache (``sendfile``) without a copy through this process."""
        what = f"a put of {name} ({length} bytes)"

        def exchange(sock: socket.socket, seal: FrameSeal) -> dict[str, Any] | None:
            _send_frame(sock, seal, {"op": "put", "name": name, "length": length})
            with open(path, "rb") as source:
                sent = sock.sendfile(source, 0, length) if length else 0
            if sent != length:
                raise ConnectionError(f"sent {sent} of the {length} bytes of {path}")
            return _recv_frame(sock, seal)

        self._check(self._call(what, exchange), what)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``, straight off the socket."""
        what = f"a read of {name} [{offset}, {offset + len(out)})"

        def exchange(sock: socket.socket, seal: FrameSeal) -> dict[str, Any] | None:
            request = {"op": "read", "name": name, "offset": offset, "length": len(out)}
            _send_frame(sock, seal, request)
            reply = _recv_frame(sock, seal)
            if reply is not None and "error" not in reply:
                recv_exact(sock, out.cast("B"))
            return reply

        self._check(self._call(what, exchange), what)

    def _check(self, reply: dict[str, Any] | None, what: str) -> dict[str, Any]:
        if reply is None:
            raise PeerDiedError(
                f"{self.who} closed the connection during {what}", [self.rank], what
            )
        if "error" in reply:
            raise PeerLinkError(f"{self.who} refused {what}: {reply['error']}")
        return reply

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()
