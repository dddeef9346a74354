"""``ss.load_all``: a whole checkpoint as the nested dict it was saved from, no template.

References: for slipstream-written checkpoints, the state itself after a ``torch.save`` /
``torch.load`` round trip (key types, container types, empty containers and key order
included); for DCP-written ones, what DCP's own
``dcp_to_torch_save`` writes. An optimizer restored from ``load_all`` must continue exactly
as the original does.
"""

from __future__ import annotations

import collections
import copy
import io
import json
import sys
import uuid
from collections.abc import Mapping

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.data import AttributeDict as FabricAttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict as PlAttributeDict
from omegaconf import ListConfig, OmegaConf
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


def _assert_same(got, want, where="", *, plain_dicts=False) -> None:
    """Equal values, keys of the same types; containers of the same types, mappings with
    their keys in the same order (``plain_dicts``: every mapping a ``dict``, as DCP's)."""
    kind = dict if plain_dicts and isinstance(want, Mapping) else type(want)
    assert type(got) is kind, f"{where}: {type(got).__name__} != {kind.__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, Mapping):
        if plain_dicts:
            assert set(map(repr, got)) == set(map(repr, want)), f"{where}: {list(got)}"
        else:
            assert list(map(repr, got)) == list(map(repr, want)), f"{where}: {list(got)}"
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key!r}", plain_dicts=plain_dicts)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]", plain_dicts=plain_dicts)
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
    _assert_same(got, want, plain_dicts=True)
    assert "0" in got["optim"]["state"], "DCP records no key types: keys come back as strings"


def test_checkpoint_without_recorded_key_types_loads_as_dcp_would(tmp_path):
    # A checkpoint written before key types and containers were recorded: its index lacks
    # both fields.
    state = _state()
    ss.save(state, tmp_path / "ck")
    (index_path,) = tmp_path.joinpath("ck").glob("*.json")
    index = json.loads(index_path.read_text())
    assert index.pop("key_types") and index.pop("containers")
    index_path.write_text(json.dumps(index))
    got = ss.load_all(tmp_path / "ck")
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "ref.pt")
    _assert_same(got, torch.load(tmp_path / "ref.pt", weights_only=False), plain_dicts=True)


@pytest.fixture(params=["s3", "memory"])
def object_url(request) -> str:
    if request.param == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/run"
    return f"memory://test-{uuid.uuid4().hex[:8]}/run"


def test_load_all_from_object_storage(object_url):
    state = _state()
    ss.save(state, f"{object_url}/ck")
    _assert_same(ss.load_all(f"{object_url}/ck"), _torch_round_trip(state))


# -- container types and empty containers ---------------------------------------------------


def _containers_state() -> dict:
    """Every kind of container a user saves: a module's ``OrderedDict``, empty mappings and
    lists at every depth (among siblings, in lists, under int keys), tuples, omegaconf's
    ``DictConfig``/``ListConfig`` and both of Lightning's ``AttributeDict``s."""
    model, optimizer = _trained()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "empty": {},
        "empty_list": [],
        "empty_tuple": (),
        "nested": {"a": {}, "b": torch.ones(2), "c": {"d": {}, "e": []}, "f": 3},
        "in_list": [torch.zeros(1), {}, {"x": {}}, [], ("t", torch.ones(1))],
        "by_int": {0: {}, 1: {"step": 4}, 2: collections.OrderedDict()},
        "ordered": collections.OrderedDict([("z", 1), ("a", {}), ("m", torch.ones(1))]),
        "tuples": (1, ("a", torch.ones(2)), [3, 4], {}),
        "config": OmegaConf.create(
            {"lr": 0.1, "sizes": [1, 2], "sub": {"depth": 2, "none": {}}, "empty": {}}
        ),
        "list_config": ListConfig([{"a": 1}, 2]),
        "hparams": PlAttributeDict(lr=0.1, layers=ListConfig([8, 4]), extra={}),
        "fabric_hparams": FabricAttributeDict(seed=3, nested=PlAttributeDict(x=1)),
        "step": 12,
    }


@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ck")
    return f"memory://test-{uuid.uuid4().hex[:8]}/ck"


