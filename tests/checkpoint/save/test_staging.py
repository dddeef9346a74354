"""Staging off the caller's thread, what is safe after ``staging_completion``, backpressure.

Orderings are forced with gates (the saver's ``before_staging`` hook, or a data write
through a :class:`FaultStorage` backend, that waits on an event), never with sleeps or
timing assertions, so each test shows a structural fact.
"""

from __future__ import annotations

import threading

import pytest
import torch
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.storage import LocalStorage
from slipstream.errors import CheckpointError

GATE_TIMEOUT = 10.0


@pytest.fixture
def saver():
    s = CheckpointSaver()
    yield s
    s.close()


def _big_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(2_000_000, generator=g),
        "b": torch.randn(3, 1000, generator=g).t(),
        "step": 5,
        "meta": {"lr": 0.1},
    }


def _hold_staging(saver: CheckpointSaver) -> tuple[threading.Event, list[int]]:
    """Make ``saver``'s staging wait, before it copies anything, for the returned event;
    record the threads staging ran on."""
    gate = threading.Event()
    stagers: list[int] = []

    def hold() -> None:
        stagers.append(threading.get_ident())
        if not gate.wait(GATE_TIMEOUT):
            raise TimeoutError("test gate on staging was never opened")

    saver.before_staging = hold
    return gate, stagers


def _gated_writes(path) -> tuple[FaultStorage, threading.Event]:
    """A local backend at ``path`` whose data writes wait for the returned event."""
    storage = FaultStorage(LocalStorage(path))
    return storage, storage.faults.gate("write")


def _load_fresh(path) -> dict:
    out = {
        "w": torch.zeros(2_000_000),
        "b": torch.zeros(1000, 3),
        "step": 0,
        "meta": {"lr": 0.0},
    }
    ss.load(out, path)
    return out


def test_async_save_returns_before_any_tensor_data_is_copied(tmp_path, saver):
    # "w" is contiguous (copied by address), "b" a transposed view (copied through a view):
    # what they hold after save() returned, not what they held at the call, is saved
    gate, stagers = _hold_staging(saver)
    state = _big_state()
    response = saver.save(state, tmp_path / "ck")
    assert not response.staging_completion.done()
    assert not response.upload_completion.done()
    state["w"].mul_(-1).add_(3)
    state["b"].fill_(7)
    gate.set()
    response.upload_completion.result(60)
    assert stagers and threading.get_ident() not in stagers
    loaded = _load_fresh(tmp_path / "ck")
    assert torch.equal(loaded["w"], state["w"])
    assert torch.equal(loaded["b"], state["b"])


def test_mutating_state_right_after_staging_does_not_change_the_checkpoint(tmp_path):
    storage, gate = _gated_writes(tmp_path / "ck")
    state = _big_state()
    want_w, want_b = state["w"].clone(), state["b"].clone()
    response = ss.async_save(state, storage)
    state["step"] = 6
    state["meta"]["lr"] = 0.2
    response.staging_completion.result(60)
    state["w"].mul_(-1).add_(3)
    state["b"].zero_()
    assert not response.upload_completion.done()
    gate.set()
    response.upload_completion.result(60)
    assert storage.faults.names("write"), "the gated write path was never taken"
    loaded = _load_fresh(tmp_path / "ck")
    assert torch.equal(loaded["w"], want_w)
    assert torch.equal(loaded["b"], want_b)
    assert loaded["step"] == 5 and loaded["meta"] == {"lr": 0.1}


def test_optimizer_step_after_staging_does_not_change_the_checkpoint(tmp_path, saver):
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    response = saver.save(model.state_dict(), tmp_path / "ck")
    response.staging_completion.result(60)
    model(torch.randn(8, 512)).sum().backward()
    optim.step()
    response.upload_completion.result(60)
    loaded = {k: torch.zeros_like(v) for k, v in want.items()}
    ss.load(loaded, tmp_path / "ck")
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key
    assert not torch.equal(model.weight.detach(), want["weight"])


