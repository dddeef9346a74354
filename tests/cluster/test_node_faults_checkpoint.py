"""Checkpoints across nodes (:mod:`netns_cluster`), and a node that vanishes mid-save or mid-load.

Three training ranks on nodes 0 to 2, the durable tier on a moto S3 server on node 3. Step 1
is saved and committed by all three. Then node 2 has a fault (its link cut, its processes
frozen, the node killed whole) while the others are inside ``ss.async_save`` or
``Checkpointer.save`` (the victim staged its part and its upload is under way), ``ss.load``
or ``Checkpointer.load``: each survivor's call fails
naming rank 2 within 5 s of the fault (the job's timeout is 120 s). The survivors, regrouped
without it, load step 1 exactly (nothing committed is lost) and save and load again.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from netns_cluster import (
    FAULTS,
    MARKS_ENV,
    Cluster,
    Fault,
    require_namespaces,
    spawn,
    trigger,
    wait_forever,
)
from storage_server import CREDENTIALS

import slipstream as ss

TIMEOUT = 120.0
WITHIN = 5.0
S3_PORT = 5111
BUCKET = "cluster"


def state(rank: int, value: float) -> dict:
    return {f"own{rank}": torch.full((64_000,), value), "shared": torch.full((1000,), value)}


def blank(rank: int) -> dict:
    return {f"own{rank}": torch.zeros(64_000), "shared": torch.zeros(1000)}


def holds(got: dict, rank: int, value: float) -> bool:
    return all(torch.equal(t, torch.full_like(t, value)) for t in got.values()) and set(got) == {
        f"own{rank}",
        "shared",
    }


def _wait_for_s3(endpoint: str, timeout: float = 60.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/data.json", timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            assert time.monotonic() < deadline, f"no S3 server at {endpoint}"
            time.sleep(0.1)


def _regroup(rank: int, addr: str, port: int) -> None:
    """Leave the job's group and form one of ranks 0 and 1 on a new port."""
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port + 1}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )


def _entries(rank: int, entry: str, committed: str):
    """Start ``entry`` on this rank; on the victim (rank 2), mark the fault and wait for it
    there. Returns what the survivors wait on."""
    if entry in ("async_save", "Checkpointer.save"):
        if entry == "async_save":
            response = ss.async_save(state(rank, 2.0), f"s3://{BUCKET}/step-2", timeout=TIMEOUT)
        else:
            checkpointer = ss.Checkpointer(f"s3://{BUCKET}/run", timeout=TIMEOUT)
            response = checkpointer.save(2, state(rank, 2.0))
        response.staging_completion.result(TIMEOUT)
        if rank == 2:  # its part is staged and its upload under way
            trigger("mid-checkpoint")
            wait_forever()
        return lambda: response.result(TIMEOUT)
    if rank == 2:  # the others are inside the load, waiting for its outcome
        trigger("mid-checkpoint")
        wait_forever()
    if entry == "load":
        return lambda: ss.load(blank(rank), committed, strict=False)
    checkpointer = ss.Checkpointer(f"s3://{BUCKET}/run", timeout=TIMEOUT)
    return lambda: checkpointer.load(blank(rank), strict=False)


def _vanishing_in(rank, addr, port, entry):
    dist.init_process_group(
        "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=3,
        timeout=timedelta(seconds=TIMEOUT),
    )  # fmt: skip
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    _wait_for_s3(endpoint)
    if rank == 0:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    dist.barrier()
    committed = f"s3://{BUCKET}/step-1"
    ss.save(state(rank, 1.0), committed, timeout=TIMEOUT)
    with ss.Checkpointer(f"s3://{BUCKET}/run", timeout=TIMEOUT) as checkpointer:
        checkpointer.save(1, state(rank, 1.0)).result(TIMEOUT)
    dist.barrier()
    run = _entries(rank, entry, committed)
    try:
        run()
    except Exception as exc:
        failed_at, message = time.monotonic(), str(exc)
    else:
        raise AssertionError(f"rank {rank}: the {entry} succeeded without rank 2")
    _regroup(rank, addr, port)
    got = blank(rank)
    ss.load(got, committed, strict=False)
    kept = holds(got, rank, 1.0)
    again = f"s3://{BUCKET}/again-{entry.lower()}"
    ss.save(state(rank, 3.0), again, timeout=TIMEOUT)
    got = blank(rank)
    ss.load(got, again, strict=False)
    dist.destroy_process_group()
    return {"at": failed_at, "message": message, "kept": kept, "again": holds(got, rank, 3.0)}


CASES = [
    (entry, fault)
    for entry in ("async_save", "load", "Checkpointer.save", "Checkpointer.load")
    for fault in FAULTS
]


@pytest.mark.parametrize(("entry", "fault"), CASES)
def test_a_node_that_vanishes_mid_checkpoint_is_named_within_seconds(entry, fault, tmp_path):
    require_namespaces()
    with Cluster(4) as cluster:
        s3 = cluster.nodes[3]
        server = s3.popen(
            [sys.executable, "-m", "moto.server", "-H", s3.addr, "-p", str(S3_PORT)],
            stdout=open(tmp_path / "moto.log", "wb"),
            stderr=open(tmp_path / "moto.err", "wb"),
        )
        environ = {
            MARKS_ENV: str(tmp_path),
            "AWS_ENDPOINT_URL": f"http://{s3.addr}:{S3_PORT}",
            **CREDENTIALS,
        }
        watch = Fault(str(tmp_path), "mid-checkpoint", cluster.nodes[2], fault, survivors=[0, 1])
        try:
            out = spawn(
                cluster, _vanishing_in, [0, 1, 2], entry, environ=environ, may_die=(2,),
                timeout=180,
            )  # fmt: skip
        finally:
            watch.close()
            server.kill()
            server.wait(10)
    assert watch.at is not None, "the fault never came"
    for rank in (0, 1):
        late = out[rank]["at"] - watch.at
        print(f"\n{entry}, {fault}: rank {rank} named the lost node {late:.2f} s after the fault")
        assert "rank 2" in out[rank]["message"] or "rank(s) [2]" in out[rank]["message"], out[rank]
        assert late < WITHIN, f"rank {rank} named the lost node {late:.1f} s after the fault"
        assert out[rank]["kept"] and out[rank]["again"], out[rank]
