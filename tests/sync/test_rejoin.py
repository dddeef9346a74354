"""A rollout that dies and comes back: publishes while it is absent go on for the others
without waiting for it, and a new process that joins at the dead one's rank (``init_group``
with the old rank, a new ``WeightSubscriber``) holds the trainer's latest version exactly
after its first receive (or refetch, from the trainer's cache), on every transport, while
the trainer and the other rollout are never rebuilt."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from dist_utils import wait_for_key
from sync_procs import life, remote_reads_allowed, spawn, wait_root_key, zeros_module
from torch import nn

import slipstream as ss

BUCKET = 64 * 1024
SEPARATE = 4096
TRANSPORTS = ["relay", "broadcast", "shm", "ipc", *(["cma"] if remote_reads_allowed() else [])]


def weights(version: int) -> dict[str, torch.Tensor]:
    """About 1 MiB over several buckets, every tensor different in every version."""
    g = torch.Generator().manual_seed(version)
    return {
        "emb": torch.randn(300, 64, generator=g),
        "w": torch.randn(40_000, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 9, (777,), generator=g),
        "big": torch.randn(100_000, generator=g),
    }


def holder() -> nn.Module:
    return zeros_module(weights(0))


def exact(m: nn.Module, version: int) -> bool:
    return all(torch.equal(m.get_buffer(n), t) for n, t in weights(version).items())


def _rejoin_run(rank, port, transport, mode):
    if rank == 2 and life() == 2:
        wait_root_key(port, "test/absent-published")  # stay away until then
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=120)
    if rank == 0:
        pub = ss.WeightPublisher(
            group,
            [0],
            [1, 2],
            bucket_bytes=BUCKET,
            mode=mode,
            transport=transport,
            separate_min_bytes=SEPARATE,
        )
        assert pub.publish(weights(1), version=1).delivered.result(timeout=30) == 1
        started = time.monotonic()
        handle = pub.publish(weights(2), version=2)  # rollout 2 is dead by now, or dies
        assert handle.delivered.result(timeout=30) == 2
        absent_for = time.monotonic() - started
        assert list(handle.absent) == [2], handle.absent
        assert pub.rollout_versions[1] == 2 and pub.rollout_versions[2] is None
        group.set_json("test/absent-published", True)
        # rank 2 is dead until then: poll the store itself
        wait_for_key(group.store, "test/rejoined", 60, "the new rollout 2 to join")
        handle = pub.publish(weights(3), version=3)
        assert handle.delivered.result(timeout=30) == 3
        assert handle.absent == {}
        assert pub.rollout_versions == {1: 3, 2: 3}
        pub.close()
        group.close()
        return absent_for
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = holder()
    if rank == 1:
        for version in (1, 2, 3):
            assert sub.receive(target) == version
            assert exact(target, version), version
        sub.close()
        group.close()
        return "ok"
    if life() == 1:
        assert sub.receive(target) == 1
        os.kill(os.getpid(), signal.SIGKILL)
    assert group.incarnation == 2
    got = {}
    if mode == "cached":  # the trainer's cache serves the version published while away
        got["refetched"] = sub.refetch(target)
        got["refetched_exact"] = exact(target, 2)
    group.set_json("test/rejoined", True)
    got["received"] = sub.receive(target)
    got["exact"] = exact(target, 3)
    sub.close()
    group.close()
    return got


@pytest.mark.parametrize("mode", ["direct", "cached"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_restarted_rollout_rejoins_at_its_rank_and_holds_the_latest_version(transport, mode):
    out = spawn(_rejoin_run, 3, transport, mode, timeout=90, restart=(2,))
    # the publish while rollout 2 was dead went on for rollout 1 without waiting it out
    assert out[0] < 5, out[0]
    want = {"received": 3, "exact": True}
    if mode == "cached":
        want.update(refetched=2, refetched_exact=True)
    assert out[2] == want
