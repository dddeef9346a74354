"""Two-tier checkpoints on 4 gloo ranks standing in for 2 nodes of 2 (``ranks_per_node=2``),
each simulated node with a local-tier directory of its own (the tests' ``/dev/shm``).

Training is a small deterministic regression per rank (data seeded by rank and step, SGD
with momentum) plus a tensor every rank holds alike (saved once, by one rank, so loading
it needs another rank's file). The reference is the same training run uninterrupted in
the test process; resumed runs must equal it bit for bit.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import threading

import pytest
import torch
from dist_utils import run_workers
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint.load.contents import read_all
from slipstream.checkpoint.storage import LocalStorage

WORLD = 4
RANKS_PER_NODE = 2
TIMEOUT = 30.0
DIM = 64


def initial_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    mine = {
        "w": torch.randn(DIM, DIM, generator=g),
        "b": torch.zeros(DIM),
        "mom_w": torch.zeros(DIM, DIM),
        "mom_b": torch.zeros(DIM),
    }
    return {f"rank{rank}": mine, "shared": torch.zeros(256), "step": 0}


def train_step(state: dict, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100_003 * rank + step)
    x = torch.randn(32, DIM, generator=g)
    y = torch.randn(32, DIM, generator=g)
    p = state[f"rank{rank}"]
    err = x @ p["w"].T + p["b"] - y
    p["mom_w"].mul_(0.9).add_(2 * err.T @ x / len(x))
    p["mom_b"].mul_(0.9).add_(2 * err.mean(0))
    p["w"].sub_(0.01 * p["mom_w"])
    p["b"].sub_(0.01 * p["mom_b"])
    state["shared"].add_(torch.sin(torch.arange(256, dtype=torch.float32) * step))
    state["step"] = step


def reference(rank: int, steps: int) -> dict:
    state = initial_state(rank)
    for step in range(1, steps + 1):
        train_step(state, rank, step)
    return state


def assert_same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    assert torch.equal(got["shared"], want["shared"])
    (key,) = [k for k in want if k.startswith("rank")]
    for name, tensor in want[key].items():
        assert torch.equal(got[key][name], tensor), (key, name)


def node_dir(base: str, rank: int) -> str:
    return os.path.join(base, f"node{rank // RANKS_PER_NODE}")


def local_steps(base: str, node: int) -> list[str]:
    """The step directories of a node's local tier (beside them: its key, .tier_key)."""
    return sorted(n for n in os.listdir(os.path.join(base, f"node{node}")) if n.startswith("step_"))


def checkpointer(base: str, rank: int, durable=None, local_root=None, **kw) -> ss.Checkpointer:
    tier = ss.LocalTier(
        root=local_root or node_dir(base, rank),
        ranks_per_node=RANKS_PER_NODE,
        keep_last=2,
    )
    return ss.Checkpointer(
        durable or os.path.join(base, "durable"),
        keep_last=2,
        timeout=TIMEOUT,
        local_tier=tier,
        durable_every=5,
        **kw,
    )


def die_with_node(base: str, rank: int) -> None:
    """This rank's node is lost: its local directory goes, then the process."""
    shutil.rmtree(node_dir(base, rank), ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)


# -- the main scenario: a node lost mid-run, the job restarted from peer replicas ---------

KILL_AFTER = 8
TOTAL = 12


def _run_until_node_lost(rank: int, world: int, base: str) -> None:
    state = initial_state(rank)
    ck = checkpointer(base, rank)
    for step in range(1, KILL_AFTER + 1):
        train_step(state, rank, step)
        ck.save(step, state).staging_completion.result(TIMEOUT)
    ck.wait(TIMEOUT)  # step 8 is committed in the local tier (5 in the durable one)
    if rank >= RANKS_PER_NODE:
        train_step(state, rank, KILL_AFTER + 1)
        die_with_node(base, rank)
    train_step(state, rank, KILL_AFTER + 1)
    response = ck.save(KILL_AFTER + 1, state)
    with pytest.raises(ss.PeerDiedError) as info:
        response.result(TIMEOUT)
    # every survivor names both dead ranks, their node and its directory, never its own
    lost = f"{node_dir(base, 2)}/step_{KILL_AFTER + 1}"
    assert info.value.ranks == [2, 3], str(info.value)
    assert f"rank(s) [2, 3] of node 1 ({lost}) died" in str(info.value), str(info.value)
    assert node_dir(base, 0) not in str(info.value), str(info.value)
    ck.close()


