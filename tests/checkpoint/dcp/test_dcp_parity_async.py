"""``slipstream.dcp.async_save`` on CPU, for every stager and checkpointer type DCP 2.13
takes, beside ``torch.distributed.checkpoint.async_save`` given the same arguments: the same
return type, the state free once staged, the checkpoint holding what was staged; a failing
writer's error reaching the futures; a second save started while one is in flight.
(PyTorch's own DCP test suite runs ``async_save`` only on GPUs.)"""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from checkpoint_states import small_state
from fault_storage import FaultStorage
from torch.distributed.checkpoint.staging import (
    AsyncStager,
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import slipstream.dcp as dcp
from slipstream.checkpoint.storage import LocalStorage

TIMEOUT = 30.0


def _state() -> dict[str, Any]:
    """A small state with a tag: a value that is not a tensor."""
    return small_state(4, shape=(64, 32), tag="x")


def _blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(64, 32), "b": torch.zeros(7)}, "step": 0, "tag": ""}


def _mutate(state: dict[str, Any]) -> None:
    """What a training step does to the state right after staging."""
    state["model"]["w"].add_(1.0)
    state["model"]["b"].zero_()
    state["step"] += 1


def _loads_as(path: str, want: dict[str, Any]) -> None:
    loaded = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.load(loaded, checkpoint_id=path)
    assert torch.equal(loaded["model"]["w"], want["model"]["w"])
    assert torch.equal(loaded["model"]["b"], want["model"]["b"])
    assert (loaded["step"], loaded["tag"]) == (want["step"], want["tag"])


class _OwnStager(AsyncStager):
    """A user's own stager: DCP's to run (its ``stage`` may do anything)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {
            k: {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v
            for k, v in state_dict.items()
        }

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _options(shared: bool, at_once: bool) -> StagingOptions:
    return StagingOptions(False, shared, at_once, False)  # pinned/non-blocking need CUDA


STAGERS = {
    # name: (arguments for async_save given a path, served by slipstream); DCP runs each on
    # CPU too, but for "writer_cached", whose writer stages into pinned memory (CUDA only).
    "none": (lambda path: {"checkpoint_id": path}, True),
    "writer": (lambda path: {"storage_writer": torch_dcp.FileSystemWriter(path)}, True),
    "writer_cached": (
        lambda path: {
            "storage_writer": torch_dcp.FileSystemWriter(path, cache_staged_state_dict=True)
        },
        True,
    ),
    "default": (
        lambda path: {"checkpoint_id": path, "async_stager": DefaultStager(_options(False, False))},
        True,
    ),
    "default_shm": (
        lambda path: {"checkpoint_id": path, "async_stager": DefaultStager(_options(True, False))},
        True,
    ),
    "default_async": (
        lambda path: {"checkpoint_id": path, "async_stager": DefaultStager(_options(False, True))},
        True,
    ),
    "default_async_shm": (
        lambda path: {"checkpoint_id": path, "async_stager": DefaultStager(_options(True, True))},
        True,
    ),
    "blocking": (
        lambda path: {"checkpoint_id": path, "async_stager": BlockingAsyncStager()},
        False,
    ),
    "own": (lambda path: {"checkpoint_id": path, "async_stager": _OwnStager()}, False),
}


def _close(arguments: dict[str, Any]) -> None:
    stager = arguments.get("async_stager")
    if stager is not None:
        stager.close()


def _run(module: Any, arguments: dict[str, Any], kind: AsyncCheckpointerType) -> dict[str, Any]:
    """Save through ``module``, mutate once staged, wait; returns what was staged."""
    state = _state()
    staged = _state()
    returned = module.async_save(state, async_checkpointer_type=kind, **arguments)
    if isinstance(returned, AsyncSaveResponse):
        returned.staging_completion.result(TIMEOUT)
        upload = returned.upload_completion
    else:
        assert isinstance(returned, Future)
        upload = returned
    _mutate(state)
    metadata = upload.result(TIMEOUT)
    assert isinstance(metadata, torch_dcp.Metadata)
    return {"type": type(returned), "staged": staged}


COMBINATIONS = [
    (stager, kind)
    for stager, (_, served) in STAGERS.items()
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS)
    if served or kind is AsyncCheckpointerType.THREAD  # DCP's process one: see below
]


@pytest.mark.parametrize(("stager", "kind"), COMBINATIONS)
def test_every_stager_and_checkpointer_type(tmp_path, stager, kind):
    make, served = STAGERS[stager]
    theirs_path, ours_path = str(tmp_path / "torch"), str(tmp_path / "slipstream")
    theirs_args, ours_args = make(theirs_path), make(ours_path)
    try:
        # DCP's process checkpointer needs a process group; its return type is the thread's.
        if stager == "writer_cached":
            theirs = {"type": Future}
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = _run(torch_dcp, theirs_args, AsyncCheckpointerType.THREAD)
            _loads_as(theirs_path, theirs["staged"])
        ours = _run(dcp, ours_args, kind)
    finally:
        _close(theirs_args)
        _close(ours_args)
    assert issubclass(ours["type"], theirs["type"]), (ours["type"], theirs["type"])
    _loads_as(ours_path, ours["staged"])
    assert os.path.exists(os.path.join(ours_path, ".slipstream.json")) == served


def test_a_handed_off_process_checkpointer_fails_as_dcps_does(tmp_path):
    errors = []
    for module in (torch_dcp, dcp):
        with pytest.raises(ValueError, match="process group") as info:
            module.async_save(
                _state(),
                checkpoint_id=str(tmp_path / module.__name__),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=BlockingAsyncStager(),
            )
        errors.append(str(info.value))
    assert errors[0] == errors[1]


# --- a failing writer ----------------------------------------------------------------


class _FailingWriter(torch_dcp.FileSystemWriter):
    """A writer of one's own (handed to DCP) whose data writes fail."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device (test writer)")


