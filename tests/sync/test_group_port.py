"""Rank 0 of a sync group may let the system pick its store's port (``port=0``): it is told
the port as soon as the store listens, before it waits for the others, so a process can
hand it to the other ranks with no window in which another process takes it (the
bind-close-bind race of picking a free port first). Another rank cannot join on port 0."""

from __future__ import annotations

import queue
import threading

import pytest

import slipstream as ss


def test_rank_0_is_told_the_port_its_store_listens_on():
    ports: queue.Queue[int] = queue.Queue()
    hosted = {}

    def host() -> None:
        hosted["group"] = ss.sync.init_group(
            "127.0.0.1", 0, 2, 0, timeout=30, on_listening=ports.put
        )

    thread = threading.Thread(target=host, name="test-rank-0")
    thread.start()
    try:
        port = ports.get(timeout=30)
        assert port > 0
        joined = ss.sync.init_group("127.0.0.1", port, 2, 1, timeout=30)
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert (hosted["group"].rank, joined.rank) == (0, 1)
    joined.close()
    hosted["group"].close()


def test_another_rank_cannot_join_on_port_0():
    with pytest.raises(ValueError, match="rank 1 must be given the port"):
        ss.sync.init_group("127.0.0.1", 0, 2, 1, timeout=5)
