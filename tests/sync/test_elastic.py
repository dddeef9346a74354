"""Rollouts that join and leave one channel: ``WeightPublisher.set_rollouts``.

One trainer publishes in ``cached`` mode to rollout sets 2 -> 4 -> 1 -> 3 on one publisher
(one channel throughout). The group is built by the trainer and the first two rollouts
(world size 3); ranks 3 and 4 join it after the first publish, past that world size. A
joining rank refetches the version in the trainer's cache at once, without a publish; every
rollout of every update holds exactly that update's weights (computed by the rollout itself
from the version number), and a rollout left out keeps the last version it received. The
trainer keeps its cache and delta base: the update whose one rollout held the previous
version in place goes as deltas, while an update with a rollout new to that base goes dense.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from sync_procs import spawn
from torch import nn

import slipstream as ss
from slipstream.sync.group import STORE_PREFIX

SETS = [[1, 2], [1, 2, 3, 4], [3], [3, 1, 4]]
FIRST_WORLD = 3
WORLD = 5
NUMEL = 16 * 1024
TIMEOUT = 60.0


def weights(version: int) -> dict[str, torch.Tensor]:
    """Each version changes one word in 64 of every tensor (deltas pay)."""
    out = {}
    for i in range(4):
        w = torch.arange(NUMEL, dtype=torch.float32) * 1e-3 + i
        w[version % 64 :: 64] += version + 1
        out[f"layer{i}.weight"] = w
    return out


def _trainer(group):
    pub = ss.WeightPublisher(
        group, [0], SETS[0], bucket_bytes=64 * 1024, mode="cached", channel="weights"
    )
    sent = []
    for u, rollouts in enumerate(SETS):
        if u:
            pub.set_rollouts(rollouts)
        if u == 1:  # the new ranks refetch version 0 from the cache before version 1 exists
            for r in (3, 4):
                group.get_json(f"test/refetched/{r}", r, f"rank {r}'s refetch", TIMEOUT)
        handle = pub.publish(weights(u), version=u)
        assert handle.delivered.result(timeout=TIMEOUT) == u
        sent.append((handle.timings.nbytes, handle.timings.dense_bytes, sorted(pub.rollout_ranks)))
        if u == 0:
            group.set_json("test/grow", True)
    out = {"sent": sent, "channel": pub.channel, "world": group.world_size}
    for r in range(1, WORLD):
        group.get_json(f"test/done/{r}", r, f"rank {r} to finish", TIMEOUT)
    pub.close()
    return out


def _rollout(rank, group):
    sub = ss.WeightSubscriber(group, [0], [rank], channel="weights")
    target = nn.Module()
    for name, t in weights(0).items():
        target.register_buffer(name.replace(".", "_"), torch.zeros_like(t))
    name_map = {n: n.replace(".", "_") for n in weights(0)}

    def holds(version: int) -> bool:
        return all(
            torch.equal(target.get_buffer(name_map[n]), t) for n, t in weights(version).items()
        )

    seen = []
    if rank >= FIRST_WORLD:
        version = sub.refetch(target, name_map=name_map)
        seen.append(("refetch", version, holds(version)))
        group.set_json(f"test/refetched/{rank}", True)
    for u, rollouts in enumerate(SETS):
        if rank >= FIRST_WORLD and u == 0:
            continue  # it had not joined yet
        if rank not in rollouts:
            seen.append(("left out", u, sub.version is not None and holds(sub.version)))
            continue
        version = sub.receive(target, name_map=name_map)
        seen.append(("received", version, holds(version)))
    group.set_json(f"test/done/{rank}", True)
    sub.close()
    return seen


def _run(rank, port):
    if rank >= FIRST_WORLD:  # joins after the first publish, past the first world size
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT)
        )
        dist.PrefixStore(STORE_PREFIX, store).wait(["test/grow"])  # as the group keys it
        group = ss.sync.init_group("127.0.0.1", port, WORLD, rank, timeout=TIMEOUT)
    else:
        group = ss.sync.init_group("127.0.0.1", port, FIRST_WORLD, rank, timeout=TIMEOUT)
    out = _trainer(group) if rank == 0 else _rollout(rank, group)
    group.close()
    return out


def test_rollouts_join_past_the_world_size_leave_and_come_back_on_one_channel():
    out = spawn(_run, WORLD, timeout=180)
    trainer = out[0]
    assert trainer["world"] == FIRST_WORLD  # the trainer's group never was rebuilt
    assert trainer["channel"] == "weights"
    assert [members for _, _, members in trainer["sent"]] == [sorted(s) for s in SETS]
    (n0, d0, _), (n1, d1, _), (n2, d2, _), (n3, d3, _) = trainer["sent"]
    assert n0 == d0 and n1 == d1  # the first version; then ranks 3 and 4 hold no base
    assert n2 < d2 / 4, trainer["sent"]  # rank 3 stayed: it holds the base, deltas go
    assert n3 == d3  # ranks 1 and 4 missed version 2: dense
    assert out[1] == [("received", 0, True), ("received", 1, True), ("left out", 2, True)] + [
        ("received", 3, True)
    ]
    assert out[2] == [("received", 0, True), ("received", 1, True)] + [
        ("left out", u, True) for u in (2, 3)
    ]
    assert out[3] == [("refetch", 0, True)] + [("received", v, True) for v in (1, 2, 3)]
    assert out[4] == [("refetch", 0, True), ("received", 1, True), ("left out", 2, True)] + [
        ("received", 3, True)
    ]
