"""The publisher's own life: its worker survives a refetch look that fails, ``close`` can be
retried after it timed out and frees everything once it succeeds, ``with`` never hides the
block's error, and a rank dropped by ``set_rollouts`` never comes back in
``rollout_versions`` through a refetch that ended after the drop. Interleavings are forced
with events (threads of the trainer process) and store keys (across processes)."""

from __future__ import annotations

import threading

import pytest
import torch
from sync_procs import spawn

import slipstream as ss
from slipstream.errors import PeerTimeoutError

BUCKET = 64 * 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((5000,), float(100 * version + i)) for i in range(4)}


def _refetch_look_fails(rank, port):
    """The worker's look for refetches raises ``OSError`` once while the worker is idle;
    the next publish must still be delivered."""
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, mode="cached")
        looked = threading.Event()
        poll = pub._refetch.poll

        def fails_once() -> None:
            if not looked.is_set():
                looked.set()
                raise OSError(9, "Bad file descriptor (a look that fails)")
            poll()

        pub._refetch.poll = fails_once  # type: ignore[method-assign]
        assert looked.wait(10), "the worker never looked for refetches"
        delivered = pub.publish(weights(1), version=1).delivered.result(timeout=20)
        alive = pub._thread.is_alive()
        pub.close()
        group.close()
        return delivered, alive
    sub = ss.WeightSubscriber(group, [0], [1])
    got = sub.receive(lambda batch: None)
    sub.close()
    group.close()
    return got


def test_the_worker_survives_a_refetch_look_that_raises_and_the_next_publish_is_delivered():
    out = spawn(_refetch_look_fails, 2, timeout=60)
    assert out[0] == (1, True)
    assert out[1] == 1


def _state(pub) -> str | None:
    """The publisher's state's name (``None`` where it has none)."""
    state = getattr(pub, "state", None)
    return None if state is None else state.name


def _close_retried(rank, port):
    """Version 1 is queued while the rollout does not ask yet: ``close(0.3)`` times out;
    the rollout then receives, and a second ``close`` joins the worker and frees the
    cache. ``with`` keeps the block's error when closing fails too."""
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, mode="cached")
        handle = pub.publish(weights(1), version=1)
        with pytest.raises(PeerTimeoutError, match="did not finish"):
            pub.close(timeout=0.3)
        first = (_state(pub), pub._thread.is_alive(), pub.buffer_bytes > 0)
        with pytest.raises(ss.SyncError, match="publish on"):
            pub.publish(weights(2), version=2)
        group.set_json("test/closing-timed-out", True)
        pub.close(timeout=30)
        second = (_state(pub), pub._thread.is_alive(), pub.buffer_bytes, handle.delivered.result(0))

        def close_fails(timeout=None):
            raise PeerTimeoutError("the worker did not finish")

        pub.close = close_fails  # type: ignore[method-assign]
        with pytest.raises(ValueError, match="the block's own error") as err:
            with pub:
                raise ValueError("the block's own error")
        notes = getattr(err.value, "__notes__", [])
        group.close()
        return first, second, notes
    sub = ss.WeightSubscriber(group, [0], [1])
    group.get_json("test/closing-timed-out", 0, "the trainer's first close to time out", 30)
    got = sub.receive(lambda batch: None)
    sub.close()
    group.close()
    return got


def test_close_that_timed_out_can_be_retried_and_frees_everything_and_with_keeps_the_error():
    out = spawn(_close_retried, 2, timeout=60)
    first, second, notes = out[0]
    assert first == ("CLOSING", True, True), first
    assert second == ("CLOSED", False, 0, 1), second
    assert notes and "closing the publisher then failed too" in notes[0], notes
    assert out[1] == 1


def _dropped_during_refetch(rank, port):
    """Rollout 2 refetches; the trainer's worker is held at the start of serving it until
    the caller dropped rank 2 with ``set_rollouts([1])``; the refetch then completes. Rank 2
    must not be back in ``rollout_versions``."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=60)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1, 2], bucket_bytes=BUCKET, mode="cached")
        assert pub.publish(weights(1), version=1).delivered.result(timeout=30) == 1
        serving, dropped, served = threading.Event(), threading.Event(), threading.Event()
        serve = pub._refetch._serve

        def held_serve(request) -> None:
            serving.set()
            assert dropped.wait(20), "the caller never dropped the rank"
            try:
                serve(request)
            finally:
                served.set()

        pub._refetch._serve = held_serve  # type: ignore[method-assign]
        group.set_json("test/refetch-now", True)
        assert serving.wait(20), "rollout 2's refetch never reached the worker"
        pub.set_rollouts([1])
        dropped.set()
        assert served.wait(30), "the worker never finished serving rollout 2's refetch"
        after_refetch = pub.rollout_versions
        assert pub.publish(weights(2), version=2).delivered.result(timeout=30) == 2
        final = pub.rollout_versions
        pub.close()
        group.close()
        return after_refetch, final
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    assert sub.receive(lambda batch: None) == 1
    got = None
    if rank == 2:
        group.get_json("test/refetch-now", 0, "the trainer to hold its worker", 30)
        got = sub.refetch(lambda batch: None)
    else:
        got = sub.receive(lambda batch: None)
    sub.close()
    group.close()
    return got


def test_a_refetch_that_ends_after_set_rollouts_dropped_its_rank_does_not_bring_it_back():
    out = spawn(_dropped_during_refetch, 3, timeout=90)
    after_refetch, final = out[0]
    assert after_refetch == {1: 1}, after_refetch
    assert final == {1: 2}, final
    assert out[1] == 2 and out[2] == 1
