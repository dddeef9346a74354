"""The sync watch judges many ranks in one read, and wakes a wait on a dead rank's key.

In-process, on a real TCPStore: ranks posted as elsewhere (another host's identity), each
with a counter this test beats or leaves still. The watch's own client counts its calls:
a look at 16 ranks is one ``multi_get`` once they are seen joined; a rank silent past
``silent_after`` has its awaited key filled with a word naming it, which
:func:`read_dead_word` reads back; a rank that beats is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from slipstream.sync.liveness import Awaited, SyncWatch, read_dead_word
from slipstream.sync.members import host_identity


class CountingStore:
    """A store client that counts its calls by method."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        self.calls[name] += 1
        return getattr(self.store, name)


def hello(rank: int, host: str, pid: int = 1) -> str:
    return json.dumps({"host": host, "pid": pid, "start": None, "incarnation": 1})


def joined_store(ranks: range) -> dist.Store:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    for r in ranks:
        store.add(f"alive/{r}", 1)
        store.set(f"hello/{r}", hello(r, "another-host"))
    return store


def watch_of(store: Any, silent_after: float, look_every: float = 0.1) -> SyncWatch:
    return SyncWatch(
        store, lambda r: f"hello/{r}", lambda r: f"alive/{r}", silent_after, look_every
    )


def test_a_look_at_many_ranks_is_one_read() -> None:
    ranks = range(1, 17)
    client = CountingStore(joined_store(ranks))
    watch = watch_of(client, 60.0)
    try:
        assert watch.dead_among(list(ranks)) == {}  # their hellos looked for once, together
        client.calls.clear()
        for _ in range(3):
            assert watch.dead_among(list(ranks)) == {}
        assert client.calls == Counter(multi_get=3), client.calls
    finally:
        watch.close()


def test_a_rank_that_never_joined_is_not_judged_and_one_here_is_its_process() -> None:
    store = joined_store(range(1, 3))
    watch = watch_of(store, 0.0)
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        assert watch.dead_among([7]) == {}  # no hello: nothing to judge, and no read blocks
        store.add("alive/7", 1)
        store.set("hello/7", hello(7, host_identity(), gone.pid))
        assert watch.dead_among([7]) == {7: f"its process (pid {gone.pid}) is gone"}
        store.set("hello/7", hello(7, host_identity(), os.getpid()))  # replaced: it runs
        assert watch.dead_among([7]) == {}
    finally:
        watch.close()


def test_a_silent_rank_has_its_awaited_key_filled_and_a_beating_one_does_not() -> None:
    store = joined_store(range(1, 3))
    beater = dist.TCPStore("127.0.0.1", store.port, 1, False)  # not queued behind the wait
    stop = threading.Event()

    def beat_rank_1() -> None:
        while not stop.wait(0.05):
            beater.add("alive/1", 1)

    beats = threading.Thread(target=beat_rank_1)
    beats.start()
    watch = watch_of(dist.TCPStore("127.0.0.1", store.port, 1, False), 1.0)
    try:
        watching = [watch.watch(Awaited(r, f"answer/{r}")) for r in (1, 2)]
        started = time.monotonic()
        store.wait(["answer/2"], timedelta(seconds=5))
        waited = time.monotonic() - started
        assert 1.0 <= waited < 3.0, waited
        rank, why = read_dead_word(store.get("answer/2")) or (None, "")
        assert rank == 2 and why.startswith("no heartbeat for"), why
        time.sleep(0.3)
        assert not store.check(["answer/1"]), store.get("answer/1")  # it beats: left alone
        store.set("answer/1", "its own answer")
        assert read_dead_word(store.get("answer/1")) is None
        for number in watching:
            watch.unwatch(number)
    finally:
        stop.set()
        beats.join(5)
        watch.close()
