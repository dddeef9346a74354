"""A DCP checkpoint whose ``.metadata`` holds the classes older DCP releases pickled
(``fixtures/legacy_dcp_metadata`` beside this file, made by
``fixtures/make_legacy_dcp_checkpoint.py``, which says how) loads exactly through
``slipstream.dcp.load`` and ``ss.load``, as PyTorch's test_compatibility.py asserts of
``dcp.load``; the allow-list still refuses anything else."""

from __future__ import annotations

import pathlib
import pickle
import shutil
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import slipstream as ss
import slipstream.dcp as dcp

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from make_legacy_dcp_checkpoint import (  # noqa: E402  (the fixture's own maker)
    CHECKPOINT,
    LEGACY_PLANNER_KEY,
    fixture_state,
)

LEGACY_NAMES = (
    b"torch.distributed._shard.sharded_tensor.metadata",
    b"TensorProperties",
    b"MEM_FORMAT_ENCODING",
    b"ShardedTensorMetadata",
    b"torch.distributed._shard.metadata",
    b"ShardMetadata",
)


def _blank() -> dict[str, Any]:
    model = {k: torch.full_like(v, 3) for k, v in fixture_state()["model"].items()}
    return {"model": model, "step": 0, "lr": 0.0, "name": ""}


def _assert_exact(loaded: dict[str, Any], want: dict[str, Any]) -> None:
    for key, value in want["model"].items():
        got = loaded["model"][key]
        assert got.dtype == value.dtype and torch.equal(got, value), key
    assert (loaded["step"], loaded["lr"], loaded["name"]) == (
        want["step"],
        want["lr"],
        want["name"],
    )


def test_the_fixture_pickles_the_legacy_classes():
    data = (CHECKPOINT / ".metadata").read_bytes()
    for name in LEGACY_NAMES:
        assert name in data, name
    metadata = torch_dcp.FileSystemReader(str(CHECKPOINT)).read_metadata()
    assert metadata.version is None  # left out, as releases before it did
    assert type(metadata.planner_data[LEGACY_PLANNER_KEY]).__name__ == "ShardedTensorMetadata"


def test_dcp_load_reads_the_legacy_checkpoint_as_dcp_does():
    reference = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.load(reference, checkpoint_id=str(CHECKPOINT))
    _assert_exact(reference, fixture_state())
    loaded = _blank()
    dcp.load(loaded, checkpoint_id=str(CHECKPOINT))
    _assert_exact(loaded, fixture_state())
    loaded = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, torch_dcp.FileSystemReader(str(CHECKPOINT)))
    _assert_exact(loaded, fixture_state())


def test_ss_load_reads_the_legacy_checkpoint_exactly():
    loaded = _blank()
    ss.load(loaded, CHECKPOINT)
    _assert_exact(loaded, fixture_state())
    whole = ss.load_all(CHECKPOINT)
    _assert_exact(whole, fixture_state())


class _NotData:
    def __reduce__(self):
        return (print, ("ran",))


def test_anything_else_in_legacy_metadata_is_still_refused(tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(CHECKPOINT, path)
    metadata = pickle.loads((path / ".metadata").read_bytes())
    metadata.planner_data["evil"] = _NotData()
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    for load in (ss.load, dcp.load):
        with pytest.raises(ss.UnsafeCheckpointError, match=r"builtins\.print"):
            load(_blank(), checkpoint_id=path)
