"""``ss.load_all``: a whole checkpoint as the nested dict it was saved from, no template.

References: for slipstream-written checkpoints, the state itself after a ``torch.save`` /
``torch.load`` round trip (key types included); for DCP-written ones, what DCP's own
``dcp_to_torch_save`` writes. An optimizer restored from ``load_all`` must continue exactly
as the original does.
"""

from __future__ import annotations

import copy
import io
import json
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import slipstream as ss


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _state() -> dict:
    model, optimizer = _trained()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "digits": {"0": torch.arange(3), "1": "one", 7: "seven", 2.5: "float"},
        "flags": {True: "yes"},
        "tuples": (1, ("a", torch.ones(2)), [3, 4]),
        "nested": [{"a": [1, 2], "b": torch.zeros(2, 2)}, [torch.ones(1), "x"]],
        "step": 12,
    }


def _torch_round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _assert_same(got, want, where="") -> None:
    """Equal values, keys of the same types; mappings come back as plain dicts (as DCP's)."""
    kind = dict if isinstance(want, dict) else type(want)
    assert type(got) is kind, f"{where}: {type(got).__name__} != {kind.__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(map(repr, got)) == set(map(repr, want)), f"{where}: {list(got)}"
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key!r}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_slipstream_checkpoint_comes_back_with_its_key_types(tmp_path):
    state = _state()
    ss.save(state, tmp_path / "ck")
    got = ss.load_all(tmp_path / "ck")
    _assert_same(got, _torch_round_trip(state))
    assert list(got["optim"]["state"]) == [0, 1, 2, 3]
    assert "0" in got["digits"] and 7 in got["digits"] and 2.5 in got["digits"]
    assert got["flags"] == {True: "yes"}


def test_optimizer_restored_from_load_all_continues_exactly(tmp_path):
    model, optimizer = _trained()
    ss.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp_path / "ck")
    loaded = ss.load_all(tmp_path / "ck")
    model2 = copy.deepcopy(model)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(loaded["model"])
    optimizer2.load_state_dict(loaded["optim"])
    batch = torch.randn(3, 4)
    for m, o in ((model, optimizer), (model2, optimizer2)):
        m(batch).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    # The restored state saves again (string keys "0" and int keys 0 would collide).
    ss.save({"optim": optimizer2.state_dict()}, tmp_path / "again")


def test_dcp_checkpoint_comes_back_as_dcp_to_torch_save_gives_it(tmp_path):
    state = _state()
    dcp.save(copy.deepcopy(state), checkpoint_id=tmp_path / "dcp", no_dist=True)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "ref.pt")
    want = torch.load(tmp_path / "ref.pt", weights_only=False)
    got = ss.load_all(tmp_path / "dcp")
    _assert_same(got, want)
    assert "0" in got["optim"]["state"], "DCP records no key types: keys come back as strings"


def test_checkpoint_without_recorded_key_types_loads_as_dcp_would(tmp_path):
    # A checkpoint written before key types were recorded: its index lacks the field.
    state = _state()
    ss.save(state, tmp_path / "ck")
    (index_path,) = tmp_path.joinpath("ck").glob("*.json")
    index = json.loads(index_path.read_text())
    assert index.pop("key_types")
    index_path.write_text(json.dumps(index))
    got = ss.load_all(tmp_path / "ck")
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "ref.pt")
    _assert_same(got, torch.load(tmp_path / "ref.pt", weights_only=False))


@pytest.fixture(params=["s3", "memory"])
def object_url(request) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/run"
    return f"memory://test-{uuid.uuid4().hex[:8]}/run"


def test_load_all_from_object_storage(object_url):
    state = _state()
    ss.save(state, f"{object_url}/ck")
    _assert_same(ss.load_all(f"{object_url}/ck"), _torch_round_trip(state))


class _Custom:
    def __init__(self, x: int) -> None:
        self.x = x


def test_load_all_refuses_unsafe_values_and_takes_trusted(tmp_path):
    ss.save({"v": _Custom(3)}, tmp_path / "ck")
    with pytest.raises(ss.UnsafeCheckpointError, match=f"{__name__}._Custom"):
        ss.load_all(tmp_path / "ck")
    assert ss.load_all(tmp_path / "ck", trusted=[_Custom])["v"].x == 3


def test_load_into_a_template_with_int_keys_fills_those_keys(tmp_path):
    # A plain value under an int key goes back under that key, not under its string.
    state = {"optim": {"state": {0: {"step": 5, "m": torch.ones(2)}}}, "names": {3: "three"}}
    ss.save(state, tmp_path / "ck")
    target = {"optim": {"state": {0: {"step": 0, "m": torch.zeros(2)}}}, "names": {3: None}}
    ss.load(target, tmp_path / "ck")
    assert list(target["optim"]["state"]) == [0] and list(target["names"]) == [3]
    _assert_same(target, state)
