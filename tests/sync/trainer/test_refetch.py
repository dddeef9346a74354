"""Refetches from the trainers' host caches.

Two rollouts refetching at once from two trainers both get the cached version: every
trainer serves refetches in one order (their tickets), so no trainer holds an offer for one
rollout while the other rollout waits for that trainer's offer. The crossed interleaving
that deadlocked is forced through the store: trainer 0 looks for refetches as usual and
takes rollout 3's (asked first); trainer 1 does not look until both rollouts have asked;
rollout 2 asks once trainer 0 has offered to rollout 3. A trainer serving in rank order then
offers to rollout 2 first, and each rollout waits for the offer the other's trainer holds
back, until the group's timeout.

A publish never waits for a refetch: a rollout that was offered the cache and has not
acknowledged yet (it is held in its target, after the first bucket landed, until the
trainer's publish returned) does not block the trainer's snapshot of the next version, and
still gets the old version's exact bytes (over ``cma`` it reads the cache's memory after the
snapshot, so that memory must be left as it was).
"""

from __future__ import annotations

import pytest
import torch
from sync_procs import remote_reads_allowed, spawn, zeros_module

import slipstream as ss
from slipstream.errors import PeerTimeoutError
from slipstream.sync.round.protocol import Keys

BUCKET = 64 * 1024
TIMEOUT = 15.0


def weights(version: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((5000,), float(100 * version + i)) for i in range(8)}


def _crossed_refetches(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 4, rank, timeout=TIMEOUT)
    if rank in (0, 1):
        with ss.WeightPublisher(
            group, [0, 1], [2, 3], bucket_bytes=BUCKET, mode="cached", transport="relay"
        ) as pub:
            server = pub._refetch
            if rank == 1:
                look = server.poll

                def after_both_asked() -> None:
                    if server.group.count(Keys.ASK_AGAIN_COUNT) >= 2:
                        look()

                server.poll = after_both_asked  # type: ignore[method-assign]
            pub.publish(weights(1), version=1).delivered.result(timeout=TIMEOUT)
            group.wait_keys({r: f"test/refetched/{r}" for r in (2, 3)}, "the refetches", 60)
        group.close()
        return None
    target = zeros_module(weights(1))
    with ss.WeightSubscriber(group, [0, 1], [2, 3]) as sub:
        assert sub.receive(target) == 1
        for b in target.buffers():
            b.zero_()
        if rank == 2:  # ask once trainer 0 took rollout 3's request
            sub.group.wait_keys({0: Keys.again_offer(3, 0, 0)}, "trainer 0's offer to 3", 30)
        try:
            outcome: object = sub.refetch(target)
        except Exception as exc:  # the outcome is checked in the test
            outcome = f"{type(exc).__name__}: {exc}"
        exact = all(torch.equal(target.get_buffer(n), t) for n, t in weights(1).items())
        group.set_json(f"test/refetched/{rank}", True)
    group.close()
    return outcome, exact


def test_two_rollouts_refetching_at_once_from_two_trainers_both_get_the_cached_version():
    out = spawn(_crossed_refetches, 4, timeout=120)
    assert out[2] == (1, True), out[2]
    assert out[3] == (1, True), out[3]


#: The publisher's timeout: the cache's lock is waited for this long before a publish fails.
PUBLISH_TIMEOUT = 5.0
#: Every other wait of the test (the group's timeout too).
WAIT = 30.0
#: One tensor per bucket: eight buckets, so a refetch lands in several batches.
ONE_PER_BUCKET = 32 * 1024
#: Words the diff of version 2 against version 1 compares: eight tensors of 2500 words.
COMPARED_WORDS = 8 * 2500


def nudged(version: int) -> dict[str, torch.Tensor]:
    """Version 1, or version 2: version 1 with the first element of every tensor (so of
    every bucket) changed, one word each."""
    named = {f"t{i}": torch.full((5000,), float(100 + i)) for i in range(8)}
    for t in named.values() if version == 2 else ():
        t[0] += 1
    return named


def exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())


def _publish_during_refetch(rank, port, transport):
    """Rollout 1 refetches version 1 and, once its first bucket landed, waits for the
    trainer's publish of version 2 to return before taking the rest and acknowledging."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=WAIT)
    if rank == 0:
        with ss.WeightPublisher(
            group,
            [0],
            [1, 2],
            bucket_bytes=ONE_PER_BUCKET,
            mode="cached",
            transport=transport,
            timeout=PUBLISH_TIMEOUT,
        ) as pub:
            assert pub.publish(nudged(1), version=1).delivered.result(timeout=WAIT) == 1
            one_version = pub.base_bytes
            group.wait_keys({1: "test/refetching"}, "rollout 1's refetch to land a bucket", WAIT)
            try:
                handle = pub.publish(nudged(2), version=2)
            except PeerTimeoutError as exc:
                group.set_json("test/published", False)
                return f"publish raised: {type(exc).__name__}: {exc}"
            group.set_json("test/published", True)
            delivered = handle.delivered.result(timeout=WAIT)
            outcome = (delivered, handle.timings.changed_fraction, pub.base_bytes == one_version)
        group.close()
        return outcome
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    assert sub.receive(zeros_module(nudged(1))) == 1
    result: dict[str, object] = {}
    if rank == 1:
        got: dict[str, torch.Tensor] = {}
        batches = 0

        def slow(batch) -> None:
            nonlocal batches
            if batches == 0:
                group.set_json("test/refetching", True)
                group.get_json("test/published", 0, "the trainer's publish of version 2", WAIT)
            batches += 1
            got.update((n, t.clone()) for n, t in batch)

        try:
            refetched: object = sub.refetch(slow)
        except Exception as exc:  # the outcome is checked in the test
            refetched = f"{type(exc).__name__}: {exc}"
        result["refetch"] = (refetched, batches > 1, exact(got, nudged(1)))
    if group.get_json("test/published", 0, "the trainer's publish of version 2", WAIT):
        target = zeros_module(nudged(2))
        version = sub.receive(target)
        held = {n: target.get_buffer(n) for n in nudged(2)}
        result["received"] = (version, exact(held, nudged(2)))
    sub.close()
    group.close()
    return result


@pytest.mark.parametrize("transport", ["relay", *(["cma"] if remote_reads_allowed() else [])])
def test_a_publish_during_an_unacknowledged_refetch_completes_and_the_refetch_gets_the_old_bytes(
    transport,
):
    out = spawn(_publish_during_refetch, 3, transport, timeout=120)
    # delivered; diffed against version 1's bytes (one word per tensor changed); the
    # second buffer freed once the refetch let go of the first
    assert out[0] == (2, 8 / COMPARED_WORDS, True), out[0]
    assert out[1] == {"refetch": (1, True, True), "received": (2, True)}, out[1]
    assert out[2] == {"received": (2, True)}, out[2]
