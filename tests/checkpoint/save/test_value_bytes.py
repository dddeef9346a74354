"""Plain values are serialized once per change: a value equal to the last one saved under its
key (same types, same float bits) reuses those bytes; anything else is pickled again."""

from __future__ import annotations

import copy
import io
import math

import torch

from slipstream.checkpoint.save.layout import ValueSerializer


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def test_repeated_values_reuse_their_bytes_and_changed_ones_are_pickled_again():
    serialize = ValueSerializer()
    first = {
        "lr": 0.1,
        "groups": [{"betas": (0.9, 0.99), "params": [0, 1], "name": "main"}],
        "zero": 0.0,
        "flag": 1,
        "shape": torch.Size([2, 3]),  # not a plain container: never reused
    }
    a = serialize(first)
    b = serialize(copy.deepcopy(first))
    for key in ("lr", "groups", "zero", "flag"):
        assert b[key] is a[key], key
    assert b["shape"] is not a["shape"] and _load(b["shape"]) == torch.Size([2, 3])

    changed = {
        "lr": 0.2,
        "groups": [{"betas": (0.9, 0.99), "params": [1, 0], "name": "main"}],
        "zero": -0.0,
        "flag": True,
        "shape": torch.Size([4]),
    }
    c = serialize(changed)
    for key, value in changed.items():
        got = _load(c[key])
        assert got == value and type(got) is type(value), key
    assert math.copysign(1.0, _load(c["zero"])) == -1.0
    assert _load(c["groups"])[0]["params"] == [1, 0]
