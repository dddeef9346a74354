"""A tensor-parallel rollout receives into its own shards: two rollout ranks with a model
parallelized over their own mesh (``ColwiseParallel``: weight and bias ``Shard(0)``, rows
split unevenly; ``RowwiseParallel``: weight ``Shard(1)``, columns split unevenly, bias
replicated; a ``Replicate()`` DTensor; plain tensors) each hold, after every version,
exactly their box of the trainer's tensors, in place and with ``atomic=True``, over shared
memory and over the network (relayed and broadcast). Each rank receives only its own bytes
(its shards and the replicated tensors) of every version, the first too: over shared memory
it copies out only those; over the network the trainer sends each rank its own. The
reference is the trainer's own tensors, cut into each rank's rows or columns with
``torch.chunk`` (how ``Shard`` places them). Small buckets cut the tensors mid-row, so
slices start and end inside a row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port
from sync_procs import publish_each, spawn
from torch import nn

import slipstream as ss

BUCKET = 1024
VERSIONS = (1, 2, 3)


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(16, 33), nn.LayerNorm(33), nn.Linear(33, 7))
    m.register_buffer("scale", torch.ones(5))
    return m


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(t.shape, generator=g) for n, t in _model().state_dict().items()}


def _tp_model(mesh) -> nn.Module:
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    model[1].weight = nn.Parameter(distribute_tensor(model[1].weight.data, mesh, [Replicate()]))
    return model


def _run(rank, port, mesh_port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=60)
    if rank == 0:
        return publish_each(
            group, [1, 2], _weights, VERSIONS, bucket_bytes=BUCKET, transport=transport
        )
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank - 1, world_size=2
    )
    model = _tp_model(init_device_mesh("cpu", (2,)))
    held: dict = {"received": []}
    with ss.WeightSubscriber(group, [0], [1, 2]) as sub:
        for version in VERSIONS:
            before = sub.bytes_received
            assert sub.receive(model, atomic=version == 2) == version
            held["received"].append(sub.bytes_received - before)
            held[version] = {
                n: (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().copy()
                for n, t in model.state_dict().items()
            }
    dist.destroy_process_group()
    group.close()
    return held


@pytest.mark.parametrize("transport", ["shm", "relay", "broadcast"])
def test_tensor_parallel_rollouts_hold_exactly_their_rows_of_every_version(transport):
    out = spawn(_run, 3, free_port(), transport, timeout=120)
    by_dim = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # the rest: replicated or plain
    for version in VERSIONS:
        for name, full in _weights(version).items():
            for tp_rank, rollout in enumerate((1, 2)):
                got = out[rollout][version][name]
                dim = by_dim.get(name)
                want = full if dim is None else full.chunk(2, dim=dim)[tp_rank].contiguous()
                assert np.array_equal(got, want.numpy()), (transport, version, name, tp_rank)
    dense = sum(t.nbytes for t in _weights(1).values())
    for rollout in (1, 2):
        kept = sum(a.nbytes for a in out[rollout][VERSIONS[-1]].values())
        received = out[rollout]["received"]
        assert all(0 < n <= 1.1 * kept for n in received), (transport, kept, received)
        assert kept < 0.8 * dense, (kept, dense)
