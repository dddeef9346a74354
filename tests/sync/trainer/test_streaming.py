"""Publishes read from a generator as it yields.

A model of 256 MiB in 512 tensors, yielded one fresh tensor per step (as verl's generator
gathers one ``full_tensor()`` per ``next()``): on the first publish (no layout given: its
buckets carry it) as on the next, the yielded tensors alive at once never exceed 4 buckets
plus 10% of the model, counted by weak references to their storages (so a view a transport
still holds counts), and the trainer's resident high-water mark (``VmHWM``, reset before the
publish) grows by no more than that either; the same items handed over as a list hold the
whole model, which both measures see. The rollout receives every byte exactly.

On two trainers, in both modes, a streamed publish matches the layout of the first one (a
tied name yielded again is skipped, the tie applied): a shape that differs, a name out of
order or a tensor missing fails that publish naming the tensor (``direct``: the round is
given up and the rollout's receive fails; ``cached``: the snapshot fails and no round
starts), and the next publish reaches the rollout whole.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from sync_procs import spawn
from torch import nn

import slipstream as ss
from slipstream.sync import LayoutMismatch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from common import Live, reset_high_water, status_bytes  # noqa: E402

MiB = 2**20
TENSORS = 512
NUMEL = 128 * 1024  # 512 KiB of float32 each: 256 MiB in all
BUCKET = 8 * MiB
MODEL = TENSORS * NUMEL * 4


def value(version: int, i: int) -> torch.Tensor:
    return torch.full((NUMEL,), float(version * 1000 + i))


def model(version: int, live: Live):
    for i in range(TENSORS):
        yield f"w{i}", live.track(value(version, i))


def _measured(publish, version: int, items) -> dict:
    """Publish ``items``; the yielded tensors' peak and the resident high-water mark's rise."""
    live = Live()
    reset_high_water()
    before = status_bytes("VmRSS")
    assert publish(items(version + 1, live)).delivered.result(timeout=60) == version
    return {"live": live.peak, "rss_extra": status_bytes("VmHWM") - before}


def _bounded(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=120)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET)
        out = {  # no layout given: the first publish's buckets carry it
            "first": _measured(pub.publish, 0, model),
            "later": _measured(pub.publish, 1, model),
            "listed": _measured(lambda items: pub.publish(list(items)), 2, model),
            "transport": pub.transport,
        }
        pub.close()
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1])
    target = nn.Module()
    for i in range(TENSORS):
        target.register_buffer(f"w{i}", torch.zeros(NUMEL))
    exact = []
    for version in (0, 1, 2):
        assert sub.receive(target) == version
        exact.append(
            all(
                torch.equal(target.get_buffer(f"w{i}"), value(version + 1, i))
                for i in range(TENSORS)
            )
        )
    sub.close()
    group.close()
    return exact


def test_a_streamed_publish_keeps_a_few_buckets_of_a_256_mib_model_alive_the_first_too():
    out = spawn(_bounded, 2, timeout=120)
    trainer = out[0]
    bound = 4 * BUCKET + MODEL // 10
    for publish in ("first", "later"):
        assert trainer[publish]["live"] <= bound, trainer
        assert trainer[publish]["rss_extra"] <= bound, trainer
    assert trainer["listed"]["live"] >= MODEL, trainer  # the count sees a model held whole
    assert trainer["listed"]["rss_extra"] >= 0.9 * MODEL, trainer  # and so does the RSS
    assert out[1] == [True, True, True]


SMALL = 64 * 1024


def small(version: int) -> list[tuple[str, torch.Tensor]]:
    """A tied pair (the second name yielded again as a tensor of its own, as a gathering
    generator would), small tensors, and one larger than a bucket."""
    g = torch.Generator().manual_seed(version)
    emb = torch.randn(64, 32, generator=g)
    items = [("emb", emb)]
    items += [(f"b{i}", torch.randn(1000 + i, generator=g)) for i in range(8)]
    items += [("big", torch.randn(SMALL // 2 + 11, generator=g)), ("head", emb.clone())]
    return items


def _layouts(rank, port, mode):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=120)
    if rank in (0, 1):
        pub = ss.WeightPublisher(group, [0, 1], [2], bucket_bytes=SMALL, mode=mode)
        first = dict(small(0))
        first["head"] = first["emb"]  # the first publish shows the tie
        assert pub.publish(first).delivered.result(timeout=30) == 0
        assert pub.publish(iter(small(1))).delivered.result(timeout=30) == 1
        shape = [(n, t[:-1] if n == "b3" else t) for n, t in small(2)]
        order = small(2)
        order[2], order[3] = order[3], order[2]
        errors = []
        for bad in (shape, order, small(2)[:5]):
            with pytest.raises(LayoutMismatch) as err:
                pub.publish(iter(bad)).delivered.result(timeout=30)
            errors.append(str(err.value))
        assert pub.publish(iter(small(5))).delivered.result(timeout=30) == 5
        pub.close()
        group.close()
        return errors
    sub = ss.WeightSubscriber(group, [0, 1], [2])
    target = nn.Module()
    for name, t in small(0):
        target.register_buffer(name, torch.zeros_like(t))
    exact = {}
    for version in (0, 1):
        assert sub.receive(target, full=True) == version
        exact[version] = all(torch.equal(target.get_buffer(n), t) for n, t in small(version))
    refused = 0
    for _ in range(3 if mode == "direct" else 0):  # cached: refused before any round
        with pytest.raises(ss.SyncError):
            sub.receive(target, full=True)
        refused += 1
    assert sub.receive(target, full=True) == 5
    exact[5] = all(torch.equal(target.get_buffer(n), t) for n, t in small(5))
    sub.close()
    group.close()
    return exact, refused


@pytest.mark.parametrize("mode", ["direct", "cached"])
def test_a_streamed_publish_follows_the_layout_or_is_refused_naming_the_tensor(mode):
    out = spawn(_layouts, 3, mode, timeout=90)
    shape, order, missing = out[0]
    assert "'b3' is [1002] float32, the layout has [1003] float32" in shape, shape
    assert "'b2' was yielded out of the layout's order" in order, order
    assert "the iterator ended without ['b4'" in missing, missing
    assert out[0] == out[1]
    assert out[2] == ({0: True, 1: True, 5: True}, 3 if mode == "direct" else 0)
