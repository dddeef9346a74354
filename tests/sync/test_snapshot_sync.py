"""A staged snapshot (``ss.stage``) published and checkpointed: the rollout gets the staged
step, and the snapshot's buffer is not restaged while a publish still reads it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dist_utils import wait_for_key
from sync_procs import spawn
from torch import nn

import slipstream as ss
from slipstream.errors import PeerTimeoutError


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(300, 64, generator=g).to(torch.bfloat16),
            "b": torch.randn(77, generator=g),
        },
        "masters": {"w": torch.randn(300, 64, generator=g)},
        "step": 1,
    }


def _run(rank, port, root):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 1:
        target = nn.Module()
        for name, t in state()["model"].items():
            target.register_buffer(name, torch.zeros_like(t))
        with ss.WeightSubscriber(group, [0], [1]) as sub:
            # the publish is held up until then
            wait_for_key(group.store, "test/receive", 30, "the trainer's word to receive")
            assert sub.receive(target) == 1
            staged = state()["model"]
            for name, t in staged.items():
                assert torch.equal(target.get_buffer(name), t), name
        group.close()
        return "ok"
    live = state()
    snap = ss.stage(live)
    for t in live["model"].values():
        t.add_(1)  # training goes on; the snapshot keeps the staged step
    pub = ss.WeightPublisher(group, [0], [1], mode="direct")
    published: list[int] = []
    publisher = threading.Thread(
        target=lambda: published.append(pub.publish(snap["model"], version=1).wait(30))
    )
    publisher.start()
    deadline = time.monotonic() + 30
    while "publish of version 1" not in snap.readers:
        assert time.monotonic() < deadline, snap.readers
        time.sleep(0.01)
    with pytest.raises(PeerTimeoutError, match="publish of version 1"):
        ss.stage(live, timeout=0.2)  # the publish still reads the buffer
    assert not snap.expired
    group.set_json("test/receive", True)
    publisher.join(30)
    assert published == [1] and snap.readers == []
    with ss.Checkpointer(root) as ck:  # the same snapshot checkpointed after
        ck.save(1, snap).upload_completion.result(30)
        out = {"model": {k: torch.zeros_like(v) for k, v in live["model"].items()}}
        ck.load(out, 1, strict=False)
    for name, t in state()["model"].items():
        assert torch.equal(out["model"][name], t), name
    assert not ss.stage(live).expired and snap.expired
    pub.close()
    group.close()
    return "ok"


def test_a_snapshot_is_published_as_staged_and_not_restaged_while_the_publish_reads_it(tmp_path):
    assert spawn(_run, 2, str(tmp_path), timeout=90) == {0: "ok", 1: "ok"}
