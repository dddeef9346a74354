"""A local-tier transfer to a peer that vanished (no connection reset: its host cut off or
frozen) ends when the channel's liveness finds the peer dead, not at the group's timeout.

Two gloo ranks, each with a channel and a :class:`TierLink`. Rank 1 stops itself
(``SIGSTOP``: its connections stay open and its heartbeat stops, as a frozen host's would)
before it sends; rank 0's receive fails with a :class:`PeerDiedError` naming rank 1 and
its silence, well before the link's timeout. Then rank 0 kills rank 1, which ends the
abandoned receive, and closes its link.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

from slipstream.checkpoint.save import channel as channel_module
from slipstream.checkpoint.save.channel import RankChannel
from slipstream.checkpoint.tier.link import Move, TierLink
from slipstream.core.waits import Deadline
from slipstream.errors import PeerDiedError

LINK_TIMEOUT = 30.0
SILENT_AFTER = 0.5


def _frozen_peer(rank: int, world: int, base: str) -> None:
    channel_module.SILENT_AFTER_SECONDS = SILENT_AFTER
    store = dist.distributed_c10d._get_default_store()
    channel = RankChannel(dist.PrefixStore("link-test", store), rank, world, "ns")
    link = TierLink(channel, LINK_TIMEOUT)
    pid_file = os.path.join(base, "pid1")
    if rank == 1:
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        os.kill(os.getpid(), signal.SIGSTOP)
        raise AssertionError("rank 1 was to stay stopped until killed")
    data = torch.empty(1000, dtype=torch.uint8)
    started = time.monotonic()
    with pytest.raises(PeerDiedError) as err:
        link.move([Move(1, 0, data, False, "a replica from rank 1")], Deadline(LINK_TIMEOUT))
    waited = time.monotonic() - started
    assert err.value.ranks == [1]
    assert "rank 0 found rank 1 dead (no heartbeat for" in str(err.value), err.value
    assert "while a replica from rank 1" in str(err.value), err.value
    assert waited < LINK_TIMEOUT / 3, f"the receive ended {waited:.1f} s after it started"
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    with open(pid_file) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    closing = time.monotonic()
    link.close()  # the abandoned receive ends as the connection closes
    assert time.monotonic() - closing < LINK_TIMEOUT / 3
    channel.close()


def test_a_transfer_from_a_peer_that_stopped_beating_is_cut_naming_it(tmp_path):
    run_workers(_frozen_peer, 2, str(tmp_path), timeout=60, killed=(1,))
