"""Loading never runs code from a checkpoint, whoever wrote it.

Each hostile payload would create a marker file if unpickled; a control shows it does
(plain ``pickle.loads``), and each test shows slipstream refuses it, names the type, and
the marker never appears.
"""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import slipstream as ss
from slipstream.checkpoint.format.safe_pickle import load_metadata


class _TouchesFile:
    """Unpickling this runs ``os.system('touch <marker>')``."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Custom:
    """A harmless class that is simply not on any allow-list."""

    def __init__(self) -> None:
        self.x = 1


def test_control_the_payload_runs_when_unpickled_naively(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_TouchesFile(marker)))
    assert marker.exists()


def _poison_metadata(checkpoint, payload) -> None:
    """Put ``payload`` inside the checkpoint's (otherwise valid) ``.metadata``."""
    path = checkpoint / ".metadata"
    metadata = load_metadata(path.read_bytes(), str(path))
    metadata.planner_data["w"] = payload
    path.write_bytes(pickle.dumps(metadata))


def _target() -> dict:
    return {"w": torch.zeros(4), "v": None}


def _save(kind: str, path, value) -> None:
    state = {"w": torch.arange(4.0), "v": value}
    if kind == "slipstream":
        ss.save(state, path)
    else:
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("writer", ["slipstream", "dcp"])
def test_metadata_calling_os_system_is_refused_and_never_runs(tmp_path, writer):
    marker = tmp_path / "ran"
    _save(writer, tmp_path / "ck", 1)
    _poison_metadata(tmp_path / "ck", _TouchesFile(marker))
    with pytest.raises(ss.UnsafeCheckpointError, match=r"\.metadata.*(posix|os)\.system"):
        ss.load(_target(), tmp_path / "ck")
    assert not marker.exists()


@pytest.mark.parametrize("writer", ["slipstream", "dcp"])
def test_metadata_with_a_custom_class_is_refused_naming_it(tmp_path, writer):
    _save(writer, tmp_path / "ck", 1)
    _poison_metadata(tmp_path / "ck", _Custom())
    with pytest.raises(ss.UnsafeCheckpointError, match=r"test_safe_load\._Custom"):
        ss.load(_target(), tmp_path / "ck")


@pytest.mark.parametrize("writer", ["slipstream", "dcp"])
def test_value_record_calling_os_system_is_refused_and_never_runs(tmp_path, writer):
    marker = tmp_path / "ran"
    _save(writer, tmp_path / "ck", _TouchesFile(marker))
    assert not marker.exists()
    with pytest.raises(ss.UnsafeCheckpointError, match=r"value 'v' needs (posix|os)\.system"):
        ss.load(_target(), tmp_path / "ck")
    assert not marker.exists()


@pytest.mark.parametrize("writer", ["slipstream", "dcp"])
def test_value_record_with_a_custom_class_is_refused_naming_it(tmp_path, writer):
    _save(writer, tmp_path / "ck", [1, (_Custom(),)])
    with pytest.raises(ss.UnsafeCheckpointError, match=r"test_safe_load\._Custom"):
        ss.load(_target(), tmp_path / "ck")


def _poisoned_tensor_record(marker) -> bytes:
    """A ``torch.save`` archive of a tensor whose ``data.pkl`` also calls ``os.system``."""
    buf = io.BytesIO()
    torch.save([torch.arange(4.0), _TouchesFile(marker)], buf)
    return buf.getvalue()


def test_dcp_tensor_record_with_a_hostile_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    path = tmp_path / "ck" / ".metadata"
    metadata = load_metadata(path.read_bytes(), str(path))
    ((index, info),) = metadata.storage_data.items()
    record = _poisoned_tensor_record(marker)
    data_file = tmp_path / "ck" / info.relative_path
    with open(data_file, "ab") as f:
        offset = f.tell()
        f.write(record)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(record))
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ss.UnsafeCheckpointError, match=r"(posix|os)\.system"):
        ss.load({"w": torch.zeros(4)}, tmp_path / "ck")
    assert not marker.exists()
