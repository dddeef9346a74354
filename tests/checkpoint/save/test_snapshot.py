"""One staged snapshot (``ss.stage``) that a checkpoint writes as it is, and its lifetime.

Orderings are forced with a gated storage backend (data writes wait for an event), never
with sleeps, as in test_staging.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_workers
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver
from slipstream.checkpoint.storage import LocalStorage
from slipstream.errors import CheckpointError, PeerTimeoutError

GATE_TIMEOUT = 10.0


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(1000, 300, generator=g).to(torch.bfloat16),
            "b": torch.randn(301, generator=g),
        },
        "optim": {"state": {"0": {"exp_avg": torch.randn(1000, 300, generator=g)}}, "lr": 0.1},
        "step": 5,
    }


def _zeros_like(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "optim": {"state": {"0": {"exp_avg": torch.zeros(1000, 300)}}, "lr": 0.0},
        "step": 0,
    }


def _clone(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optim": {
            "state": {"0": {"exp_avg": state["optim"]["state"]["0"]["exp_avg"].clone()}},
            "lr": state["optim"]["lr"],
        },
        "step": state["step"],
    }


def _assert_equal(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert torch.equal(a["optim"]["state"]["0"]["exp_avg"], b["optim"]["state"]["0"]["exp_avg"])
    assert a["optim"]["lr"] == b["optim"]["lr"] and a["step"] == b["step"]


def test_the_snapshot_holds_the_state_as_staged_with_its_structure():
    state = _state()
    before = _clone(state)
    snap = ss.stage(state)
    state["model"]["w"].add_(1)
    state["optim"]["lr"] = 0.5
    assert sorted(snap) == ["model", "optim", "step"]
    assert isinstance(snap["model"], ss.StagedState) and sorted(snap["model"]) == ["b", "w"]
    assert snap["model"]["w"].dtype == torch.bfloat16 and snap["model"]["w"].shape == (1000, 300)
    _assert_equal(
        {
            "model": dict(snap["model"]),
            "optim": {"state": {"0": dict(snap["optim"]["state"]["0"])}, "lr": snap["optim"]["lr"]},
            "step": snap["step"],
        },
        before,
    )
    assert snap.nbytes >= sum(r.nbytes for r in snap.records)


def test_a_checkpoint_of_a_snapshot_writes_its_buffer_without_copying(tmp_path):
    state = _state()
    before = _clone(state)
    snap = ss.stage(state)
    state["model"]["w"].add_(1)  # the live state moves on; the checkpoint is of the snapshot
    saver = CheckpointSaver()
    try:
        response = saver.save(snap, tmp_path / "ck")
        assert response.staging_completion.done()  # nothing to copy: staged at once
        response.upload_completion.result(GATE_TIMEOUT)
        assert saver.staging_allocations == 0 and saver.staging_bytes == 0
    finally:
        saver.close()
    with ss.Checkpointer(tmp_path / "run") as ck:  # the same through a Checkpointer
        ck.save(3, snap).upload_completion.result(GATE_TIMEOUT)
        out = _zeros_like(state)
        ck.load(out, 3)
    _assert_equal(out, before)
    reference = _zeros_like(state)
    dcp.load(reference, checkpoint_id=str(tmp_path / "ck"))  # DCP reads it as its own
    _assert_equal(reference, before)


def test_async_save_of_a_sub_dict_of_a_snapshot_copies_out_of_it(tmp_path):
    state = _state()
    snap = ss.stage(state)
    saver = CheckpointSaver()
    try:
        saver.save(snap["model"], tmp_path / "model").upload_completion.result(GATE_TIMEOUT)
        assert saver.staging_allocations == 1  # laid out otherwise: staged by copy
    finally:
        saver.close()
    ss.async_save(snap["model"], tmp_path / "again").upload_completion.result(GATE_TIMEOUT)
    for where in ("model", "again"):
        out = {k: torch.zeros_like(v) for k, v in state["model"].items()}
        ss.load(out, tmp_path / where)
        for k, v in state["model"].items():
            assert torch.equal(out[k], v)


def test_the_buffer_is_not_restaged_while_a_save_still_writes_it(tmp_path):
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))
    writes = storage.faults.gate("write")
    state = _state()
    before = _clone(state)
    saver = CheckpointSaver()
    try:
        snap = ss.stage(state)
        response = saver.save(snap, storage)
        response.staging_completion.result(GATE_TIMEOUT)
        assert snap.readers == [f"save to {storage.url}"]
        state["model"]["w"].add_(1)
        with pytest.raises(PeerTimeoutError, match="still read.*save to"):
            ss.stage(state, timeout=0.2)  # would overwrite what the save is writing
        assert not snap.expired
        restaged: list[ss.StagedState] = []
        waiter = threading.Thread(target=lambda: restaged.append(ss.stage(state)))
        waiter.start()
        writes.set()
        response.upload_completion.result(GATE_TIMEOUT)
        waiter.join(GATE_TIMEOUT)
        assert restaged and snap.expired and snap.readers == []
        out = _zeros_like(state)
        ss.load(out, storage)
        _assert_equal(out, before)  # the step staged first, not the one staged after
        with pytest.raises(CheckpointError, match="expired"):
            saver.save(snap, tmp_path / "again")
    finally:
        writes.set()
        saver.close()


def test_a_holder_that_never_lets_go_is_named(tmp_path):
    state = _state(1)
    snap = ss.stage(state)
    hold = snap.hold("publish of version 7")
    with pytest.raises(PeerTimeoutError, match="publish of version 7"):
        ss.stage(state, timeout=0.1)
    snap.release(hold)
    assert not ss.stage(state).expired and snap.expired


# -- issue 47, item a: stage() against holds and other stage() calls ----------------------


def test_a_hold_taken_as_stage_claims_the_buffer_finds_the_snapshot_expired():
    """A hold that comes in right after ``stage()`` found the buffer free must not land on
    the generation the stage is about to overwrite."""
    state = _state(2)
    snap = ss.stage(state, timeout=GATE_TIMEOUT)
    outcome: list[str] = []

    class HoldRightAfterTheWait(threading.Condition):
        """Runs another reader's hold the moment stage() leaves the lock after its wait."""

        armed = False

        def wait_for(self, predicate, timeout=None):  # type: ignore[no-untyped-def]
            found = super().wait_for(predicate, timeout)
            self.armed = True
            return found

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            super().__exit__(*exc)
            if self.armed:
                self.armed = False
                try:
                    held.append(snap.hold("a publish starting just then"))
                    outcome.append("held")
                except CheckpointError:
                    outcome.append("expired")

    held: list[int] = []
    snap._buffer.lock = HoldRightAfterTheWait()
    ss.stage(state, timeout=GATE_TIMEOUT)
    for hold in held:
        snap.release(hold)
    assert outcome == ["expired"], (
        "a hold landed on the buffer between stage()'s wait for readers and its claim: "
        "the stage then overwrote a held snapshot"
    )


