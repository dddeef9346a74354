"""A replica put to a peer that vanished (no connection reset: its host cut off or frozen)
ends when the channel's liveness finds the peer dead, not at the link's timeout.

Two ranks' channels and peer directories in this process, on one TCP store. Rank 1's
server takes the put and never acknowledges it (its handler blocks, as a frozen host's
would), and rank 1's heartbeat stops: rank 0's put fails with a :class:`PeerDiedError`
naming rank 1 and its silence, well before the link's timeout.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from slipstream.checkpoint.save import channel as channel_module
from slipstream.checkpoint.save.channel import RankChannel
from slipstream.checkpoint.tier.replication import PeerDirectory
from slipstream.core.peer_auth import HmacAuth, new_secret
from slipstream.core.peer_link import PeerServer
from slipstream.errors import PeerDiedError

LINK_TIMEOUT = 30.0
SILENT_AFTER = 0.5


class Frozen:
    """A handler that takes a put's first bytes and then stops until released."""

    def __init__(self) -> None:
        self.receiving = threading.Event()
        self.release = threading.Event()

    def receive(self, name, length, chunks) -> None:
        chunks(memoryview(bytearray(1)))
        self.receiving.set()
        self.release.wait(2 * LINK_TIMEOUT)
        raise OSError("released")

    def file_of(self, name) -> str | None:
        return None

    def read_into(self, name, offset, out) -> None:
        raise OSError("frozen")


def test_a_put_to_a_peer_that_stopped_beating_is_cut_naming_it(monkeypatch):
    monkeypatch.setattr(channel_module, "SILENT_AFTER_SECONDS", SILENT_AFTER)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    channels = [RankChannel(dist.PrefixStore("job", store), r, 2, "ns") for r in (0, 1)]
    auth = HmacAuth(new_secret())
    frozen = Frozen()
    server = PeerServer("127.0.0.1", frozen, LINK_TIMEOUT, auth)
    directories = [
        PeerDirectory(channels[0], ("127.0.0.1", 1), LINK_TIMEOUT, auth),
        PeerDirectory(channels[1], server.address, LINK_TIMEOUT, auth),
    ]
    try:
        client = directories[0].client(1)
        channels[1].close()  # rank 1 stops beating
        started = time.monotonic()
        with pytest.raises(PeerDiedError) as err:
            client.put("step_1/__0_0.distcp", 1000, lambda offset, buf: None)
        waited = time.monotonic() - started
        assert frozen.receiving.is_set()
        assert err.value.ranks == [1]
        assert "was cut off during a put of step_1/__0_0.distcp" in str(err.value), err.value
        assert "rank 0 found rank 1 dead (no heartbeat for" in str(err.value), err.value
        assert waited < LINK_TIMEOUT / 3, f"the put ended {waited:.1f} s after it started"
        assert not client.busy()
    finally:
        frozen.release.set()
        for directory in directories:
            directory.close()
        server.close()
        channels[0].close()
    assert not [t for t in threading.enumerate() if t.name == "slipstream-peer-watch"]
