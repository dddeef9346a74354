"""Readers beside a writer: a step deleted by retention while it loads fails with an error
that says so (or, on the local disk, the reader keeps the bytes it opened), and a
read-only ``Checkpointer`` never deletes the writer's spare files.

Deletion is driven deterministically: a :class:`FaultStorage` hook on the reader's own
storage runs the writer's next saves (whose retention deletes the step being loaded) at
the reader's first data read, or before it sizes the data files.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from dist_utils import run_workers
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint.format.names import SPARE_DIR
from slipstream.checkpoint.storage import resolve_storage

DELETED = "was deleted while it was being loaded"


def _tensors(step: int) -> dict:
    return {"w": torch.arange(4096.0) + step}


def _with_value(step: int) -> dict:
    return dict(_tensors(step), step=step)


def _root(backend: str, tmp_path) -> str:
    if backend == "local":
        return str(tmp_path / "run")
    return f"memory://readers-{uuid.uuid4().hex[:8]}/run"


def _load_while_retention_deletes(root: str, state, operation: str, then_saves=(2,)):
    """Save step 1 (``keep_last=1``), then load it through a storage whose first
    ``operation`` first has the writer save ``then_saves`` (retention deletes step 1).
    Returns the target loaded into, or the error the load raised."""
    with ss.Checkpointer(root, keep_last=1) as writer:
        writer.save(1, state(1)).result(30)
        reader = FaultStorage(resolve_storage(writer.path(1)))

        def retention_deletes_step_1(*args) -> None:
            for step in then_saves:
                writer.save(step, state(step)).result(30)
            assert writer.steps() == [then_saves[-1]]

        reader.faults.hook(operation, retention_deletes_step_1, times=1)
        target = state(-1)
        try:
            ss.load(target, reader)
        except ss.CheckpointError as exc:
            return exc
        finally:
            assert reader.faults.names(operation), f"the load never reached {operation}"
        return target


def test_a_step_deleted_while_it_loads_fails_saying_so(tmp_path):
    error = _load_while_retention_deletes(_root("memory", tmp_path), _tensors, "read")
    assert isinstance(error, ss.CheckpointError), error
    assert not isinstance(error, ss.CorruptCheckpointError), repr(error)
    assert DELETED in str(error) and "step_1" in str(error), error
    assert isinstance(error.__cause__, ss.CorruptCheckpointError)


def test_a_local_reader_keeps_the_bytes_it_opened_while_retention_recycles_files(tmp_path):
    """On the local disk the reader opened the data file before its first read, so the
    deletion cannot take its bytes: the load completes with step 1, even though two more
    saves with file reuse ran meanwhile (the file it holds open was not recycled)."""
    target = _load_while_retention_deletes(
        _root("local", tmp_path), _with_value, "read", then_saves=(2, 3)
    )
    assert isinstance(target, dict), repr(target)
    assert torch.equal(target["w"], _tensors(1)["w"]) and target["step"] == 1


@pytest.mark.parametrize(
    "backend, operation, state",
    [
        ("memory", "read", _with_value),  # the value's read is the first read
        ("memory", "size", _tensors),
        ("local", "size", _tensors),
    ],
    ids=["memory-value-read", "memory-size", "local-size"],
)
def test_a_deletion_found_at_any_read_of_the_load_is_reported_as_one(
    tmp_path, backend, operation, state
):
    error = _load_while_retention_deletes(_root(backend, tmp_path), state, operation)
    assert isinstance(error, ss.CheckpointError), error
    assert not isinstance(error, ss.CorruptCheckpointError), repr(error)
    assert DELETED in str(error), error


def _read_only(rank: int, world: int, root: str) -> None:
    with ss.Checkpointer(root) as ck:
        assert ck.steps() == [2]
        target = _with_value(-1)
        assert ck.load(target) == 2
        assert torch.equal(target["w"], _tensors(2)["w"]) and target["step"] == 2


def test_a_read_only_checkpointer_closing_elsewhere_keeps_the_writer_s_spares(tmp_path):
    spare_dir = tmp_path / SPARE_DIR
    with ss.Checkpointer(tmp_path, keep_last=1) as writer:
        for step in (1, 2):
            writer.save(step, _with_value(step)).result(30)
        spares = sorted(os.listdir(spare_dir))
        if not spares:
            pytest.skip("this filesystem grants no leases: retired files are deleted, not kept")
        run_workers(_read_only, 1, str(tmp_path), timeout=60)  # rank 0 of its own job
        assert sorted(os.listdir(spare_dir)) == spares
        writer.save(3, _with_value(3)).result(30)
        assert writer.steps() == [3]
    assert not spare_dir.exists(), "the writer's own close keeps its spares"