def test_two_stage_calls_never_copy_into_one_buffer_at_once(monkeypatch):
    from slipstream.checkpoint.save import snapshot as snapshot_module

    state = _state(3)
    ss.stage(state, timeout=GATE_TIMEOUT)  # the buffer exists
    copying, go = threading.Event(), threading.Event()
    copy_records = snapshot_module.copy_records

    def gated(*args, **kwargs):  # type: ignore[no-untyped-def]
        copying.set()
        assert go.wait(GATE_TIMEOUT)
        return copy_records(*args, **kwargs)

    monkeypatch.setattr(snapshot_module, "copy_records", gated)
    first = threading.Thread(target=lambda: ss.stage(state, timeout=GATE_TIMEOUT))
    first.start()
    try:
        assert copying.wait(GATE_TIMEOUT)
        monkeypatch.setattr(snapshot_module, "copy_records", copy_records)
        with pytest.raises(PeerTimeoutError, match="another stage"):
            ss.stage(state, timeout=0.2)  # the first one is still copying into the buffer
    finally:
        go.set()
        first.join(GATE_TIMEOUT)
    assert not ss.stage(state, timeout=GATE_TIMEOUT).expired


def test_a_policy_and_its_ema_copy_are_staged_into_buffers_of_their_own():
    policy = _state(4)
    ema = _clone(policy)  # the same layout, other tensors
    policy_snap = ss.stage(policy, timeout=GATE_TIMEOUT)
    hold = policy_snap.hold("save of the policy")
    try:
        ema["model"]["w"].add_(1)
        ema_snap = ss.stage(ema, timeout=0.2)  # must not wait for the policy's save
        assert not policy_snap.expired and not ema_snap.expired
        assert torch.equal(policy_snap["model"]["w"], policy["model"]["w"])
        assert torch.equal(ema_snap["model"]["w"], ema["model"]["w"])
    finally:
        policy_snap.release(hold)


def _dtensor_snapshot_run(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict:
        full = torch.arange(80.0).reshape(8, 10) + step
        return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}

    live = state(1)
    snap = ss.stage(live)
    live["w"].to_local().add_(100)  # training goes on
    staged = snap["w"]
    assert isinstance(staged, DTensor) and staged.placements == live["w"].placements
    assert torch.equal(staged.to_local(), state(1)["w"].to_local())
    assert torch.equal(staged.full_tensor(), torch.arange(80.0).reshape(8, 10) + 1)
    saver = CheckpointSaver()
    try:  # every tensor sharded: each rank writes its snapshot as it is
        saver.save(snap, root).result(60)
        assert saver.staging_allocations == 0
    finally:
        saver.close()
    with ss.Checkpointer(root + "/run") as ck:
        ck.save(1, snap).result(60)
        target = state(0)
        ck.load(target, 1)
    assert torch.equal(target["w"].full_tensor(), torch.arange(80.0).reshape(8, 10) + 1)
    assert target["step"] == 1


def test_a_snapshot_of_dtensor_shards_is_checkpointed_by_every_rank(tmp_path):
    run_workers(_dtensor_snapshot_run, 2, str(tmp_path))
