"""async_torch_save / torch_save: torch.save's file, written whole or not at all, on a
thread of its own that the owner joins."""

from __future__ import annotations

import os
import threading
from unittest import mock

import pytest
import torch

from slipstream.checkpoint.files import (
    BackgroundWrites,
    HostCopy,
    async_torch_save,
    atomic_directory,
    torch_save,
    wait_for_path,
)
from slipstream.errors import CheckpointError


def _slipstream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("slipstream-write")]


def test_the_file_is_torch_saves_and_holds_the_state_at_the_call(tmp_path):
    state = {"w": torch.randn(64, 64), "step": 3}
    expected = state["w"].clone()
    writes = BackgroundWrites()
    response = async_torch_save(state, tmp_path / "a.pt", host_copy=HostCopy(), writes=writes)
    assert response.staging_completion.done()
    state["w"].zero_()  # the caller may change the state at once
    response.result(30)
    loaded = torch.load(tmp_path / "a.pt")
    assert torch.equal(loaded["w"], expected) and loaded["step"] == 3
    writes.wait(30)
    assert _slipstream_threads() == []
    assert os.listdir(tmp_path) == ["a.pt"]  # no hidden sibling left


def test_while_written_the_path_holds_the_previous_file_and_readers_can_wait(tmp_path):
    path = tmp_path / "last.pt"
    torch_save({"v": torch.tensor(1)}, path)
    release = threading.Event()
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):
        assert release.wait(30)
        real_save(obj, f, *args, **kwargs)

    writes = BackgroundWrites()
    with mock.patch("torch.save", slow_save):
        async_torch_save({"v": torch.tensor(2)}, path, host_copy=HostCopy(), writes=writes)
        assert torch.load(path)["v"].item() == 1  # the old file, whole
        with pytest.raises(CheckpointError, match="still being written"):
            wait_for_path(path, 0.05)
        release.set()
        wait_for_path(path, 30)
    assert torch.load(path)["v"].item() == 2
    writes.wait(30)


def test_a_failed_write_leaves_the_old_file_and_is_raised_naming_the_path(tmp_path):
    path = tmp_path / "c.pt"
    torch_save({"v": 1}, path)
    writes = BackgroundWrites()
    with mock.patch("torch.save", side_effect=OSError("disk full")):
        response = async_torch_save({"v": 2}, path, host_copy=HostCopy(), writes=writes)
        with pytest.raises(OSError, match="disk full"):
            response.result(30)
    with pytest.raises(CheckpointError, match=r"c\.pt.*disk full"):
        writes.wait(30)
    assert torch.load(path)["v"] == 1
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_directory_appears_whole_and_a_failure_leaves_the_old_one(tmp_path):
    target = tmp_path / "checkpoint-1"
    with atomic_directory(target) as building:
        (open(os.path.join(building, "a.bin"), "wb")).close()
        assert not target.exists()
    assert os.listdir(target) == ["a.bin"]
    with pytest.raises(RuntimeError), atomic_directory(target) as building:
        open(os.path.join(building, "b.bin"), "wb").close()
        raise RuntimeError("failed half way")
    assert os.listdir(target) == ["a.bin"]
    assert os.listdir(tmp_path) == ["checkpoint-1"]