def test_second_save_waits_for_the_first_to_finish(tmp_path, saver):
    storage, gate = _gated_writes(tmp_path / "one")
    state = _big_state()
    first = saver.save(state, storage)
    returned = threading.Event()
    first_done_when_second_returned: list[bool] = []

    def second_save() -> None:
        response = saver.save(state, tmp_path / "two")
        first_done_when_second_returned.append(first.upload_completion.done())
        returned.set()
        response.upload_completion.result(60)

    thread = threading.Thread(target=second_save)
    thread.start()
    try:
        assert not returned.wait(0.2), "the second save started while the first was writing"
    finally:
        gate.set()
        thread.join(60)
    assert not thread.is_alive()
    assert first_done_when_second_returned == [True]
    assert storage.faults.names("write"), "the gated write path was never taken"
    assert (tmp_path / "two" / ".metadata").is_file()


def test_saves_of_the_same_layout_reuse_one_staging_buffer(tmp_path, saver):
    state = _big_state()
    for i in range(3):
        state["w"].add_(1)
        state["step"] = i
        saver.save(state, tmp_path / f"s{i}").upload_completion.result(60)
    assert saver.staging_allocations == 1
    assert torch.equal(_load_fresh(tmp_path / "s2")["w"], state["w"])
    state["extra"] = torch.ones(10)
    saver.save(state, tmp_path / "new_layout").upload_completion.result(60)
    assert saver.staging_allocations == 2


def test_tensor_resized_before_staging_fails_the_save_naming_it(tmp_path, saver):
    gate, _ = _hold_staging(saver)
    state = {"x": torch.ones(1000), "y": torch.ones(1000)}
    response = saver.save(state, tmp_path / "ck")
    state["y"].resize_(10)  # against the rule: only after staging_completion
    gate.set()
    with pytest.raises(CheckpointError, match="'y' holds 40 bytes, its record .* 4000"):
        response.staging_completion.result(60)
    with pytest.raises(CheckpointError):
        response.upload_completion.result(60)
    assert not (tmp_path / "ck" / ".metadata").exists()


def test_a_save_over_the_staging_budget_streams_within_it(tmp_path):
    """Over the budget a save is no longer refused: it streams through slots of the budget
    (tests/checkpoint/save/test_staging_budget.py has the rest)."""
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=1 << 20))
    try:
        state = _big_state()
        saver.save(state, tmp_path / "ck").upload_completion.result(60)
        assert saver.staging_peak_bytes <= 1 << 20
    finally:
        saver.close()
    got = _load_fresh(tmp_path / "ck")
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_timings_fill_in_phase_by_phase_and_both_ends_log_what_they_moved(tmp_path, caplog):
    storage, gate = _gated_writes(tmp_path / "ck")
    state = _big_state()
    with caplog.at_level("INFO", logger="slipstream"):
        response = ss.async_save(state, storage)
        timings = response.timings
        assert timings.blocked is not None and timings.durable is None
        assert timings.nbytes == (2_000_000 + 3000) * 4  # the tensors' bytes, values aside
        response.staging_completion.result(60)
        assert timings.staged is not None and timings.durable is None  # writes are gated
        gate.set()
        response.upload_completion.result(60)
        assert 0 < timings.staged <= timings.durable
        _load_fresh(tmp_path / "ck")
    saved = [r.getMessage() for r in caplog.records if "saved" in r.getMessage()]
    loaded = [r.getMessage() for r in caplog.records if "loaded" in r.getMessage()]
    assert len(saved) == 1 and str(tmp_path / "ck") in saved[0] and "durable in" in saved[0]
    assert len(loaded) == 1 and str(tmp_path / "ck") in loaded[0] and "GiB/s" in loaded[0]


def test_a_before_staging_hook_that_raises_fails_that_save_only(tmp_path):
    # the upload thread must hear of the failure at once, not wait for staging until the
    # saver's timeout: the next save, queued behind it, is bounded far below that timeout
    saver = CheckpointSaver(options=SaveOptions(timeout=300.0))
    try:

        def refuse() -> None:
            raise RuntimeError("staging refused by the hook")

        saver.before_staging = refuse
        response = saver.save(_big_state(), tmp_path / "ck")
        with pytest.raises(CheckpointError, match="staging refused by the hook"):
            response.staging_completion.result(60)
        with pytest.raises(CheckpointError, match="staging refused by the hook"):
            response.upload_completion.result(60)
        assert not (tmp_path / "ck" / ".metadata").exists()
        saver.before_staging = None
        saver.save(_big_state(), tmp_path / "next").upload_completion.result(30)
        assert torch.equal(_load_fresh(tmp_path / "next")["w"], _big_state()["w"])
    finally:
        saver.close()
