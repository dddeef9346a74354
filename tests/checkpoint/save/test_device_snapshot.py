"""Saves through a device snapshot (``SaveOptions.device_snapshot``), run on CPU: the same code
as on an accelerator, with host memory as the device and no streams.

Every ordering rule of the snapshot is shown here: ``staging_completion`` resolves once the
call has gathered the state, before the drain to the host buffer; a mutation right after it
never reaches the file; a save after a save reuses both buffers; a failure in the drain
fails the save's futures and releases the snapshot; a snapshot that does not fit falls back
to staging from the state, said once. Orderings are forced with the saver's
``before_staging`` hook (with a snapshot it runs before the drain), never with sleeps.
Checkpoints are compared with the state as it was at the call, read back by ``ss.load`` and
by DCP.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import copy_state
from dist_utils import run_workers
from torch.profiler import ProfilerActivity, profile

import slipstream as ss
from slipstream import tracing
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.errors import CheckpointError

GATE_TIMEOUT = 10.0
SNAPSHOT = SaveOptions(device_snapshot=True)
KEPT = SaveOptions(device_snapshot=True, keep_device_snapshot=True)
COPY_OPS = {"aten::copy_", "aten::_foreach_copy_", "aten::_to_copy", "aten::index_copy_"}


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300_000, generator=g),
        "h": torch.randn(1000, generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 48, generator=g).t(),  # strided: copied by its own call
        "n": torch.arange(10),
        "step": 3,
        "opt": {"lr": 0.5},
    }


def _mutate(state: dict) -> None:
    for v in state.values():
        if torch.is_tensor(v):
            v.mul_(-3).add_(1)


def _assert_checkpoint_is(path, want: dict) -> None:
    """``path`` loads back as ``want`` through both ss.load and dcp.load."""
    for load in (ss.load, dcp.load):
        got = {
            k: (torch.zeros(v.shape, dtype=v.dtype) if torch.is_tensor(v) else v)
            for k, v in copy_state(want).items()
        }
        got["step"], got["opt"] = 0, {"lr": 0.0}
        load(got, checkpoint_id=path)
        for k, v in want.items():
            if torch.is_tensor(v):
                assert torch.equal(got[k], v), (load, k)
            else:
                assert got[k] == v, (load, k)


def _hold_staging(saver: CheckpointSaver) -> threading.Event:
    gate = threading.Event()

    def hold() -> None:
        if not gate.wait(GATE_TIMEOUT):
            raise TimeoutError("test gate on staging was never opened")

    saver.before_staging = hold
    return gate


@pytest.fixture
def saver():
    s = CheckpointSaver(options=SNAPSHOT)
    yield s
    s.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_staging_completes_once_gathered_and_a_mutation_right_after_never_reaches_the_file(
    tmp_path, saver
):
    state = _state()
    at_call = copy_state(state)
    gate = _hold_staging(saver)
    response = saver.save(state, tmp_path / "ck")
    # the call gathered the state: staging is complete while the drain is still held
    assert response.staging_completion.done()
    response.staging_completion.result()
    assert not response.upload_completion.done()
    assert response.timings.staged is not None
    _mutate(state)  # allowed now; the drain and the writes have not run yet
    gate.set()
    response.result(timeout=30)
    _assert_checkpoint_is(tmp_path / "ck", at_call)


@pytest.fixture
def kept():
    s = CheckpointSaver(options=KEPT)
    yield s
    s.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_by_default_the_snapshot_holds_no_device_memory_between_saves(tmp_path, saver):
    state = _state()
    wants = []
    for step in range(3):
        wants.append(copy_state(state))
        saver.save(state, tmp_path / f"ck{step}").result(timeout=30)
        assert saver.snapshot_bytes == 0, f"after save {step} the snapshot still holds memory"
        _mutate(state)
    assert saver.snapshot_allocations == 3  # one per save, each given back after its drain
    assert saver.staging_allocations == 1
    for step, want in enumerate(wants):
        _assert_checkpoint_is(tmp_path / f"ck{step}", want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_kept_snapshot_is_reused_by_the_next_save_with_the_staging_buffer(tmp_path, kept):
    state = _state()
    wants = []
    for step in range(3):
        wants.append(copy_state(state))
        kept.save(state, tmp_path / f"ck{step}").result(timeout=30)
        _mutate(state)
    assert kept.snapshot_allocations == 1
    assert kept.staging_allocations == 1
    assert kept.snapshot_bytes > sum(v.nbytes for v in state.values() if torch.is_tensor(v))
    for step, want in enumerate(wants):
        _assert_checkpoint_is(tmp_path / f"ck{step}", want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failure_in_the_drain_fails_the_save_and_releases_the_snapshot(tmp_path, kept):
    saver = kept
    state = _state()

    def fail() -> None:
        raise RuntimeError("drain broke")

    saver.before_staging = fail
    response = saver.save(state, tmp_path / "ck")
    response.staging_completion.result(timeout=30)  # the gather itself succeeded
    with pytest.raises(CheckpointError, match="drain broke"):
        response.result(timeout=30)
    assert not (tmp_path / "ck" / ".metadata").exists()
    # the snapshot was let go: the next save of the layout takes the same buffer again
    saver.before_staging = None
    want = copy_state(state)
    saver.save(state, tmp_path / "ck").result(timeout=30)
    assert saver.snapshot_allocations == 1
    _assert_checkpoint_is(tmp_path / "ck", want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_snapshot_that_does_not_fit_stages_from_the_state_and_says_so_once(tmp_path, caplog):
    state = _state()
    saver = CheckpointSaver(options=SaveOptions(device_snapshot=True, device_snapshot_bytes=4096))
    try:
        gate = _hold_staging(saver)
        with caplog.at_level(logging.DEBUG, logger="slipstream"):
            wants = []
            for step in range(2):
                wants.append(copy_state(state))
                response = saver.save(state, tmp_path / f"ck{step}")
                # staged from the state, on the staging thread: not complete before it runs
                assert not response.staging_completion.done()
                gate.set()
                response.result(timeout=30)
                gate.clear()
                _mutate(state)
        warnings = [
            r for r in caplog.records if r.levelno == logging.WARNING and "snapshot" in r.message
        ]
        assert len(warnings) == 1
        assert "device_snapshot_bytes" in warnings[0].message
        assert saver.snapshot_allocations == 0 and saver.snapshot_bytes == 0
    finally:
        saver.close()
    for step, want in enumerate(wants):
        _assert_checkpoint_is(tmp_path / f"ck{step}", want)


def test_on_cpu_saves_stage_from_the_state_unless_asked(tmp_path):
    saver = CheckpointSaver()
    try:
        gate = _hold_staging(saver)
        response = saver.save(_state(), tmp_path / "ck")
        assert not response.staging_completion.done()
        gate.set()
        response.result(timeout=30)
        assert saver.snapshot_allocations == 0
    finally:
        saver.close()


def test_a_negative_snapshot_budget_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="device_snapshot_bytes=-1"):
        SaveOptions(device_snapshot_bytes=-1)


def _optimizer_like_state(params: int) -> dict:
    """``params`` parameters with fused-AdamW-like state: 4 tensors each, two dtypes."""
    g = torch.Generator().manual_seed(1)
    state: dict = {"model": {}, "optim": {"state": {}, "lr": 1e-3}}
    for i in range(params):
        n = 64 + 7 * i
        state["model"][f"layer{i}.weight"] = torch.randn(n, generator=g).to(torch.bfloat16)
        state["optim"]["state"][i] = {
            "exp_avg": torch.randn(n, generator=g),
            "exp_avg_sq": torch.randn(n, generator=g).abs(),
            "step": torch.tensor(float(i)),
        }
    return state


def _top_level_copies(prof) -> int:
    def inside_copy(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in COPY_OPS:
                return True
            parent = parent.cpu_parent
        return False

    return sum(1 for e in prof.events() if e.name in COPY_OPS and not inside_copy(e))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_of_788_tensors_issues_at_most_8_copy_calls(tmp_path, kept):
    # a kept snapshot: framed once; one that is given back is framed again by each save
    # (one more copy call)
    saver = kept
    state = _optimizer_like_state(197)
    tensors = len(state["model"]) + sum(len(s) for s in state["optim"]["state"].values())
    assert tensors == 788
    saver.save(state, tmp_path / "warm").result(timeout=30)  # allocates and frames once
    for v in state["optim"]["state"].values():
        v["exp_avg"].add_(1)
    want = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optim": {
            "state": {
                i: {k: t.clone() for k, t in s.items()} for i, s in state["optim"]["state"].items()
            },
            "lr": 1e-3,
        },
    }
    tracing.start(tmp_path / "trace.json")
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            response = saver.save(state, tmp_path / "ck")
        response.result(timeout=30)
        drains = [e for e in tracing.trace_events() if e["name"] == "slipstream.save.drain"]
    finally:
        tracing.stop()
    gathers = _top_level_copies(prof)  # the gather runs in the call, on this thread
    assert gathers == 2  # one per dtype: float32 (the AdamW state) and bfloat16 (weights)
    assert 1 <= len(drains) <= 4
    assert gathers + len(drains) <= 8
    got = {
        "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
        "optim": {
            "state": {
                i: {k: torch.zeros_like(t) for k, t in s.items()}
                for i, s in want["optim"]["state"].items()
            },
            "lr": 0.0,
        },
    }
    ss.load(got, checkpoint_id=tmp_path / "ck")
    assert got["optim"]["lr"] == 1e-3
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, s in want["optim"]["state"].items():
        for k, t in s.items():
            assert torch.equal(got["optim"]["state"][i][k], t), (i, k)


def _replicated_and_sharded(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(5)
    full = torch.randn(64, 32, generator=g)
    state = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": [torch.randn(100, generator=g) for _ in range(6)],
        "step": 9,
    }
    state = {
        "sharded": state["sharded"],
        **{f"r{i}": t for i, t in enumerate(state["replicated"])},
        "step": 9,
    }
    saver = CheckpointSaver(options=KEPT)
    try:
        saver.save(state, f"{root}/ck").result(timeout=60)
        assert saver.snapshot_allocations == 1
    finally:
        saver.close()
    want = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    got = {k: (torch.zeros_like(v) if torch.is_tensor(v) else 0) for k, v in want.items()}
    dcp.load(got, checkpoint_id=f"{root}/ck", no_dist=True)
    for k, v in want.items():
        assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, (rank, k)
    dist.barrier()


def test_ranks_snapshot_only_the_records_they_write_and_dcp_reads_the_whole(tmp_path):
    # replicated tensors are written by one rank each: a rank's snapshot is its own image
    run_workers(_replicated_and_sharded, 2, str(tmp_path), timeout=120)
