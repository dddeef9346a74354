"""Checkpointer: retention, committed steps only, resume, thread ownership, two ranks."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from checkpoint_states import step_state
from dist_utils import run_workers
from fault_storage import FaultStorage
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import slipstream as ss
from slipstream.checkpoint.format.names import METADATA_FILE, SPARE_DIR
from slipstream.checkpoint.storage import resolve_storage


def _save_steps(ck: ss.Checkpointer, steps) -> None:
    for step in steps:
        ck.save(step, step_state(step)).result(60)


def _checkpointer_with_faults(
    root, reuse_files: bool = True, **kwargs
) -> tuple[ss.Checkpointer, FaultStorage]:
    """A ``Checkpointer`` on the local backend it would make for ``root`` itself, with
    faults injectable through the returned storage."""
    spare = SPARE_DIR if reuse_files else None
    storage = FaultStorage(resolve_storage(root, spare_dir_name=spare))
    return ss.Checkpointer(storage, **kwargs), storage


def _fail_metadata_put(storage: FaultStorage, message: str) -> None:
    """Make every commit's ``.metadata`` put (the commit point) raise ``OSError(message)``."""
    storage.faults.fail("put", OSError(message), when=lambda name: name == METADATA_FILE)


@pytest.mark.parametrize("reuse_files", [True, False])
def test_retention_keeps_the_last_n_committed_steps(tmp_path, reuse_files):
    with ss.Checkpointer(tmp_path, keep_last=2, reuse_files=reuse_files) as ck:
        _save_steps(ck, range(1, 6))
        assert ck.steps() == [4, 5]
        spares = [".spare"] if reuse_files else []
        assert sorted(os.listdir(tmp_path)) == spares + ["step_4", "step_5"]
    assert sorted(os.listdir(tmp_path)) == ["step_4", "step_5"]


def test_retention_deletes_nothing_until_a_newer_step_commits(tmp_path):
    ck, storage = _checkpointer_with_faults(tmp_path, keep_last=1)
    with ck:
        _save_steps(ck, [1])
        _fail_metadata_put(storage, "simulated failure while publishing .metadata")
        with pytest.raises(ss.CheckpointError, match="simulated failure"):
            ck.save(2, step_state(2)).result(60)
        storage.faults.clear()
        assert ck.steps() == [1]
        target = step_state(-1)
        assert ck.load(target) == 1 and target["step"] == 1


def test_steps_and_latest_ignore_uncommitted_directories(tmp_path):
    with ss.Checkpointer(tmp_path, keep_last=None) as ck:
        assert ck.latest() is None and ck.steps() == []
        _save_steps(ck, [3, 7])
        (tmp_path / "step_9").mkdir()
        (tmp_path / "step_9" / "__0_0.distcp").write_bytes(b"partial")
        (tmp_path / "step_12").write_bytes(b"a file, not a checkpoint")
        (tmp_path / "notes").mkdir()
        assert ck.steps() == [3, 7]
        assert ck.latest() == 7


def test_next_save_removes_directories_of_saves_that_never_committed(tmp_path):
    with ss.Checkpointer(tmp_path, keep_last=None) as ck:
        _save_steps(ck, [1])
        for partial in ("step_2", "step_9"):
            (tmp_path / partial).mkdir()
            (tmp_path / partial / "__0_0.distcp").write_bytes(b"partial")
        _save_steps(ck, [3])
        steps = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
        assert steps == ["step_1", "step_3"]


def test_load_defaults_to_the_latest_step_and_returns_it(tmp_path):
    with ss.Checkpointer(tmp_path, keep_last=3) as ck:
        with pytest.raises(ss.CheckpointError, match="no committed checkpoint"):
            ck.load(step_state(-1))
        _save_steps(ck, [10, 20])
        target = step_state(-1)
        assert ck.load(target) == 20
        assert target["step"] == 20 and torch.equal(target["w"], step_state(20)["w"])
        assert ck.load(target, step=10) == 10
        assert target["step"] == 10 and torch.equal(target["w"], step_state(10)["w"])


