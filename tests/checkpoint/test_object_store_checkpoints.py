"""Checkpoints on object storage, end to end: ``s3://`` on a real S3-compatible HTTP server
(moto's, on loopback, started by the ``s3_bucket`` fixture) and ``memory://``.

Each test compares against a reference computed another way: the state saved, ``dcp.load``
through s3fs, or DCP's own ``FsspecWriter`` output.
"""

from __future__ import annotations

import copy
import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_workers
from test_resharding import TENSORS, dtensor_state, expected_local, local_parts, plain_state
from test_roundtrip import _assert_same, _blank_like, _mixed_state
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.device_mesh import init_device_mesh

import slipstream as ss


@pytest.fixture(params=["s3", "memory"])
def object_url(request) -> str:
    """A fresh, empty location on each object store."""
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        return f"s3://{bucket}/run"
    return f"memory://test-{uuid.uuid4().hex[:8]}/run"


def test_every_value_kind_round_trips(object_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = _mixed_state()
    want = copy.deepcopy(state)
    ss.save(state, f"{object_url}/ck")
    got = _blank_like(want)
    ss.load(got, f"{object_url}/ck")
    _assert_same(got, want)
    assert os.listdir(tmp_path) == [], "an object store save wrote into the working directory"


def test_async_save_to_s3_stages_then_commits(s3_bucket):
    state = {"w": torch.randn(3_000_000), "step": 3}
    want = copy.deepcopy(state)
    url = f"s3://{s3_bucket}/async"
    response = ss.async_save(state, url)
    response.staging_completion.result(60)
    state["w"].zero_()
    response.result(60)
    got = {"w": torch.empty(3_000_000), "step": 0}
    ss.load(got, url)
    assert torch.equal(got["w"], want["w"]) and got["step"] == 3


def test_dcp_reads_through_s3fs_what_slipstream_wrote(s3_bucket):
    state = _mixed_state()
    want = copy.deepcopy(state)
    url = f"s3://{s3_bucket}/interop"
    ss.save(state, url)
    theirs = _blank_like(want)
    dcp.load(theirs, storage_reader=FsspecReader(url), no_dist=True)
    _assert_same(theirs, want)


def _dcp_saves_on_two_ranks_then_slipstream_loads(rank: int, world: int, url: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    dcp.save(dtensor_state(mesh), storage_writer=FsspecWriter(url))
    target = dtensor_state(mesh, fill=-7.0)
    ss.load(target, url)
    got = local_parts(target)
    for name in TENSORS:
        assert torch.equal(got[name], expected_local(name, world, rank)), name
    assert got["step"] == 42


def test_slipstream_reads_and_reshards_what_dcp_wrote_through_s3fs(s3_bucket):
    url = f"s3://{s3_bucket}/dcp2"
    run_workers(_dcp_saves_on_two_ranks_then_slipstream_loads, 2, url, timeout=120)
    whole = plain_state(fill=-7.0)
    ss.load(whole, url)
    want = plain_state()
    for name, value in want["model"].items():
        assert torch.equal(whole["model"][name], value), name


def _save_sharded(rank: int, world: int, url: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    ss.save(dtensor_state(mesh), url)


def _load_sharded(rank: int, world: int, url: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    target = dtensor_state(mesh, fill=-7.0)
    ss.load(target, url)
    got = local_parts(target)
    for name in TENSORS:
        assert torch.equal(got[name], expected_local(name, world, rank)), f"rank {rank}: {name}"


def test_one_two_and_four_ranks_reshard_on_s3(s3_bucket):
    one, two = f"s3://{s3_bucket}/ss1", f"s3://{s3_bucket}/ss2"
    ss.save(plain_state(), one)
    run_workers(_save_sharded, 2, two, timeout=120)
    run_workers(_load_sharded, 4, two, timeout=120)
    run_workers(_load_sharded, 2, one, timeout=120)
    whole = plain_state(fill=-7.0)
    ss.load(whole, two)
    for name, value in plain_state()["model"].items():
        assert torch.equal(whole["model"][name], value), name


def _state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "step": step}


def test_checkpointer_retention_and_resume(object_url):
    with ss.Checkpointer(object_url, keep_last=2) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step)).result(60)
        assert ck.steps() == [2, 3] and ck.latest() == 3
    with ss.Checkpointer(object_url, keep_last=2) as resumed:
        target = _state(0)
        assert resumed.load(target) == 3
        assert torch.equal(target["w"], _state(3)["w"]) and target["step"] == 3
        with pytest.raises(ss.CheckpointError, match="not a committed checkpoint"):
            resumed.load(_state(0), step=1)
