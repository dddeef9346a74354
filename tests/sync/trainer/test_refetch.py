"""Two rollouts refetching at once from two trainers both get the cached version: every
trainer serves refetches in one order (their tickets), so no trainer holds an offer for one
rollout while the other rollout waits for that trainer's offer.

The crossed interleaving that deadlocked is forced through the store: trainer 0 looks for
refetches as usual and takes rollout 3's (asked first); trainer 1 does not look until both
rollouts have asked; rollout 2 asks once trainer 0 has offered to rollout 3. A trainer
serving in rank order then offers to rollout 2 first, and each rollout waits for the offer
the other's trainer holds back, until the group's timeout."""

from __future__ import annotations

import torch
from sync_procs import spawn, zeros_module

import slipstream as ss
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
