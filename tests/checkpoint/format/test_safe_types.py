"""The plain data real training checkpoints hold loads safely; anything else needs trust.

Each value is saved by slipstream and by ``dcp.save`` and loaded by ``ss.load``; the
reference is what ``dcp.load`` (which unpickles without an allow-list) and ``torch.load``
return for the same value. Hostile payloads create a marker file if they ever run.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import decimal
import fractions
import io
import os
import pathlib
import uuid

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import slipstream as ss


class _TouchesFile:
    """Unpickling this runs ``os.system('touch <marker>')``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Custom:
    def __init__(self, x=1) -> None:
        self.x = x

    def __eq__(self, other) -> bool:
        return type(other) is _Custom and other.x == self.x


class _Other:
    pass


def _plain_values() -> dict:
    rng = np.random.default_rng(7)
    rng.random(3)
    legacy = np.random.RandomState(3)
    legacy.random_sample(2)
    return {
        "np_f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "np_i64": np.array([1, -2, 3], dtype=np.int64),
        "np_structured": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]),
        "np_scalar": np.float64(2.5),
        "np_int_scalar": np.int32(-7),
        "np_dtype": np.dtype("float16"),
        "np_get_state": np.random.RandomState(11).get_state(),
        "np_bit_generator_state": rng.bit_generator.state,
        "np_generator": rng,
        "np_random_state": legacy,
        "namespace": argparse.Namespace(lr=3e-4, layers=[1, 2], name="run"),
        "path": pathlib.Path("/data/shards/train"),
        "pure_path": pathlib.PurePosixPath("relative/x.bin"),
        "datetime": datetime.datetime(2026, 11, 25, 14, 3, 7, 123),
        "datetime_utc": datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc),
        "date": datetime.date(2025, 6, 1),
        "time": datetime.time(13, 37),
        "timedelta": datetime.timedelta(hours=5, seconds=3),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "defaultdict": collections.defaultdict(list, {"x": [1, 2]}),
        "deque": collections.deque([1, 2, 3], maxlen=5),
        "counter": collections.Counter("abracadabra"),
        "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "decimal": decimal.Decimal("1.25"),
        "fraction": fractions.Fraction(1, 3),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a"}),
        "complex": 1 + 2j,
        "slice": slice(1, 10, 2),
        "range": range(2, 9, 3),
    }


