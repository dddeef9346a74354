"""Round trips of every kind of value a state dict holds, checked two ways.

Each saved checkpoint is loaded back with ``ss.load`` and compared with the original, and
read again by DCP's own loader (``dcp.load``) as an independent reference.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import assert_same, blank_like, mixed_state, random_tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import slipstream as ss
from slipstream.checkpoint.save.saver import CheckpointSaver


def test_every_value_kind_round_trips_and_dcp_reads_the_same(tmp_path):
    state = mixed_state()
    want = copy.deepcopy(state)
    ss.save(state, tmp_path / "ck")

    mine = blank_like(want)
    ss.load(mine, tmp_path / "ck")
    assert_same(mine, want)

    theirs = blank_like(want)
    dcp.load(theirs, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert_same(theirs, want)


def test_round_trip_matches_torch_save_of_the_same_state(tmp_path):
    state = mixed_state()
    buf = io.BytesIO()
    torch.save(state, buf)
    ss.save(state, tmp_path / "ck")
    loaded = blank_like(state)
    ss.load(loaded, tmp_path / "ck")
    buf.seek(0)
    assert_same(loaded, torch.load(buf, weights_only=False))


def test_load_writes_through_non_contiguous_views_into_their_base(tmp_path):
    src = torch.arange(60.0).reshape(6, 10)
    ss.save({"t": src.t(), "s": src[::2, 1::3]}, tmp_path / "ck")
    base_t = torch.zeros(6, 10)
    base_s = torch.zeros(6, 10)
    ss.load({"t": base_t.t(), "s": base_s[::2, 1::3]}, tmp_path / "ck")
    assert torch.equal(base_t, src)
    assert torch.equal(base_s[::2, 1::3], src[::2, 1::3])
    assert base_s[1::2].count_nonzero() == 0 and base_s[::2, 0].count_nonzero() == 0


def test_parameters_that_require_grad_load_in_place(tmp_path):
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    ss.save(saved.state_dict(keep_vars=True), tmp_path / "ck")
    target = torch.nn.Linear(4, 3)
    weight = target.weight
    ss.load(target.state_dict(keep_vars=True), tmp_path / "ck")
    assert target.weight is weight and weight.requires_grad
    assert torch.equal(target.weight, saved.weight) and torch.equal(target.bias, saved.bias)


class _TrainState(Stateful):
    """Model and optimizer behind DCP's ``get_state_dict``/``set_state_dict``."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model = model
        self.optim = optim

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def _trained(seed: int) -> _TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    return _TrainState(model, optim)


