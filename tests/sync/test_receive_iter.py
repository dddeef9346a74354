"""Pull-style receives and versions without numbers.

``receive_iter`` (and ``areceive_iter`` under asyncio) yields every name of every sent
tensor, tied names included, with exactly the bytes a ``torch.save`` round trip of the
published tensors gives; a tensor larger than a bucket comes whole. ``publish`` with no
version takes the next number; a repeated or lower one is refused before anything is sent
and the next publish still reaches the rollout. Closing the iterator early drains the round:
the trainer's publish fails naming the rollout, the next one reaches it."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch
from sync_procs import spawn

import slipstream as ss

BUCKET = 64 * 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    """A tied pair (one tensor under two names), small tensors and one over 3 buckets."""
    g = torch.Generator().manual_seed(version)
    emb = torch.randn(64, 32, generator=g)
    out = {"emb": emb, "head": emb}
    for i in range(6):
        out[f"b{i}"] = torch.randn(100 + i, generator=g)
    out["big"] = torch.randn(3 * BUCKET // 4 + 17, generator=g)
    return out


def reference(version: int) -> dict[str, torch.Tensor]:
    """The published tensors as ``torch.save`` round-trips them (a copy made another way)."""
    buf = io.BytesIO()
    torch.save(weights(version), buf)
    buf.seek(0)
    return torch.load(buf)


def _versions_and_iteration(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, transport=transport)
        out = {"first": pub.publish(weights(0), version=0).delivered.result(timeout=30)}
        out["none"] = pub.publish(weights(1)).delivered.result(timeout=30)
        for bad in (1, 0):
            with pytest.raises(ValueError, match=f"got {bad} after 1 .*next one, 2"):
                pub.publish(weights(9), version=bad)
        handle = pub.publish(weights(2))
        out["after_refusals"] = (handle.version, handle.delivered.result(timeout=30))
        out["explicit"] = pub.publish(weights(3), version=7).delivered.result(timeout=30)
        try:
            pub.publish(weights(4)).delivered.result(timeout=30)
        except ss.SyncError as exc:
            out["stopped"] = str(exc)
        out["next"] = pub.publish(weights(5)).delivered.result(timeout=30)
        pub.close()
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1])
    got = {}

    def pull(atomic: bool, full: bool = False) -> tuple[int | None, dict[str, torch.Tensor]]:
        items = sub.receive_iter(atomic=atomic, full=full)
        seen = {}
        while True:
            try:
                name, t = next(items)
            except StopIteration as done:
                return done.value, seen
            assert name not in seen, name
            seen[name] = t.clone()  # valid until the next item only

    async def apull() -> dict[str, torch.Tensor]:
        return {name: t.clone() async for name, t in sub.areceive_iter(full=True)}

    got[0] = pull(atomic=False, full=True)
    got[1] = pull(atomic=True, full=True)
    pulled = asyncio.run(apull())
    got[2] = (sub.version, pulled)
    got[7] = pull(atomic=False, full=True)
    items = sub.receive_iter(full=True)
    next(items)
    items.close()  # stops after one tensor: the rest is drained, the round refused
    stopped_version = sub.version
    got[9] = pull(atomic=False, full=True)
    sub.close()
    group.close()
    for v, (returned, seen) in got.items():
        if v != 2:
            assert returned == v, (v, returned)
        ref = reference({7: 3, 9: 5}.get(v, v))
        assert sorted(seen) == sorted(ref), (v, sorted(seen))
        for name, t in ref.items():
            assert seen[name].dtype == t.dtype and torch.equal(seen[name], t), (v, name)
    return {"versions": sorted(got), "async_version": got[2][0], "stopped": stopped_version}


@pytest.mark.parametrize("transport", ["relay", "shm"])
def test_receive_iter_yields_every_version_exactly_and_versions_number_themselves(transport):
    out = spawn(_versions_and_iteration, 2, transport, timeout=90)
    trainer, rollout = out[0], out[1]
    assert trainer["first"] == 0 and trainer["none"] == 1
    assert trainer["after_refusals"] == (2, 2)  # the refusals left the group healthy
    assert trainer["explicit"] == 7
    assert "rollout rank 1" in trainer["stopped"] and "consumer stopped" in trainer["stopped"]
    assert trainer["next"] == 9
    assert rollout["versions"] == [0, 1, 2, 7, 9]
    assert rollout["async_version"] == 2
    assert rollout["stopped"] is None  # it saw part of version 8: it holds no whole version
