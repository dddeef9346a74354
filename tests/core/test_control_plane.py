"""The control plane on an in-process store: keys, waiting with backoff under a deadline,
liveness while waiting, and the one error that names who did not answer."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from slipstream.core.control_plane import (
    Heartbeat,
    LivenessWatch,
    store_key,
    wait_for_keys,
)
from slipstream.core.waits import Deadline
from slipstream.errors import MissingRanksError, PeerDiedError, PeerTimeoutError


def test_store_keys_join_their_parts_and_need_one():
    assert store_key("req", 2, 17) == "req/2/17"
    assert store_key("plan", "ab12") == "plan/ab12"
    with pytest.raises(ValueError):
        store_key()


def test_a_wait_returns_once_every_key_is_written_by_another_thread():
    store = dist.HashStore()
    last_written = []

    def write_later():
        time.sleep(0.2)
        store.set("k/1", "x")
        time.sleep(0.1)
        last_written.append(time.monotonic())  # just before: the wait may end at once
        store.set("k/2", "y")

    writer = threading.Thread(target=write_later)
    writer.start()
    dropped = wait_for_keys(store, {1: "k/1", 2: "k/2"}, "the keys", Deadline(5), "rank 0")
    returned = time.monotonic()
    writer.join()
    assert dropped == {}
    # not before the last key was written, and long before the deadline
    assert last_written[0] <= returned < last_written[0] + 2


def test_a_wait_that_expires_names_the_missing_ranks_what_and_how_long():
    store = dist.HashStore()
    store.set("k/1", "x")
    started = time.monotonic()
    with pytest.raises(MissingRanksError) as err:
        wait_for_keys(store, {1: "k/1", 2: "k/2", 3: "k/3"}, "the layout", Deadline(0.3), "rank 0")
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 1.5
    e = err.value
    assert isinstance(e, PeerTimeoutError) and not isinstance(e, PeerDiedError)
    # the wait starts a moment after its deadline was made: it waits that much less
    assert e.ranks == [2, 3] and e.what == "the layout" and 0.29 <= e.waited < 1.5
    assert str(e) == (
        "rank(s) [2, 3] did not answer within 0.3 s while rank 0 waited for the layout"
    )


def test_a_dead_rank_ends_the_wait_at_once_or_is_dropped_and_the_others_still_awaited():
    store = dist.HashStore()
    dead = {3: "its process (pid 42) is gone"}
    asked: list[list[int]] = []

    def liveness(ranks):
        asked.append(list(ranks))
        return {r: why for r, why in dead.items() if r in ranks}

    started = time.monotonic()
    with pytest.raises(PeerDiedError) as err:
        wait_for_keys(store, {1: "k/1", 3: "k/3"}, "acks", Deadline(60), "rank 0", liveness)
    assert time.monotonic() - started < 2  # not the 60 s deadline
    assert err.value.ranks == [3] and err.value.what == "acks"
    assert "rank(s) [3] died" in str(err.value) and "pid 42" in str(err.value)
    assert all(1 in ranks for ranks in asked)  # only the missing ranks are asked about

    threading.Timer(0.5, lambda: store.set("k/1", "x")).start()
    dropped = wait_for_keys(
        store, {1: "k/1", 3: "k/3"}, "acks", Deadline(60), "rank 0", liveness, drop_dead=True
    )
    assert dropped == dead and store.check(["k/1"])


def test_idle_runs_between_polls_and_its_error_ends_the_wait():
    store = dist.HashStore()
    calls = []

    def idle():
        calls.append(time.monotonic())
        if len(calls) == 5:
            raise RuntimeError("given up elsewhere")

    with pytest.raises(RuntimeError, match="given up elsewhere"):
        wait_for_keys(store, {1: "k/1"}, "a key", Deadline(10), "rank 0", idle=idle)
    assert len(calls) == 5


def test_a_heartbeat_that_stops_is_found_silent_and_a_beat_again_is_alive_again():
    store = dist.HashStore()
    watch = LivenessWatch(store, lambda r: f"alive/{r}", silent_after=0.5)
    assert watch.dead([1]) == {}  # never beat: not judged
    beat = Heartbeat(store, "alive/1", interval=0.05)
    for _ in range(8):  # 0.8 s, longer than silent_after, beating all along
        assert watch.dead([1]) == {}
        time.sleep(0.1)
    beat.close()
    watch.dead([1])
    time.sleep(0.7)
    silent = watch.dead([1])
    assert list(silent) == [1] and "no heartbeat for" in silent[1]
    store.add("alive/1", 1)  # a replacement process beats on the same key
    assert watch.dead([1]) == {}


def test_a_death_notice_names_a_silent_rank_at_once_and_a_beat_voids_it():
    store = dist.HashStore()
    watch = LivenessWatch(store, lambda r: f"alive/{r}", 60.0, notice_of=lambda r: f"gone/{r}")
    store.add("alive/1", 1)
    store.add("alive/2", 1)
    assert watch.dead([1, 2]) == {}  # beat once, and 60 s of silence are far off
    watch.notice(2, "its connection to rank 0 dropped")
    assert watch.dead([1, 2]) == {2: "its connection to rank 0 dropped"}
    other = LivenessWatch(store, lambda r: f"alive/{r}", 60.0, notice_of=lambda r: f"gone/{r}")
    assert other.dead([2]) == {2: "its connection to rank 0 dropped"}  # every watcher
    store.add("alive/2", 1)  # it beats again: the notice is void
    assert watch.dead([1, 2]) == {} and other.dead([2]) == {}
    watch.notice(3, "never beat")  # a rank that never beat is not judged
    assert watch.dead([3]) == {}
