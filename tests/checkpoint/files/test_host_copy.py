"""HostCopy: a deep copy whose tensors live in reused host storages, saved by torch.save
as the original would be."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

import pytest
import torch

from slipstream.checkpoint.files import HostCopy
from slipstream.errors import PeerTimeoutError


def _state() -> dict:
    w = torch.randn(8, 4)
    return {
        "state_dict": OrderedDict(w=w, row=w[2], bias=torch.arange(4.0)),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(8, 4)}}, "param_groups": []}],
        "param": torch.nn.Parameter(torch.zeros(3)),
        "epoch": 3,
        "aliases": [w],
    }


def _saved(obj) -> dict:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_the_copy_saves_as_the_original_structure_types_and_shared_storages():
    state = _state()
    copied = HostCopy().copy(state)
    loaded, reference = _saved(copied), _saved(state)
    assert type(loaded["state_dict"]) is OrderedDict
    assert list(loaded["state_dict"]) == list(reference["state_dict"])
    assert type(loaded["param"]) is torch.nn.Parameter
    assert list(loaded["optimizer_states"][0]["state"]) == [0]  # int keys stay int
    for key in ("w", "row", "bias"):
        assert torch.equal(loaded["state_dict"][key], reference["state_dict"][key]), key
    # A view shares its base's storage in the copy, as in the original: one storage saved.
    row = loaded["state_dict"]["row"]
    assert (
        row.untyped_storage().data_ptr() == loaded["state_dict"]["w"].untyped_storage().data_ptr()
    )
    assert row.storage_offset() == state["state_dict"]["row"].storage_offset()
    assert loaded["aliases"][0] is loaded["state_dict"]["w"]


def test_the_copy_does_not_change_with_the_original_and_its_memory_is_reused():
    state, host = _state(), HostCopy()
    first = host.copy(state)
    before = first["state_dict"]["w"].clone()
    state["state_dict"]["w"].add_(1.0)  # training goes on
    assert torch.equal(first["state_dict"]["w"], before)
    address = first["state_dict"]["w"].untyped_storage().data_ptr()
    second = host.copy(state)
    assert second["state_dict"]["w"].untyped_storage().data_ptr() == address
    assert torch.equal(second["state_dict"]["w"], state["state_dict"]["w"])
    assert (
        host.nbytes
        == sum(
            t.untyped_storage().nbytes()
            for t in (state["state_dict"]["w"], state["state_dict"]["bias"], state["param"])
        )
        + state["optimizer_states"][0]["state"][0]["exp_avg"].untyped_storage().nbytes()
    )


def test_a_copy_waits_for_the_reader_of_the_last_one_and_names_the_wait():
    host = HostCopy(timeout=0.2)
    state = _state()
    host.copy(state)
    host.hold()
    with pytest.raises(PeerTimeoutError, match="still being written"):
        host.copy(state)
    released = threading.Timer(0.1, host.release)
    released.start()
    host.copy(state)  # returns once the reader let go
    released.join()
