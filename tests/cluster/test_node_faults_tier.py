"""The local tier across nodes (:mod:`netns_cluster`): replicas over the network, a lost node
recovered from its peer, and a node that vanishes mid-replication.

Three ranks, one per node, each node's local tier in a directory of its own
(``tmp_path/node<i>``: the nodes share the machine's file system, but a rank is told only
its own node's directory, so every replica goes over the network, on the tier's gloo
group, which connects on each node's own interface). Rank ``r``'s file is replicated to
rank ``r + 1`` (mod 3).

- A lost node: steps 1 and 2 commit, node 2 is killed whole and its directory deleted
  (its disk is lost). The job restarts with rank 2 on a spare node, whose directory is
  empty: ``Checkpointer.load`` takes step 2 from the local tier, rank 2's part read from
  node 0 (the durable tier holds nothing), and every tensor is the one saved.
- Mid-replication: step 1 commits. Node 2 has its fault (its link cut, its processes
  frozen, the node killed whole) while rank 1's replica of step 2 streams into it: the
  moment is marked from inside node 2 by its storage, when the first bytes of rank 1's
  file reach its writer (so rank 1 is waiting for node 2's word that it stored them).
  Each survivor's step 2 fails naming rank 2 within 5 s of the fault (the job's timeout
  is 60 s), and the survivors, regrouped without it, load step 1 exactly from their
  nodes.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fault_storage import FaultStorage
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

import slipstream as ss
from slipstream.checkpoint.storage import LocalStorage

TIMEOUT = 60.0
WITHIN = 5.0
NEVER = 10**6
"""``durable_every``: no step of these tests goes to the durable tier."""


def state(rank: int, step: int) -> dict:
    own = torch.arange(65_536, dtype=torch.float32) + 100_000 * step + rank
    return {f"own{rank}": own, "shared": torch.full((1000,), float(step))}


def blank(rank: int) -> dict:
    return {f"own{rank}": torch.zeros(65_536), "shared": torch.zeros(1000)}


def exact(got: dict, rank: int, step: int) -> bool:
    want = state(rank, step)
    return set(got) == set(want) and all(torch.equal(got[k], t) for k, t in want.items())


def checkpointer(durable: str, root) -> ss.Checkpointer:
    tier = ss.LocalTier(root=root, ranks_per_node=1, keep_last=2)
    return ss.Checkpointer(
        durable, timeout=TIMEOUT, local_tier=tier, durable_every=NEVER, keep_last=2
    )


def join(rank: int, addr: str, port: int, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )  # fmt: skip


def step_files(root: str, step: int) -> set[str]:
    return set(os.listdir(os.path.join(root, f"step_{step}")))


# -- a lost node, recovered from its peer -------------------------------------------------


def _save_then_lose_node_2(rank, addr, port, roots, durable):
    join(rank, addr, port, 3)
    ck = checkpointer(durable, roots[rank])
    for step in (1, 2):
        ck.save(step, state(rank, step)).result(TIMEOUT)
    dist.barrier()  # every node's step 2 is committed
    if rank == 2:
        trigger("node-lost")
        wait_forever()
    ck.close()
    dist.destroy_process_group()
    return {"saved": 2}


def _recover_on_a_spare_node(rank, addr, port, roots, durable):
    join(rank, addr, port + 1, 3)
    with checkpointer(durable, roots[rank]) as ck:
        latest = ck.latest()
        got = blank(rank)
        loaded = ck.load(got, strict=False)
        out = {"latest": latest, "loaded": loaded, "tier": ck.last_load_tier}
        out["exact"] = exact(got, rank, loaded)
    dist.destroy_process_group()
    return out


def test_a_lost_node_recovers_its_part_from_its_peer_node_exactly(tmp_path):
    require_namespaces()
    durable = str(tmp_path / "durable")
    roots = [str(tmp_path / f"node{i}") for i in range(4)]
    with Cluster(4) as cluster:
        watch = Fault(str(tmp_path), "node-lost", cluster.nodes[2], "kill", survivors=[0, 1])
        try:
            saved = spawn(
                cluster, _save_then_lose_node_2, [0, 1, 2], roots[:3], durable,
                environ={MARKS_ENV: str(tmp_path)}, may_die=(2,), timeout=120,
            )  # fmt: skip
        finally:
            watch.close()
        assert watch.at is not None and 2 not in saved, "node 2 was not killed"
        assert saved == {0: {"saved": 2}, 1: {"saved": 2}}, saved
        # each node holds its own file of step 2 and its predecessor's replica, which only
        # the network can have brought there
        for node in range(3):
            files = step_files(roots[node], 2)
            assert {f"__{node}_0.distcp", f"__{(node - 1) % 3}_0.distcp"} <= files, files
            assert f"__{(node + 1) % 3}_0.distcp" not in files, files
        shutil.rmtree(roots[2])  # node 2's disk is lost with it
        placement = [0, 1, 3]
        out = spawn(
            cluster, _recover_on_a_spare_node, placement,
            [roots[n] for n in placement], durable,
            timeout=120,
        )  # fmt: skip
    assert not [n for n in os.listdir(durable) if n.startswith("step_")]
    for rank in range(3):
        assert out[rank] == {"latest": 2, "loaded": 2, "tier": "local", "exact": True}, (
            rank,
            out[rank],
        )


# -- a node that vanishes mid-replication -------------------------------------------------


def _vanishing_mid_replication(rank, addr, port, roots, durable):
    join(rank, addr, port, 3)
    root = roots[rank]
    streaming = threading.Event()
    if rank == 2:
        # rank 2 holds rank 1's replica: its fault comes as that replica of step 2 lands
        root = FaultStorage(LocalStorage(roots[rank], direct_io=False))

        def vanish(*_):
            trigger("mid-replication")
            wait_forever()

        root.faults.hook(
            "append", vanish, when=lambda name: streaming.is_set() and name == "__1_0.distcp"
        )
    ck = checkpointer(durable, root)
    ck.save(1, state(rank, 1)).result(TIMEOUT)
    streaming.set()
    response = ck.save(2, state(rank, 2))
    if rank == 2:
        wait_forever()
    with pytest.raises(ss.PeerDiedError) as err:
        response.result(TIMEOUT)
    failed_at = time.monotonic()
    ck.close()
    dist.destroy_process_group()
    join(rank, addr, port + 1, 2)  # the survivors restart as a job of two
    with checkpointer(durable, roots[rank]) as ck:
        got = blank(rank)
        loaded = ck.load(got, strict=False)
        kept = {"loaded": loaded, "tier": ck.last_load_tier, "exact": exact(got, rank, loaded)}
    dist.destroy_process_group()
    return {"at": failed_at, "ranks": err.value.ranks, "message": str(err.value), "kept": kept}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_node_that_vanishes_mid_replication_is_named_within_seconds(fault, tmp_path):
    require_namespaces()
    durable = str(tmp_path / "durable")
    roots = [str(tmp_path / f"node{i}") for i in range(3)]
    with Cluster(3) as cluster:
        watch = Fault(str(tmp_path), "mid-replication", cluster.nodes[2], fault, survivors=[0, 1])
        try:
            out = spawn(
                cluster, _vanishing_mid_replication, [0, 1, 2], roots, durable,
                environ={MARKS_ENV: str(tmp_path)}, may_die=(2,), timeout=150,
            )  # fmt: skip
        finally:
            watch.close()
    assert watch.at is not None, "the fault never came"
    for rank in (0, 1):
        late = out[rank]["at"] - watch.at
        print(f"\n{fault}: rank {rank} named the lost node {late:.2f} s after the fault")
        assert out[rank]["ranks"] == [2], out[rank]
        assert "rank(s) [2] of node 2" in out[rank]["message"], out[rank]
        assert late < WITHIN, f"rank {rank} named the lost node {late:.1f} s after the fault"
        assert out[rank]["kept"] == {"loaded": 1, "tier": "local", "exact": True}, out[rank]