def _resume(rank: int, world: int, base: str) -> None:
    durable = FaultStorage(LocalStorage(os.path.join(base, "durable")))
    ck = checkpointer(base, rank, durable=durable)
    with ck:
        assert ck.steps() == [5]  # the durable tier's latest
        assert ck.latest() == KILL_AFTER
        state = initial_state(rank)
        assert ck.load(state, strict=False) == KILL_AFTER
        assert ck.last_load_tier == "local"
        read = [op for op, _, _ in durable.faults.calls if op in ("get", "read", "size", "open")]
        assert read == [], f"the durable tier was read: {read}"
        for step in range(KILL_AFTER + 1, TOTAL + 1):
            train_step(state, rank, step)
            ck.save(step, state).staging_completion.result(TIMEOUT)
        ck.wait(TIMEOUT)
    torch.save(state, os.path.join(base, f"final{rank}.pt"))


def test_a_lost_node_resumes_from_peer_replicas_bit_for_bit_without_the_durable_tier(tmp_path):
    base = str(tmp_path)
    run_workers(_run_until_node_lost, WORLD, base, timeout=90, killed=(2, 3))
    assert not os.path.exists(node_dir(base, 2))
    # one format in both tiers: node 0's step 8 (its files and node 1's replicas) is a
    # checkpoint the ordinary reader takes as it is
    flat = read_all(os.path.join(base, "node0", f"step_{KILL_AFTER}"))
    assert flat["step"] == KILL_AFTER
    for rank in range(WORLD):
        want = reference(rank, KILL_AFTER)
        assert torch.equal(flat["shared"], want["shared"])
        for name, tensor in want[f"rank{rank}"].items():
            assert torch.equal(flat[f"rank{rank}.{name}"], tensor), (rank, name)
    run_workers(_resume, WORLD, base, timeout=60)
    for rank in range(WORLD):
        got = torch.load(os.path.join(base, f"final{rank}.pt"), weights_only=True)
        assert_same(got, reference(rank, TOTAL))
    # per-tier retention: 2 local steps per node, 2 durable steps
    durable = [n for n in os.listdir(os.path.join(base, "durable")) if n.startswith("step_")]
    assert sorted(durable) == ["step_10", "step_5"]
    for node in (0, 1):
        assert local_steps(base, node) == ["step_11", "step_12"]


# -- faults -------------------------------------------------------------------------------


def _lost_during_replication(rank: int, world: int, base: str) -> None:
    state = initial_state(rank)
    ck = checkpointer(base, rank)
    if rank >= RANKS_PER_NODE:
        assert ck.local_tier is not None
        ck.local_tier.before_replication = lambda step: step == 3 and die_with_node(base, rank)
    for step in (1, 2):
        train_step(state, rank, step)
        ck.save(step, state).result(TIMEOUT)
    train_step(state, rank, 3)
    failed = ck.save(3, state)
    with pytest.raises(ss.PeerDiedError) as info:
        failed.result(TIMEOUT)
    assert "local step 3 was not committed" in str(info.value), str(info.value)
    assert info.value.ranks == [2, 3], str(info.value)
    # training goes on: the next saves fail at once, naming the dead, and never raise
    for step in (4, 6):
        train_step(state, rank, step)
        response = ck.save(step, state)
        with pytest.raises(ss.PeerDiedError, match=r"rank\(s\) \[2, 3\] of node 1 \(.*\) died"):
            response.result(2)
    ck.close()


def _restart_and_check(rank: int, world: int, base: str, step: int) -> None:
    with checkpointer(base, rank) as ck:
        state = initial_state(rank)
        assert ck.load(state, strict=False) == step
        assert ck.last_load_tier == "local"
        assert_same(state, reference(rank, step))


def test_a_node_lost_mid_replication_leaves_the_previous_step_recoverable(tmp_path):
    base = str(tmp_path)
    run_workers(_lost_during_replication, WORLD, base, timeout=90, killed=(2, 3))
    # node 0 holds its own files of step 3, never committed: they are not read
    assert os.path.isdir(os.path.join(base, "node0", "step_3"))
    run_workers(_restart_and_check, WORLD, base, 2, timeout=60)


