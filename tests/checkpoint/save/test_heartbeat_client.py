"""A rank's checkpoint heartbeat beats through a store client of its own: a request that
blocks on the shared client (NCCL's lazy communicator setup waits in ``store.get``) must
not silence a live rank, or its peers would declare it dead (issue 47, item b)."""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist

from slipstream.checkpoint.save import channel as channel_module
from slipstream.checkpoint.save.channel import RankChannel
from slipstream.core.store_watch import StoreWatch, StoreWatches

BLOCK_S = 3.0
"""How long the other thread's ``store.get`` blocks on the shared client."""


def test_beats_go_on_while_another_thread_blocks_on_the_shared_client(monkeypatch):
    fast = StoreWatches(
        lambda store: StoreWatch(store, channel_module.alive_key, "deaths", 0.05, 0.05, 3.0),
        linger=0.0,
    )
    monkeypatch.setattr(channel_module, "WATCHES", fast)
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=BLOCK_S)
    )
    shared = dist.PrefixStore("job", store)
    channel = RankChannel(shared, 0, 2, "ns")
    reader = dist.PrefixStore("job", store).clone()
    key = "slipstream/alive/0"  # the process's one beat, shared by its channels
    blocking = threading.Event()

    def block() -> None:
        blocking.set()
        try:
            shared.get("never-set")  # blocks the shared client for BLOCK_S
        except dist.DistStoreError:
            pass

    thread = threading.Thread(target=block)
    try:
        thread.start()
        assert blocking.wait(5)
        start = int(reader.get(key))
        deadline = time.monotonic() + BLOCK_S / 2
        beats = 0
        while time.monotonic() < deadline and beats < 3:
            beats = int(reader.get(key)) - start
        assert beats >= 3, (
            f"the heartbeat moved {beats} time(s) in {BLOCK_S / 2} s while another thread "
            "blocked on the shared store client: it beats on that client"
        )
    finally:
        thread.join(2 * BLOCK_S)
        channel.close()
