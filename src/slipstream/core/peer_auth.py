"""Who may talk on a peer link: a mutual challenge-response over a job's shared secret, then
a MAC over every frame header, bound to the connection and to its place in it.

The handshake (HMAC-SHA256 keyed with the job's secret ``K``; ``||`` is concatenation):

1. client -> server: :data:`MAGIC` ``|| Nc`` (a fresh 32-byte nonce);
2. server -> client: ``Ns || HMAC(K, "server" || Nc || Ns)`` (a fresh nonce, and its proof);
3. client -> server: ``HMAC(K, "client" || Nc || Ns)``.

Each side checks the other's proof with :func:`hmac.compare_digest`; both then key the
connection's :class:`FrameSeal` with ``HMAC(K, "session" || Nc || Ns)``. Every frame header
after that carries ``HMAC(session, direction || sequence number || length || header)``:
a frame cut from this connection or another, replayed, reordered or sent the other way
does not verify.

Invariants: the server reads nothing from a peer but the fixed-size handshake messages
until that peer has proved it holds ``K``; the secret is never sent, logged or shown in a
``repr``; each connection's key depends on both sides' fresh nonces, so a handshake
captured from a valid connection and played again proves nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from typing import Protocol

SECRET_BYTES = 32
"""A job's secret: 256 random bits."""
NONCE_BYTES = 32
MAC_BYTES = 32
MAGIC = b"slipstream-peer-link/1\n\0"
"""What a client opens a connection with: the protocol and its version."""
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
CHALLENGE_BYTES = NONCE_BYTES + MAC_BYTES


class HandshakeError(ConnectionError):
    """A peer did not prove it holds the job's secret (the reason says what failed; it never
    quotes the bytes the peer sent)."""


def new_secret() -> bytes:
    """A fresh job secret from the operating system's random source."""
    return os.urandom(SECRET_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


class FrameSeal(Protocol):
    """One connection's frame MACs, each direction numbered from zero."""

    tag_bytes: int

    def seal(self, header: bytes) -> bytes:
        """The tag of the next header this side sends."""

    def check(self, header: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the right one for the next header this side receives."""


class LinkAuth(Protocol):
    """How both ends of a connection authenticate each other before any request."""

    def server(self, sock: socket.socket, until: float) -> FrameSeal:
        """Authenticate the peer that connected to ``sock``; raise :class:`HandshakeError`."""

    def client(self, sock: socket.socket, until: float) -> FrameSeal:
        """Authenticate the server ``sock`` is connected to; raise :class:`HandshakeError`."""


class HmacSeal:
    """HMAC-SHA256 over (direction, sequence number, length, header) with a session key."""

    tag_bytes = MAC_BYTES

    def __init__(self, key: bytes, sending: bytes, receiving: bytes) -> None:
        self._key = key
        self._sending = sending
        self._receiving = receiving
        self._sent = 0
        self._received = 0

    def _tag(self, direction: bytes, number: int, header: bytes) -> bytes:
        return _mac(
            self._key, direction, number.to_bytes(8, "big"), len(header).to_bytes(4, "big"), header
        )

    def seal(self, header: bytes) -> bytes:
        tag = self._tag(self._sending, self._sent, header)
        self._sent += 1
        return tag

    def check(self, header: bytes, tag: bytes) -> bool:
        want = self._tag(self._receiving, self._received, header)
        self._received += 1
        return hmac.compare_digest(want, tag)


def recv_exact(sock: socket.socket, out: memoryview, until: float | None = None) -> None:
    """Fill ``out`` from ``sock``; with ``until`` (a :func:`time.monotonic` time), all of it
    by then (a peer that sends one byte at a time cannot stretch the wait)."""
    got = 0
    while got < len(out):
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer did not send a whole message in time")
            sock.settimeout(left)
        n = sock.recv_into(out[got:])
        if n == 0:
            raise ConnectionResetError("connection closed by the peer")
        got += n


class HmacAuth:
    """The handshake of this module over the job's ``secret`` (:data:`SECRET_BYTES`)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"a peer link secret needs {SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret

    def __repr__(self) -> str:
        return "HmacAuth(<secret>)"

    def _session(self, nc: bytes, ns: bytes, sending: bytes, receiving: bytes) -> HmacSeal:
        return HmacSeal(_mac(self._secret, b"session", nc, ns), sending, receiving)

    def server(self, sock: socket.socket, until: float) -> FrameSeal:
        hello = bytearray(HELLO_BYTES)
        recv_exact(sock, memoryview(hello), until)
        if not hmac.compare_digest(bytes(hello[: len(MAGIC)]), MAGIC):
            raise HandshakeError("not a slipstream peer link greeting")
        nc = bytes(hello[len(MAGIC) :])
        ns = os.urandom(NONCE_BYTES)
        sock.sendall(ns + _mac(self._secret, b"server", nc, ns))
        proof = bytearray(MAC_BYTES)
        recv_exact(sock, memoryview(proof), until)
        if not hmac.compare_digest(bytes(proof), _mac(self._secret, b"client", nc, ns)):
            raise HandshakeError("wrong proof of the job's secret")
        return self._session(nc, ns, b"server->client", b"client->server")

    def client(self, sock: socket.socket, until: float) -> FrameSeal:
        nc = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + nc)
        challenge = bytearray(CHALLENGE_BYTES)
        recv_exact(sock, memoryview(challenge), until)
        ns, proof = bytes(challenge[:NONCE_BYTES]), bytes(challenge[NONCE_BYTES:])
        if not hmac.compare_digest(proof, _mac(self._secret, b"server", nc, ns)):
            raise HandshakeError("the server did not prove it holds the job's secret")
        sock.sendall(_mac(self._secret, b"client", nc, ns))
        return self._session(nc, ns, b"client->server", b"server->client")