def test_stateful_model_and_optimizer_round_trip(tmp_path):
    app = _trained(seed=0)
    ss.save({"app": app, "step": 2}, tmp_path / "ck")
    want_model = copy.deepcopy(app.model.state_dict())
    want_optim = copy.deepcopy(app.optim.state_dict())

    other = _trained(seed=1)
    target = {"app": other, "step": 0}
    ss.load(target, tmp_path / "ck")
    assert target["step"] == 2
    assert_same(other.model.state_dict(), want_model)
    assert_same(other.optim.state_dict(), want_optim)

    reference = _trained(seed=2)
    dcp.load({"app": reference, "step": 0}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert_same(reference.optim.state_dict(), other.optim.state_dict())


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 1, 2)])
def test_odd_shapes_read_by_dcp_from_a_slipstream_checkpoint(tmp_path, shape):
    state = {"t": random_tensor(torch.float32, shape, 5)}
    ss.save(state, tmp_path / "ck")
    ref = {"t": torch.full(shape, -1.0)}
    dcp.load(ref, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(ref["t"], state["t"])


def test_slipstream_reads_every_value_kind_written_by_dcp_save(tmp_path):
    state = mixed_state()
    want = copy.deepcopy(state)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    loaded = blank_like(want)
    ss.load(loaded, tmp_path / "dcp")
    assert_same(loaded, want)


def test_conjugate_and_negative_views_save_and_load_their_values(tmp_path):
    z = random_tensor(torch.complex64, (4, 3), 9)
    state = {"conj": z.conj(), "neg": z.conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg() and z.imag.count_nonzero() > 0
    ss.save(state, tmp_path / "ck")
    conj_base = torch.zeros(4, 3, dtype=torch.complex64)
    neg_base = torch.zeros(4, 3, dtype=torch.complex64)
    target = {"conj": conj_base.conj(), "neg": neg_base.conj().imag}
    ss.load(target, tmp_path / "ck")
    assert torch.equal(target["conj"], z.conj()) and torch.equal(conj_base, z)
    assert torch.equal(target["neg"], -z.imag) and torch.equal(neg_base.imag, z.imag)


def test_dcp_save_over_a_slipstream_checkpoint_is_read_as_dcp_wrote_it(tmp_path):
    path = tmp_path / "ck"
    ss.save({"w": torch.arange(1000.0), "step": 1}, path)
    dcp.save({"w": torch.arange(1000.0) * 2, "step": 2}, checkpoint_id=str(path), no_dist=True)
    assert (path / ".slipstream.json").exists()
    target = {"w": torch.zeros(1000), "step": 0}
    ss.load(target, path)
    assert torch.equal(target["w"], torch.arange(1000.0) * 2) and target["step"] == 2


def test_a_save_over_a_larger_uncommitted_file_writes_the_same_file_as_a_fresh_save(tmp_path):
    # A data file left by a save that never committed is written over in place and cut to
    # length at the end: nothing of the older, larger file may survive past the new end or
    # inside it.
    large = {"w": torch.full((300_000,), 7.0), "v": torch.arange(5000.0), "note": "x" * 5000}
    small = {"w": random_tensor(torch.float32, (1000, 3), seed=1), "note": "small"}
    ss.save(large, checkpoint_id=tmp_path / "reused")
    for name in (".metadata", ".slipstream.json"):
        (tmp_path / "reused" / name).unlink()
    old_inode = (tmp_path / "reused" / "__0_0.distcp").stat().st_ino
    ss.save(small, checkpoint_id=tmp_path / "reused")
    ss.save(small, checkpoint_id=tmp_path / "fresh")
    assert (tmp_path / "reused" / "__0_0.distcp").stat().st_ino == old_inode
    reused = sorted(p.name for p in (tmp_path / "reused").glob("*.distcp"))
    assert reused == sorted(p.name for p in (tmp_path / "fresh").glob("*.distcp"))
    for name in reused:
        assert (tmp_path / "reused" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    by_dcp = {"w": torch.zeros(1000, 3), "note": ""}
    dcp.load(by_dcp, checkpoint_id=str(tmp_path / "reused"))
    assert torch.equal(by_dcp["w"], small["w"]) and by_dcp["note"] == "small"
    by_ss = {"w": torch.zeros(1000, 3), "note": ""}
    ss.load(by_ss, checkpoint_id=tmp_path / "reused")
    assert torch.equal(by_ss["w"], small["w"]) and by_ss["note"] == "small"


def test_later_saves_of_a_layout_commit_the_offsets_of_their_own_values(tmp_path):
    # A layout's commits share its tensor entries; each must still record where its own
    # plain values landed, which moves when a value's size changes between saves.
    saver = CheckpointSaver()
    try:
        for i, note in enumerate(["short", "x" * 10_000, "mid" * 50]):
            state = {"w": torch.full((1000,), float(i)), "note": note, "step": i}
            saver.save(state, tmp_path / str(i)).result(60)
        for i, note in enumerate(["short", "x" * 10_000, "mid" * 50]):
            by_dcp = {"w": torch.zeros(1000), "note": "", "step": -1}
            dcp.load(by_dcp, checkpoint_id=str(tmp_path / str(i)))
            assert (by_dcp["note"], by_dcp["step"]) == (note, i)
            assert torch.equal(by_dcp["w"], torch.full((1000,), float(i)))
    finally:
        saver.close()
    assert saver.plans_made == 1
