"""A small byte transport between processes: TCP, framed requests, owned threads.

One :class:`PeerServer` per process listens on an address of its own (rendezvous is the
caller's business, e.g. through the job's store) and answers two requests, each given
to a :class:`PeerHandler`: ``put`` (a named object streamed in) and ``read`` (a byte range
of a named object streamed out). A :class:`PeerClient` talks to one server.

Frames: a 4-byte big-endian length, then that many bytes of JSON (the header); a ``put``
request and a successful ``read`` reply carry ``length`` payload bytes after their header.

Invariants: every socket operation is bounded by a timeout and its error names the peer
and the request; every thread belongs to the server and is joined by :meth:`PeerServer.close`
(which also cuts the connections it serves); a ``put`` whose handler fails still reads the
whole payload, so the sender always gets the handler's error rather than a broken pipe.
Nothing here runs a collective.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import PeerDiedError, PeerTimeoutError, SlipstreamError

CHUNK_BYTES = 8 * 1024 * 1024
"""Payload bytes a handler sees at a time (and a client's buffer for a ``put``)."""
_HEADER = struct.Struct("!I")
_MAX_HEADER_BYTES = 1 << 20
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


def _recv_exact(sock: socket.socket, out: memoryview) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got:])
        if n == 0:
            raise ConnectionResetError("connection closed by the peer")
        got += n


