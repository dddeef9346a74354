"""``slipstream.dcp`` stands in for ``torch.distributed.checkpoint``: the same calls give the
same return types, the same moment the state may change again, and the same loads.

Each call is made the same way through both modules and compared: what they return, what
is on disk, what loads back.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from checkpoint_states import small_state
from safetensors.torch import load_file
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import slipstream as ss
import slipstream.dcp as dcp

_OWN = {"save", "async_save", "load"}


def _state() -> dict:
    """A small state with an optimizer's: a tensor and a value keyed under an int."""
    optim = {"state": {0: {"m": torch.linspace(-1, 1, 64 * 16).reshape(64, 16)}}, "lr": 0.1}
    return small_state(3, shape=(64, 16), optim=optim)


def _blank() -> dict:
    return {
        "model": {"w": torch.zeros(64, 16), "b": torch.zeros(7)},
        "optim": {"state": {0: {"m": torch.zeros(64, 16)}}, "lr": 0.0},
        "step": 0,
    }


def _equal(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and torch.equal(a["model"]["b"], b["model"]["b"])
        and torch.equal(a["optim"]["state"][0]["m"], b["optim"]["state"][0]["m"])
        and a["optim"]["lr"] == b["optim"]["lr"]
        and a["step"] == b["step"]
    )


def test_every_other_public_name_is_dcps_own():
    names = [n for n in dir(torch_dcp) if not n.startswith("_") and n not in _OWN]
    assert "FileSystemWriter" in names and "state_dict_saver" in names
    for name in names:
        assert getattr(dcp, name) is getattr(torch_dcp, name), name
    for name in dcp.__all__:
        if name not in _OWN and name != "SaveFuture":
            assert getattr(dcp, name) is getattr(torch_dcp, name, None) or name in (
                "AsyncCheckpointerType",
                "AsyncSaveResponse",
            )
    assert dcp.AsyncSaveResponse is state_dict_saver.AsyncSaveResponse


def test_async_save_returns_a_future_once_staged(tmp_path):
    state = _state()
    want = _state()
    future = dcp.async_save(state, checkpoint_id=str(tmp_path / "ck"))
    assert isinstance(future, Future)
    assert future.staging_completion.done(), "returned before the state was staged"
    state["model"]["w"].fill_(-1.0)  # what torchtitan's "async" mode does right after
    state["step"] = 99
    metadata = future.result(30)
    assert isinstance(metadata, torch_dcp.Metadata)
    on_disk = torch_dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert metadata.storage_meta.save_id == on_disk.storage_meta.save_id
    assert future.upload_completion.done()
    loaded = _blank()
    torch_dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"))
    assert _equal(loaded, want)


def test_async_stager_gives_dcps_response_at_once_and_sync_stager_a_future(tmp_path):
    async_stager = DefaultStager(StagingOptions(False, False, True, False))
    sync_stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for module, where in ((torch_dcp, "torch"), (dcp, "slipstream")):
            state = _state()
            response = module.async_save(
                state,
                checkpoint_id=str(tmp_path / f"{where}_async"),
                async_checkpointer_type=dcp.AsyncCheckpointerType.PROCESS
                if module is dcp
                else dcp.AsyncCheckpointerType.THREAD,
                async_stager=async_stager,
            )
            assert isinstance(response, state_dict_saver.AsyncSaveResponse), where
            response.staging_completion.result(30)
            assert isinstance(response.upload_completion.result(30), torch_dcp.Metadata), where
            returned = module.async_save(
                _state(), checkpoint_id=str(tmp_path / f"{where}_sync"), async_stager=sync_stager
            )
            assert isinstance(returned, Future), where
            returned.result(30)
    finally:
        async_stager.close()
        sync_stager.close()
    for name in ("slipstream_async", "slipstream_sync"):
        assert (tmp_path / name / ".slipstream.json").exists(), "served by slipstream"
        loaded = _blank()
        torch_dcp.load(loaded, checkpoint_id=str(tmp_path / name))
        assert _equal(loaded, _state())


def test_hugging_face_writer_is_handed_to_dcp_unchanged(tmp_path):
    model = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    for module, where in ((torch_dcp, "torch"), (dcp, "slipstream")):
        writer = dcp.HuggingFaceStorageWriter(path=str(tmp_path / where), save_distributed=False)
        module.save(dict(model), storage_writer=writer)
    (mine,) = (tmp_path / "slipstream").glob("*.safetensors")
    (theirs,) = (tmp_path / "torch").glob("*.safetensors")
    assert mine.name == theirs.name
    got, want = load_file(mine), load_file(theirs)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_load_ignores_keys_it_is_not_asked_for_and_names_missing_ones(tmp_path):
    ss.save(_state(), tmp_path / "ck")
    path = str(tmp_path / "ck")
    for module in (torch_dcp, dcp):
        fewer = {"model": {"w": torch.zeros(64, 16)}}
        module.load(fewer, checkpoint_id=path)
        assert torch.equal(fewer["model"]["w"], _state()["model"]["w"])
    more = _blank()
    more["model"]["extra"] = torch.zeros(2)
    with pytest.raises(torch_dcp.CheckpointException):  # DCP: "Missing key ... model.extra"
        torch_dcp.load(_blank() | {"model": more["model"]}, checkpoint_id=path)
    with pytest.raises(ss.CheckpointError, match=r"missing from the checkpoint: \['model.extra'\]"):
        dcp.load(more, checkpoint_id=path)
    with pytest.raises(ss.CheckpointError, match=r"unexpected keys .*'model.b'"):
        dcp.load({"model": {"w": torch.zeros(64, 16)}}, checkpoint_id=path, strict=True)


def test_empty_state_dict_planner_load_gives_what_dcp_gives(tmp_path):
    # dcp.load fills a shallow copy of the dict it is given (Stateful values resolved), so
    # with this planner the caller's own dict stays empty, through DCP as through
    # slipstream; format_utils' loader (what accelerate's merge calls) fills it.
    ss.save(_state(), tmp_path / "ck")
    path = str(tmp_path / "ck")
    results = []
    for module in (torch_dcp, dcp):
        target: dict = {}
        reader = dcp.FileSystemReader(path)
        module.load(target, storage_reader=reader, planner=_EmptyStateDictLoadPlanner())
        results.append(target)
    assert results[0] == results[1] == {}


def test_rebinding_dcps_own_names_still_hands_off_to_dcp(tmp_path, monkeypatch):
    # The process-wide swap (what Lightning's FSDP strategies need): DCP's names point at
    # slipstream's, and a call slipstream hands back must reach DCP, not come back to itself.
    monkeypatch.setattr(torch_dcp, "save", dcp.save)
    monkeypatch.setattr(torch_dcp, "load", dcp.load)
    monkeypatch.setattr(torch_dcp, "async_save", dcp.async_save)
    model = {"w": torch.randn(8, 4)}
    writer = dcp.HuggingFaceStorageWriter(path=str(tmp_path / "hf"), save_distributed=False)
    torch_dcp.save(dict(model), storage_writer=writer)
    (written,) = (tmp_path / "hf").glob("*.safetensors")
    assert torch.equal(load_file(written)["w"], model["w"])
    ss.save(_state(), tmp_path / "ck")
    target: dict = {}
    reader = dcp.FileSystemReader(str(tmp_path / "ck"))
    torch_dcp.load(target, storage_reader=reader, planner=_EmptyStateDictLoadPlanner())
    assert target == {}
