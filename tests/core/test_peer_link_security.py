"""The peer link against peers that do not hold the job's secret, and against garbage:
a handshake replayed from a captured valid one is refused, a slow handshake is cut, and
a few thousand random, truncated, oversized or mis-tagged frames (loopback only, bounded
in count and time) each close their own connection while valid clients are served
throughout, and leave no thread or descriptor behind."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import time

import pytest

from slipstream.core.peer_auth import MAGIC, HmacAuth, new_secret, recv_exact
from slipstream.core.peer_link import MAX_HEADER_BYTES, PeerAuthError, PeerClient, PeerServer

TIMEOUT = 2.0
FUZZ_FRAMES = 3000
FUZZ_SECONDS = 60.0


class CountingHandler:
    """Objects in a dict; counts every request that reached it."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {"secret/file": b"s3cr3t" * 100}
        self.requests = 0
        self._lock = threading.Lock()

    def receive(self, name, length, chunks) -> None:
        with self._lock:
            self.requests += 1
        buf = memoryview(bytearray(length))
        done = 0
        while done < length:
            done += chunks(buf[done:])
        self.objects[name] = bytes(buf)

    def file_of(self, name) -> str | None:
        return None

    def read_into(self, name, offset, out) -> None:
        with self._lock:
            self.requests += 1
        data = self.objects[name][offset : offset + len(out)]
        if len(data) < len(out):
            raise ValueError(f"{name}: short read at {offset}")
        out[:] = data


