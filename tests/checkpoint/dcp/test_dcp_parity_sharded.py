"""FSDP1's ``SHARDED_STATE_DICT`` (``ShardedTensor`` values, no device mesh) through
``slipstream.dcp``: saved on 2 gloo ranks, loaded back resharded onto 4 and onto 1 (where
FSDP1 shards nothing: its state dict holds whole tensors), and
exchanged with DCP both ways (what DCP's own ShardedTensor tests, in
test_file_system_checkpoint_cpu.py, assert of ``dcp.save`` / ``dcp.load``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from dist_utils import run_workers
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

import slipstream.dcp as dcp

STEP = 5


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def _reference() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model(0).state_dict().items()}


def _sharded(seed: int) -> tuple[FSDP, dict[str, Any]]:
    wrapped = FSDP(_model(seed), device_id=torch.device("cpu"), use_orig_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1's deprecation warnings
        with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            model_state = wrapped.state_dict()
    if torch.distributed.get_world_size() > 1:  # on one rank FSDP1 shards nothing
        assert all(isinstance(v, ShardedTensor) for v in model_state.values()), model_state
    return wrapped, {"model": model_state, "step": 0}


def _save(rank: int, world_size: int, root: str) -> None:
    _, state = _sharded(0)
    state["step"] = STEP
    dcp.save(state, checkpoint_id=os.path.join(root, "slipstream"))
    torch_dcp.save(state, checkpoint_id=os.path.join(root, "torch"))


def _check_shards(state: dict[str, Any], rank: int, where: str) -> None:
    reference = _reference()
    for fqn, value in state["model"].items():
        if not isinstance(value, ShardedTensor):
            assert torch.equal(value, reference[fqn]), (where, rank, fqn)
            continue
        for shard in value.local_shards():
            box = tuple(
                slice(o, o + n)
                for o, n in zip(
                    shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True
                )
            )
            assert torch.equal(shard.tensor, reference[fqn][box]), (where, rank, fqn, box)
    assert state["step"] == STEP, (where, rank)


def _load(rank: int, world_size: int, root: str) -> None:
    for written, load in (
        ("slipstream", dcp.load),  # slipstream reads its own
        ("torch", dcp.load),  # slipstream reads DCP's
        ("slipstream", torch_dcp.load),  # DCP reads slipstream's
    ):
        wrapped, state = _sharded(1 + rank)
        load(state, checkpoint_id=os.path.join(root, written))
        _check_shards(state, rank, f"{written} read by {load.__module__}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
                wrapped.load_state_dict(state["model"])
            with FSDP.summon_full_params(wrapped):
                for fqn, param in wrapped.module.state_dict().items():
                    assert torch.equal(param, _reference()[fqn]), (written, rank, fqn)


@pytest.fixture(scope="module")
def saved_on_two_ranks(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("fsdp1"))
    run_workers(_save, 2, root, timeout=150)
    assert os.path.exists(os.path.join(root, "slipstream", ".slipstream.json")), "served"
    metadata = torch_dcp.FileSystemReader(os.path.join(root, "slipstream")).read_metadata()
    chunks = metadata.state_dict_metadata["model.0.weight"].chunks
    assert [tuple(c.offsets) for c in chunks] == [(0, 0), (4, 0)], "each rank's shard"
    return root


@pytest.mark.parametrize("world_size", [1, 4])
def test_fsdp1_sharded_state_dict_round_trip_resharded(saved_on_two_ranks, world_size):
    run_workers(_load, world_size, saved_on_two_ranks, timeout=150)


def test_sharded_metadata_matches_dcps(saved_on_two_ranks):
    ours = torch_dcp.FileSystemReader(os.path.join(saved_on_two_ranks, "slipstream"))
    theirs = torch_dcp.FileSystemReader(os.path.join(saved_on_two_ranks, "torch"))
    ours_md, theirs_md = ours.read_metadata(), theirs.read_metadata()
    assert set(ours_md.state_dict_metadata) == set(theirs_md.state_dict_metadata)
    for fqn, md in theirs_md.state_dict_metadata.items():
        mine = ours_md.state_dict_metadata[fqn]
        assert type(mine) is type(md), fqn
        if isinstance(md, torch_dcp.TensorStorageMetadata):
            assert mine.size == md.size and mine.properties.dtype == md.properties.dtype, fqn
            key = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
            assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks) == sorted(key)
