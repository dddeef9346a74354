"""DCP's own arguments to save and load: each honoured, or the call handed to DCP itself.

Where an argument is honoured, the checkpoint is compared with the state saved and read
back by ``dcp.load``; where the call is handed to DCP, DCP wrote it (no slipstream index)
and it reads back as the state saved.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import step_state
from dist_utils import run_workers
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import slipstream as ss


def _state() -> dict:
    """A flat state (``flatten_state_dict=False`` saves a nested one under keys DCP's default
    load then cannot find), with an int64 tensor beside the float one."""
    return step_state(7, (32, 8), b=torch.arange(5))


def _empty() -> dict:
    return {"w": torch.zeros(32, 8), "b": torch.zeros(5, dtype=torch.int64), "step": 0}


def _equal(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def test_save_returns_the_committed_metadata_as_dcp_save_does(tmp_path):
    state = _state()
    returned = ss.save(state, tmp_path / "ck")
    on_disk = FileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert isinstance(returned, Metadata)
    assert returned.storage_meta.save_id == on_disk.storage_meta.save_id
    assert returned.state_dict_metadata == on_disk.state_dict_metadata
    via_dcp = dcp.save(_state(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert set(returned.state_dict_metadata) == set(via_dcp.state_dict_metadata)
    response = ss.async_save(state, tmp_path / "ck2")
    assert response.metadata(30).storage_meta.save_id == (
        FileSystemReader(str(tmp_path / "ck2")).read_metadata().storage_meta.save_id
    )


@pytest.mark.parametrize("writer_class", [FileSystemWriter, FsspecWriter])
def test_dcp_filesystem_writers_and_readers_map_to_their_path(tmp_path, writer_class):
    state = _state()
    writer = writer_class(str(tmp_path / "ck"), thread_count=2, sync_files=False)
    ss.save(state, storage_writer=writer, planner=DefaultSavePlanner())
    assert (tmp_path / "ck" / ".slipstream.json").exists()  # slipstream wrote it
    reference = _empty()
    dcp.load(reference, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert _equal(reference, state)
    reader_class = FileSystemReader if writer_class is FileSystemWriter else FsspecReader
    loaded = _empty()
    ss.load(loaded, storage_reader=reader_class(str(tmp_path / "ck")), planner=DefaultLoadPlanner())
    assert _equal(loaded, state)


def test_checkpoint_id_wins_over_the_writers_path_as_in_dcp(tmp_path):
    ss.save(_state(), tmp_path / "given", storage_writer=FileSystemWriter(str(tmp_path / "w")))
    assert (tmp_path / "given" / ".metadata").exists()
    assert not (tmp_path / "w").exists()


def test_fsspec_s3_writer_and_reader(s3_bucket):
    state = _state()
    url = f"s3://{s3_bucket}/run/ck"
    ss.save(state, storage_writer=FsspecWriter(url))
    loaded = _empty()
    ss.load(loaded, storage_reader=FsspecReader(url))
    assert _equal(loaded, state)
    direct = _empty()
    ss.load(direct, url)
    assert _equal(direct, state)


def test_overwrite_false_is_honoured(tmp_path):
    ss.save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "ck"), overwrite=False))
    before = (tmp_path / "ck" / ".metadata").read_bytes()
    with pytest.raises(ss.CheckpointError, match=r"already holds a checkpoint.*overwrite=False"):
        ss.save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "ck"), overwrite=False))
    assert (tmp_path / "ck" / ".metadata").read_bytes() == before


class _MyWriter(FileSystemWriter):
    pass


class _MyPlanner(DefaultSavePlanner):
    pass


class _MyLoadPlanner(DefaultLoadPlanner):
    pass


_HANDED_OFF_SAVES = [
    {"storage_writer": "_MyWriter"},
    {"planner": _MyPlanner()},
    {"planner": DefaultSavePlanner(dedup_save_to_lowest_rank=True)},
    {"planner": DefaultSavePlanner(flatten_state_dict=False)},
    {"storage_writer": "single_file_per_rank"},
    {"storage_writer": "safetensors"},  # that DCP's default reader itself cannot read back
    {"storage_writer": "fsspec_options"},
    {"use_collectives": False},
]


def _writer(kind: str, path: str):
    return {
        "_MyWriter": lambda: _MyWriter(path),
        "single_file_per_rank": lambda: FileSystemWriter(path, single_file_per_rank=False),
        "safetensors": lambda: FileSystemWriter(
            path, serialization_format=SerializationFormat.SAFETENSORS
        ),
        "fsspec_options": lambda: FsspecWriter(path, auto_mkdir=True),
    }[kind]()


@pytest.mark.parametrize("kwargs", _HANDED_OFF_SAVES)
def test_what_slipstream_cannot_serve_is_saved_by_dcp_itself(tmp_path, kwargs):
    kwargs = dict(kwargs)
    path = str(tmp_path / "ck")
    if isinstance(kwargs.get("storage_writer"), str):
        kwargs["storage_writer"] = _writer(kwargs["storage_writer"], path)
    else:
        kwargs["checkpoint_id"] = path
    state = _state()
    metadata = ss.save(state, **kwargs)
    assert isinstance(metadata, Metadata)
    assert not (tmp_path / "ck" / ".slipstream.json").exists(), "DCP wrote it, not slipstream"
    if getattr(kwargs.get("storage_writer"), "serialization_format", None) is not (
        SerializationFormat.SAFETENSORS
    ):
        loaded = _empty()
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
        assert _equal(loaded, state)


def test_a_hand_off_is_logged_once_naming_why(tmp_path, caplog):
    class _OnlyHere(FileSystemWriter):
        pass

    caplog.set_level("INFO", logger="slipstream.dcp")
    for i in range(2):
        ss.save(_state(), storage_writer=_OnlyHere(str(tmp_path / f"ck{i}")))
    lines = [r.getMessage() for r in caplog.records if "_OnlyHere" in r.getMessage()]
    assert len(lines) == 1 and "torch.distributed.checkpoint" in lines[0]


def test_save_without_a_location_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"save needs checkpoint_id="):
        ss.save(_state())


def test_what_dcp_cannot_reach_is_not_handed_to_it():
    # slipstream's own storage arguments mean nothing to DCP: refused, naming why DCP runs.
    with pytest.raises(ValueError, match=r"in-process storage.*planner: .*_MyPlanner"):
        ss.save(_state(), "memory://bucket/ck", planner=_MyPlanner())
    with pytest.raises(ValueError, match=r"storage_options=.*planner: .*_MyPlanner"):
        ss.save(_state(), "/tmp/x", planner=_MyPlanner(), storage_options={"region": "x"})


def test_async_save_serves_process_checkpointers_and_default_stagers(tmp_path):
    path = str(tmp_path / "ck")
    ss.async_save(_state(), path, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(30)
    assert os.path.exists(os.path.join(path, ".slipstream.json")), "slipstream wrote it"
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        state = _state()
        response = ss.async_save(state, str(tmp_path / "ck2"), async_stager=stager)
        assert isinstance(response, ss.AsyncSaveResponse)
        response.result(30)
    finally:
        stager.close()
    assert os.path.exists(os.path.join(tmp_path / "ck2", ".slipstream.json"))
    loaded = _empty()
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck2"), no_dist=True)
    assert _equal(loaded, state)


def test_async_save_handed_to_dcp_still_answers_as_slipstream_does(tmp_path):
    state = _state()
    response = ss.async_save(state, storage_writer=_MyWriter(str(tmp_path / "ck")))
    assert response.staging_completion.done()
    assert isinstance(response.metadata(30), Metadata)
    assert not (tmp_path / "ck" / ".slipstream.json").exists()
    loaded = _empty()
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert _equal(loaded, state)


def test_load_hands_to_dcp_only_when_trusted(tmp_path):
    # DCP unpickles values with no allow-list: ss.load hands it a load only with trusted=True.
    state = _state()
    ss.save(state, tmp_path / "ck")
    path = str(tmp_path / "ck")

    class _MyReader(FileSystemReader):
        pass

    with pytest.raises(ss.UnsafeCheckpointError, match=r"storage_reader: .*_MyReader.*trusted"):
        ss.load(_empty(), storage_reader=_MyReader(path))
    with pytest.raises(ss.UnsafeCheckpointError, match=r"planner: .*_MyLoadPlanner"):
        ss.load(_empty(), path, planner=_MyLoadPlanner())
    for kwargs in (
        {"storage_reader": _MyReader(path)},
        {"checkpoint_id": path, "planner": _MyLoadPlanner()},
        {"checkpoint_id": path, "planner": DefaultLoadPlanner(allow_partial_load=True)},
    ):
        loaded = _empty()
        ss.load(loaded, trusted=True, **kwargs)
        assert _equal(loaded, state)
    with pytest.raises(ValueError, match=r"load needs checkpoint_id="):
        ss.load(_empty())


def _no_dist_saves(rank, world_size, root):
    # Each rank saves its own state alone: no rank waits for the other (rank 1 saves twice
    # while rank 0 saves once), and each checkpoint is whole.
    state = {"w": torch.full((4,), float(rank)), "rank": rank}
    for i in range(1 + rank):
        metadata = ss.save(state, os.path.join(root, f"r{rank}_{i}"), no_dist=True, timeout=10)
        assert set(metadata.state_dict_metadata) == {"w", "rank"}


def test_no_dist_saves_each_process_alone(tmp_path):
    run_workers(_no_dist_saves, 2, str(tmp_path), timeout=90)
    for name, rank in (("r0_0", 0), ("r1_0", 1), ("r1_1", 1)):
        loaded = {"w": torch.zeros(4), "rank": -1}
        ss.load(loaded, tmp_path / name, no_dist=True)
        assert torch.equal(loaded["w"], torch.full((4,), float(rank))) and loaded["rank"] == rank


def _metadata_on_every_rank(rank, world_size, root):
    state = {"shared": torch.arange(8.0), f"own{rank}": torch.full((3,), float(rank))}
    metadata = ss.save(state, os.path.join(root, "ck"))
    on_disk = FileSystemReader(os.path.join(root, "ck")).read_metadata()
    assert metadata.storage_meta.save_id == on_disk.storage_meta.save_id
    assert set(metadata.state_dict_metadata) == {"shared", "own0", "own1"}


def test_every_rank_gets_the_committed_metadata(tmp_path):
    run_workers(_metadata_on_every_rank, 2, str(tmp_path), timeout=90)