def _peer_dies_receiving(rank: int, world: int, base: str) -> None:
    state = initial_state(rank)
    root = FaultStorage(LocalStorage(node_dir(base, rank), direct_io=False))
    ck = checkpointer(base, rank, local_root=root)
    dying = threading.Event()
    if rank == 3:
        # rank 3 holds rank 1's replica: it dies while that replica streams in
        root.faults.hook(
            "append",
            lambda *a: os.kill(os.getpid(), signal.SIGKILL),
            when=lambda name: dying.is_set() and name == "__1_0.distcp",
        )
    for step in (1, 2):
        train_step(state, rank, step)
        ck.save(step, state).result(TIMEOUT)
    dying.set()
    train_step(state, rank, 3)
    with pytest.raises(ss.PeerDiedError) as info:
        ck.save(3, state).result(TIMEOUT)
    assert info.value.ranks == [3], str(info.value)
    # named by the connection that dropped (rank 1 was sending it a replica), not by
    # waiting out the heartbeats
    assert "rank 3: seen gone by rank 1: rank 1 lost its connection to rank 3" in str(info.value), (
        str(info.value)
    )
    assert "no heartbeat" not in str(info.value), str(info.value)
    ck.close()


def test_a_peer_dying_during_replication_fails_the_step_naming_it(tmp_path):
    base = str(tmp_path)
    run_workers(_peer_dies_receiving, WORLD, base, timeout=90, killed=(3,))
    run_workers(_restart_and_check, WORLD, base, 2, timeout=60)


def save_steps(rank: int, world: int, base: str, steps: int) -> None:
    state = initial_state(rank)
    with checkpointer(base, rank) as ck:
        for step in range(1, steps + 1):
            train_step(state, rank, step)
            ck.save(step, state).result(TIMEOUT)


