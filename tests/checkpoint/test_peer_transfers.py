"""A transfer between ranks (the read-once exchange's and the local tier's,
:func:`slipstream.checkpoint.peer_transfers.move`) from a peer that vanished (no
connection reset: its host cut off or frozen) ends when the channel's liveness finds the
peer dead, not at the group's timeout.

Two gloo ranks, each with a channel and a gloo group of slipstream's own. Rank 1 stops
itself (``SIGSTOP``: its connections stay open and its heartbeat stops, as a frozen
host's would) before it sends; rank 0's receive fails with a :class:`PeerDiedError`
naming rank 1 and its silence, well before the group's timeout. Then rank 0 kills rank 1,
which ends the abandoned receive: its waiter thread exits.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers

from slipstream.checkpoint.peer_transfers import Move, move
from slipstream.checkpoint.save import channel as channel_module
from slipstream.checkpoint.save.channel import RankChannel
from slipstream.core.gloo_groups import new_gloo_group
from slipstream.core.waits import Deadline
from slipstream.errors import PeerDiedError

GROUP_TIMEOUT = 30.0
SILENT_AFTER = 0.5


def _frozen_peer(rank: int, world: int, base: str) -> None:
    channel_module.SILENT_AFTER_SECONDS = SILENT_AFTER
    store = dist.distributed_c10d._get_default_store()
    channel = RankChannel(dist.PrefixStore("transfers-test", store), rank, world, "ns")
    group = new_gloo_group([0, 1], GROUP_TIMEOUT, "test_peer_transfers")
    abandoned: list = []
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
        move(group, channel, [Move(1, 0, data, False, "a replica from rank 1")],
             Deadline(GROUP_TIMEOUT), abandoned)  # fmt: skip
    waited = time.monotonic() - started
    assert err.value.ranks == [1]
    assert "rank 0 found rank 1 dead (no heartbeat for" in str(err.value), err.value
    assert "while a replica from rank 1" in str(err.value), err.value
    assert waited < GROUP_TIMEOUT / 3, f"the receive ended {waited:.1f} s after it started"
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    with open(pid_file) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    (waiter,) = abandoned
    waiter.join(GROUP_TIMEOUT / 3)  # the abandoned receive ends as the connection closes
    assert not waiter.is_alive()
    dist.destroy_process_group(group)
    channel.close()


def test_a_transfer_from_a_peer_that_stopped_beating_is_cut_naming_it(tmp_path):
    run_workers(_frozen_peer, 2, str(tmp_path), timeout=60, killed=(1,))
