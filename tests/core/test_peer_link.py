"""The peer link: puts and ranged reads between two endpoints in this process, and
the errors that name the peer (a handler's refusal, a server that is gone)."""

from __future__ import annotations

import os

import pytest

from slipstream.core.peer_auth import HmacAuth, new_secret
from slipstream.core.peer_link import PeerClient, PeerLinkError, PeerServer
from slipstream.errors import PeerDiedError


class DictHandler:
    """Objects in a dict; ``full`` makes every put fail as a full filesystem would."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.files: dict[str, str] = {}
        """Objects also kept as a file, read back through ``sendfile``."""
        self.full = False

    def receive(self, name, length, chunks) -> None:
        if self.full:
            raise OSError(28, "No space left on device")
        buf = memoryview(bytearray(length))
        done = 0
        while done < length:
            done += chunks(buf[done : done + 1000])
        self.objects[name] = bytes(buf)

    def file_of(self, name) -> str | None:
        return self.files.get(name)

    def read_into(self, name, offset, out) -> None:
        data = self.objects[name][offset : offset + len(out)]
        if len(data) < len(out):
            raise ValueError(f"{name}: short read at {offset}")
        out[:] = data


@pytest.fixture
def served():
    handler = DictHandler()
    auth = HmacAuth(new_secret())
    server = PeerServer("127.0.0.1", handler, timeout=5.0, auth=auth)
    client = PeerClient(server.address, "rank 1 (test)", 1, timeout=5.0, auth=auth)
    yield handler, server, client
    client.close()
    server.close()


def test_put_then_ranged_reads_return_the_same_bytes(served, tmp_path):
    handler, _, client = served
    data = os.urandom(3 * 2**20 + 17)
    client.put(
        "a",
        len(data),
        lambda offset, buf: buf.__setitem__(slice(None), data[offset : offset + len(buf)]),
    )
    path = tmp_path / "b"
    path.write_bytes(data[:1001])
    client.put_file("b", str(path), 1001)
    assert handler.objects == {"a": data, "b": data[:1001]}
    out = bytearray(2**20 + 5)
    client.read_into("a", 12345, memoryview(out))
    assert bytes(out) == data[12345 : 12345 + len(out)]
    handler.files["b"] = str(path)
    out = bytearray(900)
    client.read_into("b", 101, memoryview(out))
    assert bytes(out) == data[101:1001]
    with pytest.raises(PeerLinkError, match=r"b: \[101, 1101\) is past its end \(1001 bytes\)"):
        client.read_into("b", 101, memoryview(bytearray(1000)))


def test_a_refused_put_and_a_failed_read_name_the_peer_and_leave_the_link_usable(served):
    handler, _, client = served
    handler.full = True
    with pytest.raises(PeerLinkError, match=r"rank 1 \(test\) refused a put of x.*No space left"):
        client.put("x", 5000, lambda offset, buf: None)
    handler.full = False
    with pytest.raises(PeerLinkError, match=r"refused a read of missing \[0, 10\): KeyError"):
        client.read_into("missing", 0, memoryview(bytearray(10)))
    client.put("x", 3, lambda offset, buf: buf.__setitem__(slice(None), b"abc"))
    assert handler.objects["x"] == b"abc"


def test_a_server_that_is_gone_is_a_peer_died_error_naming_its_rank(served):
    _, server, client = served
    server.close()
    with pytest.raises(PeerDiedError, match=r"rank 1 \(test\)") as info:
        client.read_into("a", 0, memoryview(bytearray(1)))
    assert info.value.ranks == [1]