class Warnings(logging.Handler):
    """The warnings logged in a worker, by message."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_refused(rank: int, world: int, base: str) -> None:
    records = Warnings()
    logging.getLogger("slipstream").addHandler(records)
    with checkpointer(base, rank) as ck:
        state = initial_state(rank)
        # step 2 fails on rank 2, so every rank falls back to step 1, bit-exact
        assert ck.load(state, strict=False) == 1
        assert ck.last_load_tier == "local"
        assert_same(state, reference(rank, 1))
    if rank == 2:  # its file came from node 0 (rank 0 holds its replica) and failed its checksums
        refused = [m for m in records.messages if "could not load local step 2" in m]
        assert refused, records.messages
        assert "CorruptCheckpointError" in refused[0], refused
        assert "step_2/__2_0.distcp from rank 0 (node 0)" in refused[0], refused


def test_a_corrupt_replica_is_refused_naming_the_peer_and_the_job_falls_back_a_step(tmp_path):
    base = str(tmp_path)
    run_workers(save_steps, WORLD, base, 2, timeout=60)
    shutil.rmtree(node_dir(base, 2))  # node 1 lost: rank 2's file is read from node 0
    step = os.path.join(base, "node0", "step_2")
    with open(os.path.join(step, ".slipstream.json")) as f:
        entry = json.load(f)["records"]["__2_0.distcp"]["rank2.w@0,0"]
    with open(os.path.join(step, "__2_0.distcp"), "r+b") as f:  # a bit of rank 2's tensor
        f.seek(entry["data_offset"] + 100)
        byte = f.read(1)
        f.seek(entry["data_offset"] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    run_workers(_load_refused, WORLD, base, timeout=60)


def _full_shm(rank: int, world: int, base: str) -> None:
    state = initial_state(rank)
    root = FaultStorage(LocalStorage(node_dir(base, rank), direct_io=False))
    full = threading.Event()
    if rank == 1:
        no_space = OSError(errno.ENOSPC, "No space left on device")
        root.faults.fail("write", no_space, when=lambda name: full.is_set())
        root.faults.fail("append", no_space, when=lambda name: full.is_set())
    ck = checkpointer(base, rank, local_root=root)
    with ck:
        for step in range(1, 5):
            train_step(state, rank, step)
            full.set() if step == 3 else full.clear()
            response = ck.save(step, state)
            if step == 3:
                with pytest.raises(ss.CheckpointError, match="No space left on device") as info:
                    response.result(TIMEOUT)
                where = node_dir(base, rank) if rank == 1 else "rank 1"
                assert where in str(info.value), str(info.value)
                earlier = initial_state(rank)
                assert (
                    ck.load(earlier, step=2, strict=False) == 2
                )  # the previous step is still there
                assert_same(earlier, reference(rank, 2))
            else:
                response.result(TIMEOUT)
        assert ck.latest() == 4
        loaded = initial_state(rank)
        assert ck.load(loaded, strict=False) == 4 and ck.last_load_tier == "local"
        assert_same(loaded, reference(rank, 4))


def test_a_full_local_tier_fails_the_step_clearly_and_training_goes_on(tmp_path):
    run_workers(_full_shm, WORLD, str(tmp_path), timeout=60)


# -- pipelining: the next step is written while the previous one replicates ---------------


def _next_step_while_replicating(rank: int, world: int, base: str) -> None:
    state = initial_state(rank)
    released = threading.Event()

    def hold(step: int) -> None:
        if step == 2 and not released.wait(TIMEOUT):
            raise RuntimeError("step 3's save never started while step 2 replicated")

    with checkpointer(base, rank) as ck:
        assert ck.local_tier is not None
        ck.local_tier.before_replication = hold
        for step in (1, 2):
            train_step(state, rank, step)
            last = ck.save(step, state)
            last.staging_completion.result(TIMEOUT)
        train_step(state, rank, 3)
        third = ck.save(3, state)  # returns while step 2 is held mid-replication
        third.staging_completion.result(TIMEOUT)
        assert not last.upload_completion.done()
        released.set()
        last.result(TIMEOUT)  # the clear before step 3 spared step 2
        third.result(TIMEOUT)
        loaded = initial_state(rank)
        assert ck.load(loaded, strict=False) == 3 and ck.last_load_tier == "local"
        assert_same(loaded, reference(rank, 3))


def test_the_next_step_saves_while_the_previous_one_replicates_and_both_commit(tmp_path):
    base = str(tmp_path)
    run_workers(_next_step_while_replicating, WORLD, base, timeout=60)
    for node in (0, 1):
        assert local_steps(base, node) == ["step_2", "step_3"]
    # node 0 alone holds all of step 2 (its files and node 1's replicas), as the reader sees it
    flat = read_all(os.path.join(base, "node0", "step_2"))
    for rank in range(WORLD):
        want = reference(rank, 2)
        assert flat["step"] == 2 and torch.equal(flat["shared"], want["shared"])
        for name, tensor in want[f"rank{rank}"].items():
            assert torch.equal(flat[f"rank{rank}.{name}"], tensor), (rank, name)


# -- a staging budget ---------------------------------------------------------------------

BUDGET_STEPS = 6


def _budgeted(rank: int, world: int, base: str) -> None:
    budget = ss.SaveOptions(staging_budget_bytes=16 * 1024)  # 4 KiB parts: every save streams
    state = initial_state(rank)
    with checkpointer(base, rank, options=budget) as ck:
        for step in range(1, BUDGET_STEPS + 1):
            train_step(state, rank, step)
            ck.save(step, state).result(TIMEOUT)
    with checkpointer(base, rank, options=budget) as ck:
        fresh = initial_state(rank)
        assert ck.load(fresh, strict=False) == BUDGET_STEPS
        assert ck.last_load_tier == "local"
    assert_same(fresh, reference(rank, BUDGET_STEPS))


def test_both_tiers_stream_saves_over_the_staging_budget_and_load_back(tmp_path):
    """``staging_budget_bytes`` reaches both tiers' savers: every step streams (the local
    tier's, replicated to the peer node, and step 5's durable one) and both read back."""
    base = str(tmp_path)
    run_workers(_budgeted, WORLD, base, timeout=90)
    durable = read_all(os.path.join(base, "durable", "step_5"))
    for node in (0, 1):
        assert local_steps(base, node) == ["step_5", "step_6"]
    for rank in range(WORLD):
        want = reference(rank, 5)
        assert torch.equal(durable["shared"], want["shared"])
        for name, tensor in want[f"rank{rank}"].items():
            assert torch.equal(durable[f"rank{rank}.{name}"], tensor), (rank, name)