class Recording:
    """A socket that keeps every byte sent through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent = bytearray()

    def sendall(self, data) -> None:
        self.sent += bytes(data)
        self.sock.sendall(data)

    def recv_into(self, buf) -> int:
        return self.sock.recv_into(buf)

    def settimeout(self, seconds) -> None:
        self.sock.settimeout(seconds)


def frame(header: dict, seal=None) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("!I", len(body)) + body + (seal.seal(body) if seal else b"")


def drain(sock: socket.socket, seconds: float = 5.0) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    sock.settimeout(seconds)
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def send_all_then_drain(sock: socket.socket, data: bytes, seconds: float = 5.0) -> bytes:
    """Send ``data`` and end the stream (as far as the server lets it), then :func:`drain`."""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the server closed the connection first
    return drain(sock, seconds)


@pytest.fixture
def link():
    handler = CountingHandler()
    auth = HmacAuth(new_secret())
    server = PeerServer("127.0.0.1", handler, timeout=TIMEOUT, auth=auth)
    yield handler, server, auth
    server.close()


def test_a_replayed_handshake_is_refused_and_reaches_no_handler(link):
    handler, server, auth = link
    with socket.create_connection(server.address, timeout=TIMEOUT) as sock:
        recording = Recording(sock)
        seal = auth.client(recording, time.monotonic() + TIMEOUT)
        recording.sendall(
            frame({"op": "read", "name": "secret/file", "offset": 0, "length": 6}, seal)
        )
        reply = drain_frame_and_payload(sock, 6)
        assert reply.endswith(b"s3cr3t")
    assert handler.requests == 1
    captured = bytes(recording.sent)
    with socket.create_connection(server.address, timeout=TIMEOUT) as sock:
        answer = send_all_then_drain(sock, captured)
    assert len(answer) == 64  # a fresh challenge, then the connection is closed
    assert b"s3cr3t" not in answer and handler.requests == 1


def drain_frame_and_payload(sock: socket.socket, payload: int) -> bytes:
    """The reply frame and its payload, whole (``MSG_WAITALL`` does not wait on a socket with
    a timeout: on a loaded machine the payload came after the frame)."""
    head = bytearray(4)
    recv_exact(sock, memoryview(head))
    (length,) = struct.unpack("!I", head)
    body = bytearray(length + 32 + payload)
    recv_exact(sock, memoryview(body))
    return bytes(body)


def test_a_client_with_another_secret_is_told_the_server_failed_the_handshake(link):
    _, server, _ = link
    stranger = PeerClient(server.address, "rank 3 (test)", 3, TIMEOUT, HmacAuth(new_secret()))
    with pytest.raises(PeerAuthError, match=r"rank 3 \(test\) failed the peer link's handshake"):
        stranger.read_into("secret/file", 0, memoryview(bytearray(6)))
    stranger.close()


def test_a_slow_handshake_is_cut_while_valid_clients_are_served(link):
    handler, server, auth = link
    client = PeerClient(server.address, "rank 1 (test)", 1, TIMEOUT, auth)
    with socket.create_connection(server.address, timeout=TIMEOUT) as slow:
        started = time.monotonic()
        closed = False
        for byte in MAGIC:
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            out = bytearray(6)
            client.read_into("secret/file", 0, memoryview(out))
            assert bytes(out) == b"s3cr3t"
            time.sleep(0.3)
            if time.monotonic() - started > 4 * TIMEOUT:
                break
        if not closed:
            slow.settimeout(4 * TIMEOUT)
            assert slow.recv(1) == b""  # the server closed it: the handshake took too long
        assert time.monotonic() - started < 4 * TIMEOUT + 1
    client.close()


def _fuzz_frame(rng: random.Random, n: int, secret_auth: HmacAuth, address) -> None:
    """One connection carrying one bad frame (of a kind chosen by ``n``)."""
    with socket.create_connection(address, timeout=TIMEOUT) as sock:
        kind = n % 10
        if kind == 0:
            data = os.urandom(rng.randrange(0, 200))  # random bytes, no greeting
        elif kind == 1:
            data = MAGIC[: rng.randrange(0, len(MAGIC))]  # a truncated greeting
        elif kind == 2:
            data = MAGIC + os.urandom(rng.randrange(0, 100))  # a greeting and a guessed proof
        else:
            seal = secret_auth.client(sock, time.monotonic() + TIMEOUT)
            good = {"op": "read", "name": "secret/file", "offset": 0, "length": 6}
            if kind == 3:  # oversized
                data = struct.pack("!I", rng.randrange(MAX_HEADER_BYTES + 1, 2**32))
            elif kind == 4:  # a header with a wrong tag
                body = json.dumps(good).encode()
                data = struct.pack("!I", len(body)) + body + os.urandom(32)
            elif kind == 5:  # a truncated frame
                whole = frame(good, seal)
                data = whole[: rng.randrange(1, len(whole))]
            elif kind == 6:  # tagged, not JSON, or JSON but not an object
                body = rng.choice([os.urandom(rng.randrange(1, 300)), b"[1, 2]", b"null"])
                data = struct.pack("!I", len(body)) + body + seal.seal(body)
            elif kind == 7:  # tagged, with fields out of range
                bad = rng.choice(
                    [
                        {**good, "offset": -1},
                        {**good, "length": 2**60},
                        {**good, "length": True},
                        {**good, "name": "x" * 5000},
                        {**good, "name": 7},
                        {**good, "op": "size"},
                        {"op": "put", "name": "p", "length": "12"},
                    ]
                )
                data = frame(bad, seal)
            elif kind == 8:  # a put whose payload is cut short
                data = frame({"op": "put", "name": "cut", "length": 1000}, seal) + b"x" * 10
            else:  # a replayed frame: the same tagged header twice
                first = frame(good, seal)
                data = first + first
        send_all_then_drain(sock, data, 4 * TIMEOUT)


def test_fuzzed_frames_close_their_own_connection_and_valid_clients_are_served(tmp_path):
    threads_before = threading.active_count()
    fds_before = len(os.listdir("/proc/self/fd"))
    handler = CountingHandler()
    auth = HmacAuth(new_secret())
    server = PeerServer("127.0.0.1", handler, timeout=TIMEOUT, auth=auth)
    client = PeerClient(server.address, "rank 1 (test)", 1, TIMEOUT, auth)
    rng = random.Random(36)
    started = time.monotonic()
    sent = 0
    try:
        while sent < FUZZ_FRAMES and time.monotonic() - started < FUZZ_SECONDS:
            _fuzz_frame(rng, sent, auth, server.address)
            sent += 1
            if sent % 50 == 0:
                data = os.urandom(rng.randrange(1, 5000))
                client.put(
                    f"ok/{sent}",
                    len(data),
                    lambda o, b, d=data: b.__setitem__(slice(None), d[o : o + len(b)]),
                )
                out = bytearray(len(data))
                client.read_into(f"ok/{sent}", 0, memoryview(out))
                assert bytes(out) == data
        assert sent >= 200, f"only {sent} frames in {FUZZ_SECONDS} s"
        assert "cut" not in handler.objects  # a put cut short is never stored
        client.close()
        end = time.monotonic() + 4 * TIMEOUT
        while server.connections() and time.monotonic() < end:
            time.sleep(0.05)
        assert server.connections() == 0
    finally:
        client.close()
        server.close()
    end = time.monotonic() + 4 * TIMEOUT
    while threading.active_count() > threads_before and time.monotonic() < end:
        time.sleep(0.05)
    assert threading.active_count() == threads_before
    assert len(os.listdir("/proc/self/fd")) == fds_before