def _same(a, b) -> bool:
    """Equality that looks inside numpy arrays and random generators."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, np.random.Generator):
        return _same(a.bit_generator.state, b.bit_generator.state)
    if isinstance(a, np.random.RandomState):
        return _same(a.get_state(), b.get_state())
    if isinstance(a, collections.defaultdict):
        return a.default_factory is b.default_factory and dict(a) == dict(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, argparse.Namespace):
        return vars(a) == vars(b)
    return a == b


@pytest.mark.parametrize("writer", ["slipstream", "dcp"])
def test_plain_data_round_trips_like_dcp_load_and_torch_load(tmp_path, writer):
    # Each value in a 1-tuple, a leaf for both writers: dicts (OrderedDict, Counter, the
    # bit generator's state) would otherwise be flattened into keys of their own.
    values = {k: (v,) for k, v in _plain_values().items()}
    state = {"w": torch.arange(4.0), **values}
    if writer == "slipstream":
        ss.save(state, tmp_path / "ck")
    else:
        dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    loaded = {"w": torch.zeros(4), **dict.fromkeys(values)}
    ss.load(loaded, tmp_path / "ck")
    reference = {"w": torch.zeros(4), **dict.fromkeys(values)}
    dcp.load(reference, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for key, value in values.items():
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        via_torch = torch.load(buf, weights_only=False)
        assert _same(loaded[key], value), key
        assert _same(loaded[key], reference[key]), key
        assert _same(loaded[key], via_torch), key
    assert torch.equal(loaded["w"], torch.arange(4.0))


def test_loaded_numpy_rng_states_continue_the_same_streams(tmp_path):
    legacy = np.random.RandomState(5)
    rng = np.random.default_rng(5)
    state = {"legacy": legacy.get_state(), "modern": (rng.bit_generator.state,), "gen": rng}
    ss.save(state, tmp_path / "ck")
    expected_legacy, expected_modern = legacy.random_sample(4), rng.random(4)
    loaded = dict.fromkeys(state)
    ss.load(loaded, tmp_path / "ck")
    resumed = np.random.RandomState()
    resumed.set_state(loaded["legacy"])
    fresh = np.random.default_rng()
    fresh.bit_generator.state = loaded["modern"][0]
    assert np.array_equal(resumed.random_sample(4), expected_legacy)
    assert np.array_equal(fresh.random(4), expected_modern)
    assert np.array_equal(loaded["gen"].random(4), expected_modern)


@pytest.mark.parametrize(
    "payload",
    [
        lambda m: _TouchesFile(m),
        lambda m: np.array([_TouchesFile(m)], dtype=object),
        lambda m: argparse.Namespace(x=_TouchesFile(m)),
        lambda m: (collections.defaultdict(list, {"k": _TouchesFile(m)}),),
    ],
    ids=["bare", "in_numpy_object_array", "in_namespace", "in_defaultdict"],
)
def test_hostile_pickle_never_runs_even_with_other_types_trusted(tmp_path, payload):
    marker = tmp_path / "ran"
    ss.save({"v": payload(marker)}, tmp_path / "ck")
    assert not marker.exists()
    with pytest.raises(ss.UnsafeCheckpointError, match=r"(posix|os)\.system"):
        ss.load({"v": None}, tmp_path / "ck", trusted=[_Custom, "pathlib.Path"])
    assert not marker.exists()


def test_refusal_names_every_missing_class_at_once(tmp_path):
    ss.save({"v": (_Custom(), {"o": _Other()})}, tmp_path / "ck")
    with pytest.raises(ss.UnsafeCheckpointError) as info:
        ss.load({"v": None}, tmp_path / "ck")
    message = str(info.value)
    custom, other = f"{__name__}._Custom", f"{__name__}._Other"
    assert custom in message and other in message
    assert "value 'v'" in message and "trusted=" in message and "--trust" in message


def test_trusted_classes_by_object_or_by_name_load(tmp_path):
    ss.save({"v": [_Custom(5), _Other]}, tmp_path / "ck")
    by_object = {"v": None}
    ss.load(by_object, tmp_path / "ck", trusted=[_Custom, _Other])
    assert by_object["v"][0] == _Custom(5) and by_object["v"][1] is _Other
    by_name = {"v": None}
    ss.load(by_name, tmp_path / "ck", trusted=[f"{__name__}._Custom", f"{__name__}._Other"])
    assert by_name["v"][0] == _Custom(5)
    everything = {"v": None}
    ss.load(everything, tmp_path / "ck", trusted=True)
    assert everything["v"][0] == _Custom(5)


def test_partly_trusted_is_still_refused_naming_what_is_left(tmp_path):
    ss.save({"v": [_Custom(), _Other()]}, tmp_path / "ck")
    with pytest.raises(ss.UnsafeCheckpointError) as info:
        ss.load({"v": None}, tmp_path / "ck", trusted=[_Custom])
    assert f"{__name__}._Other" in str(info.value)
    assert f"{__name__}._Custom" not in str(info.value)


def test_checkpointer_load_takes_trusted(tmp_path):
    with ss.Checkpointer(tmp_path / "run") as ck:
        ck.save(1, {"v": _Custom(3)}).result(30)
        with pytest.raises(ss.UnsafeCheckpointError, match="_Custom"):
            ck.load({"v": None})
        loaded = {"v": None}
        assert ck.load(loaded, trusted=[_Custom]) == 1
    assert loaded["v"] == _Custom(3)


def test_unknown_trusted_name_is_a_clear_error(tmp_path):
    ss.save({"v": 1}, tmp_path / "ck")
    with pytest.raises(ValueError, match="no_such_module.Thing"):
        ss.load({"v": None}, tmp_path / "ck", trusted=["no_such_module.Thing"])


def test_numpy_state_loads_where_torch_forces_weights_only(tmp_path, monkeypatch):
    # torch.load then refuses any pickle module: torch's own unpickler reads the values,
    # given the same allow-list; a hostile value is still refused.
    state = {"rng": np.random.RandomState(1).get_state(), "args": argparse.Namespace(a=1)}
    ss.save(state, tmp_path / "ck")
    marker = tmp_path / "ran"
    ss.save({"v": _TouchesFile(marker)}, tmp_path / "bad")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    loaded = dict.fromkeys(state)
    ss.load(loaded, tmp_path / "ck")
    assert _same(loaded["rng"], state["rng"]) and loaded["args"] == state["args"]
    with pytest.raises(ss.UnsafeCheckpointError, match=r"needs (posix|os)\.system"):
        ss.load({"v": None}, tmp_path / "bad")
    assert not marker.exists()
