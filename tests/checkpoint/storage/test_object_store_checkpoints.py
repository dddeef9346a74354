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
from checkpoint_states import (
    TENSORS,
    assert_same,
    blank_like,
    dtensor_state,
    expected_local,
    local_parts,
    mixed_state,
    plain_state,
    step_state,
)
from dist_utils import run_workers
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
    state = mixed_state()
    want = copy.deepcopy(state)
    ss.save(state, f"{object_url}/ck")
    got = blank_like(want)
    ss.load(got, f"{object_url}/ck")
    assert_same(got, want)
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
    state = mixed_state()
    want = copy.deepcopy(state)
    url = f"s3://{s3_bucket}/interop"
    ss.save(state, url)
    theirs = blank_like(want)
    dcp.load(theirs, storage_reader=FsspecReader(url), no_dist=True)
    assert_same(theirs, want)


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


def test_checkpointer_retention_and_resume(object_url):
    with ss.Checkpointer(object_url, keep_last=2) as ck:
        for step in (1, 2, 3):
            ck.save(step, step_state(step)).result(60)
        assert ck.steps() == [2, 3] and ck.latest() == 3
    with ss.Checkpointer(object_url, keep_last=2) as resumed:
        target = step_state(0)
        assert resumed.load(target) == 3
        assert torch.equal(target["w"], step_state(3)["w"]) and target["step"] == 3
        with pytest.raises(ss.CheckpointError, match="step 1 .* not a complete checkpoint.* 3$"):
            resumed.load(step_state(0), step=1)


_KILLED_WRITER = """
import sys, torch, slipstream as ss
from checkpoint_states import step_state
from fault_storage import FaultStorage
from slipstream.checkpoint.storage import resolve_storage

url = sys.argv[1]
with ss.Checkpointer(url, keep_last=2) as ck:
    ck.save(1, step_state(1)).result(60)
storage = FaultStorage(resolve_storage(url))
storage.faults.gate("finish")  # parts go up, the upload is never completed
ck = ss.Checkpointer(storage, keep_last=2)
ck.save(2, {"w": torch.randn(4_000_000), "step": 2})
print("saving", flush=True)
ck.wait(60)
"""


def _uploads(bucket: str) -> list[str]:
    import boto3

    listing = boto3.client("s3").list_multipart_uploads(Bucket=bucket)
    return [u["Key"] for u in listing.get("Uploads", [])]


def test_sigkill_mid_upload_keeps_the_previous_step_and_the_next_save_cleans_up(s3_bucket):
    import subprocess
    import sys
    import time

    url = f"s3://{s3_bucket}/run"
    helpers = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fault_storage, ...
    env = {**os.environ, "PYTHONPATH": helpers + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url], env=env)
    try:
        deadline = time.monotonic() + 240  # the writer imports torch on a loaded machine
        # Step 1 goes up as a multipart upload too: wait for step 2's, or the kill can land
        # between step 1's upload and its commit (and then no step is committed at all).
        while not any("step_2/" in key for key in _uploads(s3_bucket)):
            assert child.poll() is None, f"the writer exited with {child.returncode}"
            assert time.monotonic() < deadline, "step 2's multipart upload never started"
            time.sleep(0.05)
        child.kill()
    finally:
        child.kill()
        child.wait(10)
    assert all("step_2/" in key for key in _uploads(s3_bucket))

    with ss.Checkpointer(url, keep_last=2) as ck:
        assert ck.steps() == [1]
        target = step_state(0)
        assert ck.load(target) == 1 and torch.equal(target["w"], step_state(1)["w"])
        ck.save(3, step_state(3)).result(60)
        assert ck.steps() == [1, 3]
    assert _uploads(s3_bucket) == []


def test_unknown_scheme_is_refused_naming_it_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("foo://bucket/ck", "hdfs://namenode/ck"):
        with pytest.raises(ss.CheckpointError, match=url.split(":")[0]):
            ss.save({"w": torch.ones(3)}, url)
        with pytest.raises(ss.CheckpointError, match=url.split(":")[0]):
            ss.load({"w": torch.ones(3)}, url)
    with pytest.raises(ss.CheckpointError, match="foo"):
        ss.Checkpointer("foo://bucket/run")
    assert os.listdir(tmp_path) == []


def test_file_urls_are_local_paths(tmp_path):
    ss.save({"w": torch.arange(4)}, f"file://{tmp_path}/ck")
    got = {"w": torch.zeros(4, dtype=torch.int64)}
    ss.load(got, tmp_path / "ck")
    assert torch.equal(got["w"], torch.arange(4))


def test_missing_bucket_fails_the_save_within_seconds_naming_it(s3_server):
    import time

    started = time.monotonic()
    with pytest.raises(ss.CheckpointError, match="no-such-bucket-here.*does not exist"):
        ss.save({"w": torch.ones(3)}, "s3://no-such-bucket-here/ck")
    with pytest.raises(ss.CheckpointError, match="no-such-bucket-here"):
        ss.load({"w": torch.ones(3)}, "s3://no-such-bucket-here/ck")
    assert time.monotonic() - started < 10


def test_storage_options_override_the_environment_end_to_end(s3_bucket, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    options = {"endpoint": s3_server}
    url = f"s3://{s3_bucket}/opts"
    ss.save({"w": torch.arange(5)}, url, storage_options=options)
    got = {"w": torch.zeros(5, dtype=torch.int64)}
    ss.load(got, url, storage_options=options)
    assert torch.equal(got["w"], torch.arange(5))
    with ss.Checkpointer(f"{url}/run", storage_options=options) as ck:
        ck.save(1, {"w": torch.arange(5)}).result(60)
        assert ck.steps() == [1]


def test_cli_reads_checkpoints_on_s3(s3_bucket, capsys):
    from slipstream.cli import main

    url = f"s3://{s3_bucket}/cli"
    ss.save({"model": {"w": torch.randn(8, 4)}, "step": 4}, url)
    assert main(["inspect", url]) == 0
    assert "model.w" in capsys.readouterr().out
    assert main(["verify", url]) == 0
    assert main(["inspect", f"s3://{s3_bucket}/absent"]) == 1
    assert "not a committed checkpoint" in capsys.readouterr().err