def _send_frame(sock: socket.socket, header: dict[str, Any]) -> None:
    data = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next header, or ``None`` where the peer closed the connection between frames."""
    head = bytearray(_HEADER.size)
    first = sock.recv_into(head)
    if first == 0:
        return None
    if first < len(head):
        _recv_exact(sock, memoryview(head)[first:])
    (length,) = _HEADER.unpack(head)
    if length > _MAX_HEADER_BYTES:
        raise ConnectionError(f"header of {length} bytes: not a peer link frame")
    body = bytearray(length)
    _recv_exact(sock, memoryview(body))
    header: dict[str, Any] = json.loads(body)
    return header


class PeerServer:
    """Serves ``handler`` on ``host`` (port chosen by the system) until :meth:`close`."""

    def __init__(
        self,
        host: str,
        handler: PeerHandler,
        timeout: float,
        thread_start: Callable[[], None] | None = None,
    ) -> None:
        """``thread_start`` runs first on each thread serving a connection (to lower its
        priority, say)."""
        self.handler = handler
        self.timeout = timeout
        self._thread_start = thread_start
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_POLL_SECONDS)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._served: dict[socket.socket, threading.Thread] = {}
        self._accepting = threading.Thread(
            target=self._accept, name="slipstream-peer-accept", daemon=True
        )
        self._accepting.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="slipstream-peer-serve", daemon=True
            )
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._served[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        if self._thread_start is not None:
            self._thread_start()
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([conn], [], [], _ACCEPT_POLL_SECONDS)
                if not readable:
                    continue  # an idle pooled connection: kept until the client or close()
                request = _recv_frame(conn)
                if request is None:
                    return
                self._answer(conn, request)
        except OSError:
            return  # the client went away or timed out: its own side reports it
        finally:
            with self._lock:
                self._served.pop(conn, None)
            conn.close()

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> None:
        op, name = request.get("op"), str(request.get("name"))
        if op == "put":
            _send_frame(conn, self._receive(conn, name, int(request["length"])))
        elif op == "read":
            self._send_range(conn, name, int(request["offset"]), int(request["length"]))
        else:
            _send_frame(conn, {"error": f"unknown request {op!r}"})

    def _receive(self, conn: socket.socket, name: str, length: int) -> dict[str, Any]:
        left = length

        def chunks(buf: memoryview) -> int:
            nonlocal left
            n = min(len(buf), left)
            _recv_exact(conn, buf[:n])
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

    def _send_range(self, conn: socket.socket, name: str, offset: int, length: int) -> None:
        try:
            path = self.handler.file_of(name)
            source = open(path, "rb") if path is not None else None  # noqa: SIM115
        except Exception as exc:
            _send_frame(conn, {"error": f"{type(exc).__name__}: {exc}"})
            return
        if source is not None:
            with source:
                size = os.fstat(source.fileno()).st_size
                if offset + length > size:
                    error = f"{name}: [{offset}, {offset + length}) is past its end ({size} bytes)"
                    _send_frame(conn, {"error": error})
                    return
                _send_frame(conn, {"length": length})
                if length and conn.sendfile(source, offset, length) != length:
                    raise ConnectionError(f"{name}: sendfile stopped short")
            return
        buf = bytearray(min(CHUNK_BYTES, max(length, 1)))
        view = memoryview(buf)
        first = view[: min(len(buf), length)]
        try:
            self.handler.read_into(name, offset, first)
        except Exception as exc:
            _send_frame(conn, {"error": f"{type(exc).__name__}: {exc}"})
            return
        _send_frame(conn, {"length": length})
        conn.sendall(first)
        done = len(first)
        while done < length:
            part = view[: min(len(buf), length - done)]
            self.handler.read_into(name, offset + done, part)  # a failure cuts the connection
            conn.sendall(part)
            done += len(part)

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


class PeerClient:
    """Requests to the server at ``address`` (``who`` names it in errors; ``rank`` is the
    rank an error of a dead peer carries). Connections are pooled: each request borrows
    one, so several threads may issue requests at once."""

    def __init__(self, address: tuple[str, int], who: str, rank: int, timeout: float) -> None:
        self.address = address
        self.who = who
        self.rank = rank
        self.timeout = timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _borrow(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def _call(self, what: str, exchange: Callable[[socket.socket], Any]) -> Any:
        started = time.monotonic()
        sock: socket.socket | None = None
        try:
            sock = self._borrow()
            result = exchange(sock)
        except TimeoutError as exc:
            if sock is not None:
                sock.close()
            raise PeerTimeoutError(
                f"{self.who} did not answer within {self.timeout:.1f} s to {what}"
            ) from exc
        except OSError as exc:
            if sock is not None:
                sock.close()
            waited = time.monotonic() - started
            raise PeerDiedError(
                f"{self.who} is unreachable or went away during {what} after {waited:.1f} s: {exc}",
                [self.rank],
                what,
                waited,
            ) from exc
        self._give_back(sock)
        return result

    def put(self, name: str, length: int, fill: Callable[[int, memoryview], None]) -> None:
        """Send object ``name`` of ``length`` bytes; ``fill(offset, buf)`` provides them.
        Returns once the peer has stored it; raises :class:`PeerLinkError` with the peer's
        error where it refused it."""
        what = f"a put of {name} ({length} bytes)"

        def exchange(sock: socket.socket) -> dict[str, Any] | None:
            _send_frame(sock, {"op": "put", "name": name, "length": length})
            buf = memoryview(bytearray(min(CHUNK_BYTES, max(length, 1))))
            done = 0
            while done < length:
                part = buf[: min(len(buf), length - done)]
                fill(done, part)
                sock.sendall(part)
                done += len(part)
            return _recv_frame(sock)

        self._check(self._call(what, exchange), what)

    def put_file(self, name: str, path: str, length: int) -> None:
        """:meth:`put` of the first ``length`` bytes of the file at ``path``, sent by the
        kernel from the page cache (``sendfile``) without a copy through this process."""
        what = f"a put of {name} ({length} bytes)"

        def exchange(sock: socket.socket) -> dict[str, Any] | None:
            _send_frame(sock, {"op": "put", "name": name, "length": length})
            with open(path, "rb") as source:
                sent = sock.sendfile(source, 0, length) if length else 0
            if sent != length:
                raise ConnectionError(f"sent {sent} of the {length} bytes of {path}")
            return _recv_frame(sock)

        self._check(self._call(what, exchange), what)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset``, straight off the socket."""
        what = f"a read of {name} [{offset}, {offset + len(out)})"

        def exchange(sock: socket.socket) -> dict[str, Any] | None:
            request = {"op": "read", "name": name, "offset": offset, "length": len(out)}
            _send_frame(sock, request)
            reply = _recv_frame(sock)
            if reply is not None and "error" not in reply:
                _recv_exact(sock, out.cast("B"))
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
        for sock in idle:
            sock.close()