def test_containers_come_back_with_their_types_and_emptiness(location):
    state = _containers_state()
    ss.save(state, location)
    got = ss.load_all(location)
    _assert_same(got, _torch_round_trip(state))
    for name in ("config", "list_config"):
        assert OmegaConf.to_container(got[name]) == OmegaConf.to_container(state[name])
    assert got["hparams"].lr == 0.1 and got["fabric_hparams"].nested.x == 1
    # The restored state saves again and comes back the same.
    ss.save(got, f"{location}-again")
    _assert_same(ss.load_all(f"{location}-again"), _torch_round_trip(state))


def test_dcp_reads_a_checkpoint_with_containers_as_it_reads_its_own(tmp_path):
    state = _containers_state()
    del state["in_list"]  # DCP's own load fails on a list that held an empty mapping
    ss.save(state, tmp_path / "ck")
    dcp.save(copy.deepcopy(state), checkpoint_id=tmp_path / "dcp", no_dist=True)
    for ck in ("ck", "dcp"):
        dcp_to_torch_save(tmp_path / ck, tmp_path / f"{ck}.pt")
    ours = torch.load(tmp_path / "ck.pt", weights_only=False)
    _assert_same(ours, torch.load(tmp_path / "dcp.pt", weights_only=False), plain_dicts=True)
    got = ss.load_all(tmp_path / "dcp")
    _assert_same(got, torch.load(tmp_path / "dcp.pt", weights_only=False), plain_dicts=True)
    assert "empty" not in got, "DCP keeps no empty mappings"


def _edit_index(directory, edit) -> None:
    index_path = directory / ".slipstream.json"
    index = json.loads(index_path.read_text())
    edit(index)
    index_path.write_text(json.dumps(index))


def test_an_unknown_container_type_comes_back_as_a_dict_and_is_not_imported(tmp_path):
    state = {"cfg": collections.OrderedDict(a=torch.ones(1), b=2), "empty": {}}
    ss.save(state, tmp_path / "ck")

    def rename(index: dict) -> None:
        assert index["containers"]["cfg"]["type"] == "collections.OrderedDict"
        index["containers"]["cfg"]["type"] = "slipstream_never_imported.Evil"
        index["containers"]["empty"]["type"] = "os.system"

    _edit_index(tmp_path / "ck", rename)
    got = ss.load_all(tmp_path / "ck")
    _assert_same(got, {"cfg": {"a": torch.ones(1), "b": 2}, "empty": {}})
    assert "slipstream_never_imported" not in sys.modules


def test_a_checkpoint_without_recorded_containers_loads_as_before(tmp_path):
    # Written after key types were recorded, before containers were: int keys come back as
    # int, every mapping as a dict, empty ones gone.
    state = {"model": collections.OrderedDict(w=torch.ones(2)), "s": {0: {}, 1: {"x": 1}}}
    ss.save(state, tmp_path / "ck")
    _edit_index(tmp_path / "ck", lambda index: index.pop("containers"))
    got = ss.load_all(tmp_path / "ck")
    _assert_same(got, {"model": {"w": torch.ones(2)}, "s": {1: {"x": 1}}})


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


@pytest.mark.parametrize("after", [None, "w"])
def test_a_recorded_mapping_whose_path_runs_through_a_value_is_refused(tmp_path, after):
    ss.save({"w": torch.ones(2), "step": 3}, tmp_path / "ck")

    def through_w(index: dict) -> None:
        entry = {"path": ["w", "x"], "type": "builtins.dict", "after": after}
        index["containers"] = {"w.x": entry}

    _edit_index(tmp_path / "ck", through_w)
    with pytest.raises(ss.CorruptCheckpointError, match=r"'w\.x'.*\['w', 'x'\]"):
        ss.load_all(tmp_path / "ck")


def test_each_save_of_a_reused_saver_records_its_own_containers(tmp_path):
    # Same tensors and values, other mappings: a cached plan must not carry the first
    # save's record into the second.
    first = {"w": torch.ones(2), "opt": {"state": {}}, "cfg": collections.OrderedDict(lr=1)}
    second = {"w": torch.ones(2), "opt": {"state": {}}, "cfg": {"lr": 1}}
    with ss.Checkpointer(tmp_path, keep_last=None) as ck:
        ck.save(1, first).result(60)
        ck.save(2, second).result(60)
    _assert_same(ss.load_all(tmp_path / "step_1"), first)
    _assert_same(ss.load_all(tmp_path / "step_2"), second)