@pytest.mark.parametrize("at_once", [False, True], ids=["future", "response"])
def test_a_failing_storage_fails_the_upload_future_and_frees_the_state(tmp_path, at_once):
    storage = FaultStorage(LocalStorage(str(tmp_path / "ck")))
    storage.faults.fail("write", OSError(28, "No space left on device (test storage)"))
    stager = DefaultStager(_options(False, at_once))
    try:
        returned = dcp.async_save(_state(), checkpoint_id=storage, async_stager=stager)
        assert isinstance(returned, AsyncSaveResponse if at_once else Future)
        returned.staging_completion.result(TIMEOUT)  # staged: the state is the caller's again
        with pytest.raises(Exception, match="No space left on device") as info:
            returned.upload_completion.result(TIMEOUT)
        assert "test storage" in str(info.value)
        if not at_once:
            with pytest.raises(Exception, match="No space left on device"):
                returned.result(TIMEOUT)
    finally:
        stager.close()
    assert not (tmp_path / "ck" / ".metadata").exists(), "nothing looks committed"
    after = str(tmp_path / "after")
    dcp.async_save(_state(), checkpoint_id=after).result(TIMEOUT)  # the next save works
    _loads_as(after, _state())


@pytest.mark.parametrize("at_once", [False, True], ids=["future", "response"])
@pytest.mark.parametrize("module", [torch_dcp, dcp], ids=["torch", "slipstream"])
def test_a_failing_writer_handed_to_dcp_fails_the_upload_future(tmp_path, module, at_once):
    stager = DefaultStager(_options(False, at_once))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            returned = module.async_save(
                _state(), storage_writer=_FailingWriter(str(tmp_path / "ck")), async_stager=stager
            )
            if isinstance(returned, AsyncSaveResponse):
                returned.staging_completion.result(TIMEOUT)
                upload = returned.upload_completion
            else:
                assert not at_once
                upload = returned
            with pytest.raises(torch_dcp.CheckpointException, match="test writer"):
                upload.result(TIMEOUT)
    finally:
        stager.close()
    assert isinstance(returned, AsyncSaveResponse) == at_once
    assert not (tmp_path / "ck" / ".metadata").exists()


# --- a second save while one is in flight --------------------------------------------


def test_a_second_async_save_while_the_first_is_in_flight(tmp_path):
    storage = FaultStorage(LocalStorage(str(tmp_path / "first")))
    gate = storage.faults.gate("write")
    state = _state()
    first_state = _state()
    first = dcp.async_save(state, checkpoint_id=storage)
    assert first.staging_completion.done()
    _mutate(state)
    second_state = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "step": state["step"],
        "tag": state["tag"],
    }
    started: list[Any] = []
    second_path = str(tmp_path / "second")
    caller = threading.Thread(
        target=lambda: started.append(dcp.async_save(state, checkpoint_id=second_path)),
        daemon=True,
    )
    caller.start()
    caller.join(0.5)
    assert not first.done(), "the first save is held at its write"
    gate.set()
    caller.join(TIMEOUT)
    assert not caller.is_alive(), "the second async_save never returned"
    (second,) = started
    assert first.result(TIMEOUT).storage_meta.save_id != second.result(TIMEOUT).storage_meta.save_id
    _mutate(state)
    _loads_as(str(tmp_path / "first"), first_state)
    _loads_as(second_path, second_state)