@pytest.mark.parametrize("reuse_files", [True, False])
def test_half_deleted_old_step_is_never_listed(tmp_path, reuse_files):
    """Retention that dies part way through deleting a step must not leave it listed."""

    def dies_after_the_data_file(location, name) -> None:
        # ``location`` is the step's own backend: delete its data file, then die before
        # the rest of it (the directory) is gone.
        data = location.path / "__0_0.distcp"
        assert data.exists()
        data.unlink()
        raise OSError(f"simulated crash while deleting {name}")

    ck, storage = _checkpointer_with_faults(tmp_path, reuse_files, keep_last=1)
    with ck:
        _save_steps(ck, [1])
        step_1 = ck.path(1)
        storage.faults.hook("delete", dies_after_the_data_file, when=lambda n: n == step_1)
        _save_steps(ck, [2])
        storage.faults.clear()
        assert storage.faults.names("delete")[-1] == step_1, "the old step was never deleted"
        assert os.path.isdir(step_1)
        assert ck.steps() == [2]
        _save_steps(ck, [3])
        assert ck.steps() == [3]
        assert ck.load(step_state(-1)) == 3
    assert sorted(os.listdir(tmp_path)) == ["step_3"]


def test_context_manager_finishes_the_save_in_flight_and_joins_its_threads(tmp_path):
    before = set(threading.enumerate())
    with ss.Checkpointer(tmp_path) as ck:
        response = ck.save(1, step_state(1))
    assert response.upload_completion.done() and response.upload_completion.exception() is None
    assert ck.steps() == [1]
    leftover = [t for t in threading.enumerate() if t not in before]
    assert leftover == []


def test_wait_raises_the_error_of_the_last_save(tmp_path):
    ck, storage = _checkpointer_with_faults(tmp_path)
    with ck:
        _fail_metadata_put(storage, "simulated disk error")
        ck.save(1, step_state(1))
        with pytest.raises(ss.CheckpointError, match="simulated disk error"):
            ck.wait(60)


def _two_rank_run(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict:
        full = torch.arange(80.0).reshape(8, 10) + step
        return {
            "w": distribute_tensor(full, mesh, [Shard(0)]),
            "shared": torch.ones(5) * step,
            "step": step,
        }

    with ss.Checkpointer(root, keep_last=2) as ck:
        for step in range(1, 5):
            ck.save(step, state(step)).result(60)
        assert ck.steps() == [3, 4], ck.steps()
        target = state(0)
        assert ck.load(target) == 4
        assert torch.equal(target["w"].to_local(), state(4)["w"].to_local())
        assert torch.equal(target["shared"], torch.ones(5) * 4) and target["step"] == 4


def test_two_rank_checkpointer_saves_retains_and_resumes(tmp_path):
    run_workers(_two_rank_run, 2, str(tmp_path), timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    target = {"w": torch.zeros(8, 10), "shared": torch.zeros(5), "step": 0}
    with ss.Checkpointer(tmp_path) as ck:
        assert ck.load(target) == 4
    assert torch.equal(target["w"], torch.arange(80.0).reshape(8, 10) + 4)


def _global_saver_then_checkpointer(rank: int, world: int, root: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    ss.save({"a": torch.full((100,), 1.0), f"a{rank}": torch.zeros(2)}, os.path.join(root, "a"))
    with ss.Checkpointer(os.path.join(root, "run"), keep_last=None) as ck:
        state = {"b": torch.full((300,), 2.0), f"b{rank}": torch.ones(3) * rank}
        # Rank 1 goes first, so messages left by the first saver are there to be misread.
        if rank == 0:
            store.wait(["test/rank1_saving"], timedelta(seconds=30))
            ck.save(1, state).result(30)
        else:
            store.set("test/rank1_saving", "1")
            ck.save(1, state).result(30)
            assert os.path.exists(os.path.join(root, "run", "step_1", ".metadata"))


def test_checkpointer_beside_ss_save_in_one_job_keeps_its_own_coordination(tmp_path):
    run_workers(_global_saver_then_checkpointer, 2, str(tmp_path), timeout=60)
    target = {"b": torch.zeros(300), "b0": torch.ones(3), "b1": torch.zeros(3)}
    with ss.Checkpointer(tmp_path / "run") as ck:
        assert ck.load(target) == 1
    assert torch.equal(target["b"], torch.full((300,), 2.0))
    assert torch.equal(target["b0"], torch.zeros(3)) and torch.equal(target["b1"], torch.ones(3))


def test_loading_a_step_that_never_committed_names_the_newest_complete_one(tmp_path):
    with ss.Checkpointer(tmp_path, keep_last=None) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((4,), float(step))})
            ckpt.wait()
    os.remove(tmp_path / "step_2" / ".metadata")  # as a save killed before its commit leaves it
    reader = ss.Checkpointer(tmp_path)
    assert reader.latest() == 1
    named = r"step 2 .*no \.metadata: its save did not commit.*the newest complete step is 1"
    with pytest.raises(ss.CheckpointError, match=named):
        reader.load({"w": torch.zeros(4)}, 2)
    assert reader.load(target := {"w": torch.zeros(4)}) == 1
    assert torch.equal(target["w"], torch.ones(4))
    reader.close()
