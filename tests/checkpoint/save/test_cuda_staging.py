"""Checkpoints of state on a CUDA device: pinned staging on a side stream that waits for the
caller's queued work, and loads into device tensors, both ways with DCP.

Skipped without a CUDA device (CI has none); README.md's Development section says how to run
them on one. Orderings are shown with ``torch.cuda._sleep``, a kernel that spins on the
caller's stream: work queued behind it is still pending when the saver acts, so a saver that
did not wait for it would stage stale values.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPIN_CYCLES = 500_000_000  # about a third of a second on a current GPU


def _state(device: str = "cuda") -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1024, 1024, generator=g).to(device),
        "h": torch.randn(3000, generator=g).to(device=device, dtype=torch.bfloat16),
        "t": torch.randn(64, 48, generator=g).to(device).t(),
        "big": torch.randn(5_000_000, generator=g).to(device),  # crosses pinned read slots
        "step": 7,
    }


def _zeros_like(state: dict, device: str) -> dict:
    return {
        k: (torch.zeros(v.shape, dtype=v.dtype, device=device) if torch.is_tensor(v) else 0)
        for k, v in state.items()
    }


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if torch.is_tensor(v):
            assert torch.equal(got[k].cpu(), v.cpu()), k
        else:
            assert got[k] == v, k


def test_save_stages_what_queued_kernels_write_without_waiting_for_them(tmp_path):
    state = _state()
    want = {k: (v + 1 if torch.is_tensor(v) else v) for k, v in state.items()}
    saver = CheckpointSaver()
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        for v in state.values():
            if torch.is_tensor(v):
                v.add_(1)  # queued behind the spin
        resp = saver.save(state, tmp_path / "ck")
        # save() returned while the spin and the writes behind it were still queued
        assert not torch.cuda.current_stream().query()
        resp.staging_completion.result(timeout=30)
        for v in state.values():
            if torch.is_tensor(v):
                v.mul_(-3)  # allowed once staging is complete; must not reach the file
        resp.result(timeout=30)
        assert saver.staging_pinned
        saver.save(state, tmp_path / "ck2").result(timeout=30)
        assert saver.staging_allocations == 1  # the second save reused the pinned buffer
    finally:
        saver.close()
    got = _zeros_like(state, "cpu")
    ss.load(got, checkpoint_id=tmp_path / "ck")
    _assert_same(got, want)


def test_loads_into_device_tensors_both_ways_with_dcp(tmp_path):
    state = _state()
    ss.save(state, checkpoint_id=tmp_path / "ss")
    dcp.save(state, checkpoint_id=tmp_path / "dcp")
    for path, load in [
        (tmp_path / "ss", ss.load),
        (tmp_path / "ss", dcp.load),
        (tmp_path / "dcp", ss.load),
    ]:
        got = _zeros_like(state, "cuda")
        got["t"] = torch.zeros(64, 48, device="cuda").t()  # a strided destination too
        load(got, checkpoint_id=path)
        assert all(v.is_cuda for v in got.values() if torch.is_tensor(v)), path
        _assert_same(got, state)


def test_load_lands_after_writes_queued_on_the_destination(tmp_path):
    state = _state()
    ss.save(state, checkpoint_id=tmp_path / "ck")
    got = _zeros_like(state, "cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    for v in got.values():
        if torch.is_tensor(v):
            v.fill_(5)  # queued behind the spin, before the load
    ss.load(got, checkpoint_id=tmp_path / "ck")
    _assert_same(got, state)


def test_pinned_staging_buffers_are_page_aligned_at_any_size():
    from slipstream.core.buffers import PAGE_BYTES, allocate_host

    for nbytes in (1 << 24, (1 << 24) + 12345):  # a power of two asks for no page more
        buf = allocate_host(nbytes, pin=True)
        assert buf.is_pinned() and buf.numel() == nbytes
        assert buf.data_ptr() % PAGE_BYTES == 0
        assert int(buf.sum()) == 0


def test_device_snapshot_completes_staging_at_the_call_and_keeps_host_tensors_of_then(tmp_path):
    # a non-fused AdamW keeps its step counters on the host: they are copied in the call too
    state = _state()
    state["cpu_step"] = torch.tensor(4.0)
    want = {k: (v + 1 if torch.is_tensor(v) else v) for k, v in state.items()}
    saver = CheckpointSaver(options=SaveOptions(keep_device_snapshot=True))
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        for v in state.values():
            if torch.is_tensor(v):
                v.add_(1)  # device ones queued behind the spin
        resp = saver.save(state, tmp_path / "ck")
        assert resp.staging_completion.done()  # the gather is queued, the stream ordered
        assert not torch.cuda.current_stream().query()
        for v in state.values():
            if torch.is_tensor(v):
                v.mul_(-3)  # queued after the gather (on the host: after its copy)
        resp.result(timeout=30)
        saver.save(state, tmp_path / "ck2").result(timeout=30)
        assert saver.snapshot_allocations == 1 and saver.staging_allocations == 1
        assert saver.staging_pinned
    finally:
        saver.close()
    got = _zeros_like(state, "cpu")
    ss.load(got, checkpoint_id=tmp_path / "ck")
    _assert_same(got, want)


def test_a_device_snapshot_over_its_budget_stages_from_the_state(tmp_path):
    state = _state()
    saver = CheckpointSaver(options=SaveOptions(device_snapshot_bytes=1024))
    try:
        saver.save(state, tmp_path / "ck").result(timeout=30)
        assert saver.snapshot_allocations == 0 and saver.staging_allocations == 1
    finally:
        saver.close()
    got = _zeros_like(state, "cpu")
    ss.load(got, checkpoint_id=tmp_path / "ck")
    _assert_same(got, state)


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_save_over_the_staging_budget_streams_through_pinned_slots(tmp_path, snapshot):
    """Over ``staging_budget_bytes`` a save streams into pinned slots of the budget: with a
    device snapshot (device memory, not the budget's) drained part by part, or without one
    from the device tensors (strided and split across parts); either way it stages what
    queued kernels write."""
    budget = 1 << 20
    state = _state()
    options = SaveOptions(staging_budget_bytes=budget, device_snapshot=snapshot)
    saver = CheckpointSaver(options=options)
    try:
        torch.cuda._sleep(SPIN_CYCLES)
        state["big"].add_(1)  # queued behind the spin: the saver must stage it
        want = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
        saver.save(state, tmp_path / "ck").result(timeout=60)
        assert saver.snapshot_allocations == int(snapshot)
        assert saver.staging_pinned is True
        assert saver.staging_peak_bytes <= budget
    finally:
        saver.close()
    got = _zeros_like(state, "cpu")
    ss.load(got, checkpoint_id=tmp_path / "ck")
    _assert_same(got, want)
    by_dcp = _zeros_like(state, "cuda")
    dcp.load(by_dcp, checkpoint_id=str(tmp_path / "ck"))
    _assert_same(by_dcp, want)
