"""World sizes 1, 2 and 4, resharding between them, and DCP interop both ways.

One checkpoint is saved per world size (1 rank: plain tensors; 2 and 4 ranks: DTensors
sharded ``Shard(0)``, ``Shard(1)`` and replicated), by slipstream and, with 2 ranks, by
``dcp.save``. Every world size then loads every checkpoint saved before it, with
``ss.load`` and with ``dcp.load``; ranks dump the local shards they got and the tests
compare each with the slice of the full tensor that rank must hold. Spawned runs are
few and shared through module fixtures (spawning costs seconds).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import (
    PLAIN,
    TENSORS,
    dtensor_state,
    expected_local,
    local_parts,
    plain_state,
)
from dist_utils import run_workers
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import slipstream as ss
from slipstream.checkpoint.load.reader import CheckpointReader


def _dump(got_dir: str, scenario: str, rank: int, state: dict) -> None:
    with open(os.path.join(got_dir, f"{scenario}.{rank}.pkl"), "wb") as f:
        pickle.dump(local_parts(state), f)


def _load_both_ways(mesh, ckpt: str, name: str, got_dir: str, rank: int) -> None:
    target = dtensor_state(mesh, fill=-7.0)
    ss.load(target, ckpt)
    _dump(got_dir, f"ss.load {name}", rank, target)
    target = dtensor_state(mesh, fill=-7.0)
    dcp.load(target, checkpoint_id=ckpt)
    _dump(got_dir, f"dcp.load {name}", rank, target)


def _two_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    got = os.path.join(root, "got")
    ss.save(dtensor_state(mesh), os.path.join(root, "ss2"))
    dcp.save(dtensor_state(mesh), checkpoint_id=os.path.join(root, "dcp2"))
    for ckpt in ("ss1", "ss2", "dcp2"):
        _load_both_ways(mesh, os.path.join(root, ckpt), f"{ckpt}->2", got, rank)


def _four_ranks(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    got = os.path.join(root, "got")
    ss.save(dtensor_state(mesh), os.path.join(root, "ss4"))
    for ckpt in ("ss1", "ss2", "dcp2", "ss4"):
        _load_both_ways(mesh, os.path.join(root, ckpt), f"{ckpt}->4", got, rank)
    # Two independent 2-rank meshes ({0, 1} and {2, 3}) each load the 4-rank checkpoint.
    halves = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))["inner"]
    target = dtensor_state(halves, fill=-7.0)
    ss.load(target, os.path.join(root, "ss4"))
    _dump(got, "ss.load ss4->2", rank, target)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """Checkpoints saved by 1, 2 and 4 ranks, and what every rank loaded from them."""
    root = tmp_path_factory.mktemp("reshard")
    (root / "got").mkdir()
    ss.save(plain_state(), root / "ss1")
    run_workers(_two_ranks, 2, str(root), timeout=60)
    run_workers(_four_ranks, 4, str(root), timeout=90)
    return root


def _got(root: Path, scenario: str, rank: int) -> dict:
    with open(root / "got" / f"{scenario}.{rank}.pkl", "rb") as f:
        return pickle.load(f)


def _assert_rank_holds_its_shards(got: dict, world: int, rank: int, scenario: str) -> None:
    assert got["step"] == 42, scenario
    for name in [*TENSORS, *PLAIN]:
        want = expected_local(name, world, rank)
        assert got[name].dtype == want.dtype, (scenario, name)
        assert torch.equal(got[name], want), (scenario, rank, name)


@pytest.mark.parametrize("loader", ["ss.load", "dcp.load"])
@pytest.mark.parametrize("saved_by", ["ss1", "ss2", "dcp2"])
def test_two_ranks_each_load_exactly_their_shards(checkpoints, saved_by, loader):
    for rank in range(2):
        scenario = f"{loader} {saved_by}->2"
        _assert_rank_holds_its_shards(_got(checkpoints, scenario, rank), 2, rank, scenario)


@pytest.mark.parametrize("loader", ["ss.load", "dcp.load"])
@pytest.mark.parametrize("saved_by", ["ss1", "ss2", "dcp2", "ss4"])
def test_four_ranks_each_load_exactly_their_shards(checkpoints, saved_by, loader):
    for rank in range(4):
        scenario = f"{loader} {saved_by}->4"
        _assert_rank_holds_its_shards(_got(checkpoints, scenario, rank), 4, rank, scenario)


def test_four_rank_checkpoint_loads_into_two_ranks(checkpoints):
    for rank in range(4):
        got = _got(checkpoints, "ss.load ss4->2", rank)
        _assert_rank_holds_its_shards(got, 2, rank % 2, f"ss4->2 rank {rank}")


@pytest.mark.parametrize("saved_by", ["ss2", "ss4", "dcp2"])
def test_sharded_checkpoints_load_whole_into_one_rank(checkpoints, saved_by):
    target = plain_state(fill=-7.0)
    ss.load(target, checkpoints / saved_by)
    _assert_rank_holds_its_shards(local_parts(target), 1, 0, saved_by)


@pytest.mark.parametrize("saved_by", ["ss2", "ss4"])
def test_dcp_load_on_one_rank_reads_slipstream_sharded_checkpoints(checkpoints, saved_by):
    target = plain_state(fill=-7.0)
    dcp.load(target, checkpoint_id=str(checkpoints / saved_by), no_dist=True)
    _assert_rank_holds_its_shards(local_parts(target), 1, 0, saved_by)


def _storage_entries(root: Path, fqn: str) -> list:
    reader = CheckpointReader(root)
    try:
        storage = reader.metadata.storage_data
        return [(idx, info) for idx, info in storage.items() if idx.fqn == fqn]
    finally:
        reader.close()


@pytest.mark.parametrize("saved_by", ["ss2", "ss4"])
def test_replicated_tensors_are_written_once(checkpoints, saved_by):
    with open(checkpoints / saved_by / ".slipstream.json") as f:
        files = json.load(f)["records"]
    for fqn in ["model.rep", *(f"model.{p}" for p in PLAIN)]:
        entries = _storage_entries(checkpoints / saved_by, fqn)
        assert len(entries) == 1, (fqn, entries)
        index, _ = entries[0]
        assert index == MetadataIndex(fqn, torch.Size([0, 0]), index.index)
        holders = [name for name, records in files.items() if f"{fqn}@0,0" in records]
        assert len(holders) == 1, (fqn, holders)


def test_replicated_tensors_are_spread_over_the_writing_ranks(checkpoints):
    files = {_storage_entries(checkpoints / "ss4", f"model.{p}")[0][1].relative_path for p in PLAIN}
    assert files == {f"__{r}_0.distcp" for r in range(4)}


def test_sharded_tensor_metadata_lists_one_chunk_per_shard(checkpoints):
    entries = _storage_entries(checkpoints / "ss4", "model.rows")
    offsets = sorted(tuple(idx.offset) for idx, _ in entries)
    assert offsets == [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert {info.relative_path for _, info in entries} == {f"__{r}_0.distcp" for r in range(4)}


def _only_one_replicated_tensor(rank: int, world: int, root: str) -> None:
    state = {"w": torch.arange(100.0), "step": 9}
    ss.save(state, os.path.join(root, "ck"))
    target = {"w": torch.zeros(100), "step": 0}
    ss.load(target, os.path.join(root, "ck"))
    assert torch.equal(target["w"], state["w"]) and target["step"] == 9


def test_rank_with_nothing_of_its_own_to_write_still_saves(tmp_path):
    run_workers(_only_one_replicated_tensor, 2, str(tmp_path), timeout=60)
    entries = _storage_entries(tmp_path / "ck", "w")
    assert len(entries) == 1
    target = {"w": torch.zeros(100), "step": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(target["w"], torch.arange(100.0)) and target["step"] == 9


def _trained_model(rank_count: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model after one AdamW step, identical whatever the world size (seeded)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    if rank_count > 1:
        from torch.distributed.fsdp import fully_shard

        # on CPU also where a GPU is present: the reference step runs on CPU
        fully_shard(model, mesh=init_device_mesh("cpu", (rank_count,)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    return model, optim


def _save_fully_sharded(rank: int, world: int, root: str) -> None:
    model, optim = _trained_model(world)
    model_sd, optim_sd = get_state_dict(model, optim)
    assert isinstance(model_sd["0.weight"], DTensor)
    ss.save({"model": model_sd, "optim": optim_sd}, os.path.join(root, "fsdp"))


def test_fully_shard_state_saved_by_two_ranks_loads_into_one(tmp_path):
    run_workers(_save_fully_sharded, 2, str(tmp_path), timeout=60)
    want_model, want_optim = _trained_model(1)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model_sd, optim_sd = get_state_dict(model, optim)
    ss.load({"model": model_sd, "optim": optim_sd}, tmp_path / "fsdp")
    for (name, got), want in zip(model.named_parameters(), want_model.parameters(), strict=True):
        assert torch.equal(got, want), name
        got_state = optim_sd["state"][name]
        assert torch.equal(got_state["exp_avg"], want_optim.state[want]["exp_avg"]), name
        assert torch.equal(got_state["exp_avg_sq"], want_optim.state[want]["exp_avg_sq"]), name
