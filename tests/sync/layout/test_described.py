"""A publisher's first publish from an iterator: described buckets (:mod:`.sync.described`).

No layout is given: the trainers read the generator as it yields and each bucket's header
names the tensors that start in it; the rollouts learn the layout as they receive. On every
transport, with two trainers, every way of receiving (into a module, atomically, through
``receive_iter``) holds exactly what was yielded, including a tensor larger than a bucket,
one that ends on a bucket boundary, an empty one, bfloat16 ones and a tied name yielded
again. From the second version on the layout is the publisher's: an iterator that departs
from it is refused naming the tensor. A rollout whose target lacks a tensor refuses the
version at the bucket naming it (holding no complete version), and the next version reaches
it. A rollout killed during the first version is named to the trainer, the survivor is
freed, and a process that replaces it holds the next version exactly.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
from dist_utils import wait_for_key
from sync_procs import life, remote_reads_allowed, spawn, wait_root_key, zeros_module
from torch import nn

import slipstream as ss
from slipstream.errors import PeerDiedError
from slipstream.sync import LayoutMismatch

BUCKET = 64 * 1024
TRANSPORTS = ["relay", "broadcast", "shm", *(["cma"] if remote_reads_allowed() else [])]


def items(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    emb = torch.randn(64, 32, generator=g)
    out = [("emb", emb)]
    # ends exactly on the first bucket's boundary: 8 KiB + 56 KiB
    out += [("edge", torch.randn((BUCKET - emb.nbytes) // 4, generator=g))]
    out += [(f"b{i}", torch.randn(1000 + i, generator=g)) for i in range(8)]
    out += [("empty", torch.empty(0)), ("big", torch.randn(BUCKET // 2 + 11, generator=g))]
    out += [(f"h{i}", torch.randn(300, generator=g).to(torch.bfloat16)) for i in range(40)]
    out += [("head", emb.clone())]  # a tied name, yielded again as a gathered tensor would be
    return out


def holder() -> nn.Module:
    return zeros_module(items(0))


def exact(got: dict[str, torch.Tensor], version: int) -> bool:
    want = dict(items(version))
    return got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def _every_transport(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 4, rank, timeout=60)
    if rank in (0, 1):
        pub = ss.WeightPublisher(group, [0, 1], [2, 3], bucket_bytes=BUCKET, transport=transport)
        for version in (0, 1):
            assert pub.publish(iter(items(version))).delivered.result(timeout=30) == version
        shape = [(n, t[:-1] if n == "b3" else t) for n, t in items(2)]
        with pytest.raises(LayoutMismatch) as err:  # the layout is the first version's
            pub.publish(iter(shape)).delivered.result(timeout=30)
        assert pub.publish(iter(items(3))).delivered.result(timeout=30) == 3
        pub.close()
        group.close()
        return str(err.value)
    sub = ss.WeightSubscriber(group, [0, 1], [2, 3])
    seen = []
    for version, atomic in ((0, False), (1, True)):
        if rank == 2:
            target = holder()
            assert sub.receive(target, atomic=atomic) == version
            seen.append(exact(dict(target.named_buffers()), version))
        else:
            got = {n: t.clone() for n, t in sub.receive_iter(atomic=atomic, full=True)}
            seen.append(exact(got, version) and sub.version == version)
    with pytest.raises(ss.SyncError):
        sub.receive(holder(), full=True)
    target = holder()
    assert sub.receive(target, full=True) == 3
    seen.append(exact(dict(target.named_buffers()), 3))
    sub.close()
    group.close()
    return seen


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_first_streamed_version_carries_its_layout_on_every_transport(transport):
    out = spawn(_every_transport, 4, transport, timeout=90)
    assert "'b3' is [1002] float32, the layout has [1003] float32" in out[0], out[0]
    assert out[2] == [True, True, True] and out[3] == [True, True, True], out


def _refused_by_one(rank, port, refusing):
    group = ss.sync.init_group("127.0.0.1", port, 4, rank, timeout=60)
    if rank in (0, 1):
        pub = ss.WeightPublisher(group, [0, 1], [2, 3], bucket_bytes=BUCKET, transport="broadcast")
        assert pub.publish(iter(items(0))).delivered.result(timeout=30) == 0
        version = items(1)
        if rank == refusing:  # only this trainer's iterator departs from the layout
            version = [(n, t[:-1] if n == "b3" else t) for n, t in version]
        began = time.monotonic()
        try:
            pub.publish(iter(version)).delivered.result(timeout=30)
            error: BaseException | None = None
        except Exception as exc:
            error = exc
        took = time.monotonic() - began
        assert pub.publish(iter(items(2))).delivered.result(timeout=30) == 2
        pub.close()
        group.close()
        return type(error).__name__, str(error), took
    sub = ss.WeightSubscriber(group, [0, 1], [2, 3])
    assert sub.receive(holder()) == 0
    began = time.monotonic()
    with pytest.raises(ss.SyncError) as err:
        sub.receive(holder(), full=True)
    took = time.monotonic() - began
    target = holder()
    assert sub.receive(target, full=True) == 2
    held = exact(dict(target.named_buffers()), 2)
    sub.close()
    group.close()
    return str(err.value), took, held


@pytest.mark.parametrize("refusing", [0, 1])
def test_a_layout_one_trainer_refuses_ends_the_round_for_everyone_within_seconds(refusing):
    """Only one trainer's iterator yields 'b3' in another shape (in bucket 1): that
    trainer raises LayoutMismatch itself, and the other trainer and both rollouts fail the
    round naming the tensor and the trainer within seconds, whichever trainer it is and
    whatever the others had sent; the next version reaches both rollouts."""
    out = spawn(_refused_by_one, 4, refusing, timeout=90)
    mismatch = "'b3' is [1002] float32, the layout has [1003] float32"
    kind, error, took = out[refusing]
    assert kind == "LayoutMismatch" and mismatch in error and took < 10, out[refusing]
    kind, error, took = out[1 - refusing]
    assert kind == "SyncError" and mismatch in error, out[1 - refusing]
    assert f"trainer rank {refusing}" in error and took < 10, out[1 - refusing]
    for rollout in (2, 3):
        error, took, held = out[rollout]
        assert mismatch in error and f"trainer rank {refusing}" in error, out[rollout]
        assert took < 10 and held is True, out[rollout]


def _lacking(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET)
        error = pub.publish(iter(items(0))).delivered.exception(timeout=30)
        assert pub.publish(iter(items(1))).delivered.result(timeout=30) == 1
        pub.close()
        group.close()
        return str(error)
    sub = ss.WeightSubscriber(group, [0], [1])
    lacking = holder()
    del lacking._buffers["h7"]  # in a later bucket than the first
    with pytest.raises(ss.SyncError) as err:
        sub.receive(lacking)
    refused = (str(err.value), sub.version)
    target = holder()
    assert sub.receive(target) == 1
    sub.close()
    group.close()
    return refused, exact(dict(target.named_buffers()), 1)


def test_a_target_lacking_a_described_tensor_refuses_at_its_bucket_and_the_next_goes_on():
    out = spawn(_lacking, 2, timeout=60)
    (error, version), then = out[1]
    at = re.search(r"rejected version 0 at bucket (\d+) \(buckets before it were applied\)", error)
    assert at and int(at.group(1)) > 0 and "not in the target: ['h7']" in error, error
    assert version is None  # the buckets before it were applied: no complete version
    assert then is True
    assert "not applied everywhere" in out[0] and "'h7'" in out[0], out[0]


def _killed_in_the_first(rank, port):
    if rank == 2 and life() == 2:
        wait_root_key(port, "test/survived")
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=60)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1, 2], bucket_bytes=BUCKET, transport="relay")
        with pytest.raises(PeerDiedError) as err:
            pub.publish(iter(items(0))).delivered.result(timeout=30)
        # the old rank 2 is dead until its replacement joins: wait without judging it
        wait_for_key(group.store, "test/rejoined", 60, "the new rollout 2")
        handle = pub.publish(iter(items(1)))
        assert handle.delivered.result(timeout=30) == 1 and handle.absent == {}
        pub.close()
        group.close()
        return err.value.ranks
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    if rank == 2 and life() == 1:

        def die(batch):  # the first version's transfer is under way
            os.kill(os.getpid(), signal.SIGKILL)

        sub.receive(die)
    out = {}
    target = holder()
    if rank == 1:
        with pytest.raises(PeerDiedError) as err:
            sub.receive(target)
        out["ranks"] = err.value.ranks
        group.set_json("test/survived", True)
    else:
        group.set_json("test/rejoined", True)
    out["received"] = sub.receive(target)
    out["exact"] = exact(dict(target.named_buffers()), 1)
    sub.close()
    group.close()
    return out


def test_a_rollout_killed_in_the_first_version_is_named_and_its_replacement_holds_the_next():
    out = spawn(_killed_in_the_first, 3, timeout=90, restart=(2,))
    assert out[0] == [2]
    assert out[1] == {"ranks": [2], "received": 1, "exact": True}
    assert out[2] == {"received": 1, "exact": True}
