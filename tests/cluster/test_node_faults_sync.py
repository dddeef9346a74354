"""Weight sync across nodes (:mod:`netns_cluster`), and a rollout node that vanishes mid-publish.

One trainer on node 0, rollouts on nodes 1 and 2. Across nodes ``auto`` picks a network
transport (the nodes share no ``/dev/shm``) and every version arrives exactly. Then node 2
has a fault while version 1 is in flight: its link cut, its processes frozen, or the node
killed whole. Over relay and broadcast, in ``direct`` mode (and ``cached``, the link cut),
the trainer's ``delivered`` and the other rollout's ``receive`` both fail naming rank 2
within 5 s of the fault (timed on the clock every namespace shares, with a group timeout of
60 s), and the next version reaches the survivor exactly, with rank 2 absent.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from netns_cluster import (
    FAULTS,
    MARKS_ENV,
    Cluster,
    Fault,
    require_namespaces,
    spawn,
    trigger,
    wait_forever,
)
from sync_procs import zeros_module

import slipstream as ss
from slipstream.errors import PeerDiedError

BUCKET = 256 * 1024
GROUP_TIMEOUT = 60.0
WITHIN = 5.0


def weights(version: int) -> dict[str, torch.Tensor]:
    """About 4 MiB over some 16 buckets, each value naming its version."""
    return {f"w{i}": torch.full((32_768,), float(100 * version + i)) for i in range(32)}


def exact(m: torch.nn.Module, version: int) -> bool:
    return all(torch.equal(m.get_buffer(n), t) for n, t in weights(version).items())


def _publish_across(rank, addr, port, transport):
    group = ss.sync.init_group(addr, port, 3, rank, timeout=GROUP_TIMEOUT)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1, 2], bucket_bytes=BUCKET, transport=transport)
        for version in (0, 1):
            assert pub.publish(weights(version)).delivered.result(timeout=60) == version
        kind = pub.transport
        pub.close()
        group.close()
        return kind
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = zeros_module(weights(0))
    held = [sub.receive(target) for _ in (0, 1)]
    out = {"received": held, "exact": exact(target, 1)}
    sub.close()
    group.close()
    return out


@pytest.mark.parametrize("transport", ["auto", "relay", "broadcast"])
def test_weights_cross_nodes_exactly_and_auto_picks_a_network_transport(transport):
    require_namespaces()
    with Cluster(3) as cluster:
        out = spawn(cluster, _publish_across, [0, 1, 2], transport)
    assert out[0] in ("relay", "broadcast"), out[0]
    if transport != "auto":
        assert out[0] == transport
    assert out[1] == out[2] == {"received": [0, 1], "exact": True}


def _vanishing_rollout(rank, addr, port, transport, mode):
    group = ss.sync.init_group(addr, port, 3, rank, timeout=GROUP_TIMEOUT)
    if rank == 0:
        pub = ss.WeightPublisher(
            group, [0], [1, 2], bucket_bytes=BUCKET, transport=transport, mode=mode
        )
        assert pub.publish(weights(0)).delivered.result(timeout=60) == 0
        with pytest.raises(PeerDiedError) as err:
            pub.publish(weights(1)).delivered.result(timeout=90)
        failed_at = time.monotonic()
        handle = pub.publish(weights(2))
        delivered = handle.delivered.result(timeout=60)
        out = {"ranks": err.value.ranks, "at": failed_at, "next": delivered}
        out["absent"] = sorted(handle.absent)
        pub.close()
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = zeros_module(weights(0))
    assert sub.receive(target) == 0
    if rank == 2:
        calls = []

        def load(batch):
            calls.append(1)
            if len(calls) == 3:  # version 1 is under way
                trigger("mid-publish")
                wait_forever()
            for name, t in batch:
                target.get_buffer(name).copy_(t)

        sub.receive(load)
    with pytest.raises(PeerDiedError) as err:
        sub.receive(target)
    failed_at = time.monotonic()
    out = {"ranks": err.value.ranks, "at": failed_at}
    out["next"] = sub.receive(target)
    out["exact"] = exact(target, 2)
    sub.close()
    group.close()
    return out


CASES = [
    (transport, mode, fault)
    for transport in ("relay", "broadcast")
    for mode in ("direct", "cached")
    for fault in FAULTS
]


@pytest.mark.parametrize(("transport", "mode", "fault"), CASES)
def test_a_rollout_node_that_vanishes_mid_publish_is_named_within_seconds(
    transport, mode, fault, tmp_path
):
    require_namespaces()
    with Cluster(3) as cluster:
        watch = Fault(str(tmp_path), "mid-publish", cluster.nodes[2], fault, survivors=[0, 1])
        try:
            out = spawn(
                cluster,
                _vanishing_rollout,
                [0, 1, 2],
                transport,
                mode,
                environ={MARKS_ENV: str(tmp_path)},
                may_die=(2,),
                timeout=150,
            )
        finally:
            watch.close()
    assert watch.at is not None, "the fault never came"
    for rank in (0, 1):
        assert out[rank]["ranks"] == [2], out[rank]
        late = out[rank]["at"] - watch.at
        case = f"{transport}, {mode}, {fault}"
        print(f"\n{case}: rank {rank} named the lost node {late:.2f} s after the fault")
        assert late < WITHIN, f"rank {rank} named the lost node {late:.1f} s after the fault"
    assert out[0]["next"] == 2 and out[0]["absent"] == [2]
    assert out[1]["next"] == 2 and out[1]["exact"]
    assert os.path.exists(tmp_path / "done-0") and os.path.exists(tmp_path / "done-1")
