"""Trainers that apply FSDP2 over tensor parallelism (torchtitan's layout: a ``dp x tp``
mesh, ``parallelize_module`` on ``tp``, then ``fully_shard`` on ``dp``) publish their own
shards: a column-parallel weight placed ``[_StridedShard(0), Shard(0)]`` is rows of the
tensor on every rank and a row-parallel one ``[Shard(0), Shard(1)]``; a parameter that
tensor parallelism left whole (a norm) is a DTensor of the ``dp`` mesh alone, replicated
over ``tp``. Four trainers publish to a plain rollout and a tensor-parallel pair: no
collective runs on the trainers' groups during a publish, after each version every rollout
holds its tensors bit for bit, and a tensor-parallel rank received its own bytes and the
replicated tensors' (plus 10%) only. The reference is each version's full tensors,
gathered by the trainers with ``full_tensor()`` after the publish (outside the count)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import free_port
from sync_procs import spawn
from test_tp_trainer_publish import (
    BUCKET,
    TP_SPLIT,
    VERSIONS,
    Collectives,
    _np,
    _rollout,
    _rollout_ranks,
    _tp_model,
    _tp_trainer_plan,
    check_rollouts,
)
from torch.distributed.tensor import Replicate

import slipstream as ss

WORLD = 4


@torch.no_grad()
def _step(model: torch.nn.Module, mesh, version: int) -> None:
    """Version ``version`` of every parameter: an update of each rank's own shard, the same
    on the ``tp`` ranks of a parameter that tensor parallelism left whole (as training
    keeps it)."""
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    for i, p in enumerate(model.parameters()):
        whole_over_tp = p.device_mesh.ndim == 1 or isinstance(p.placements[1], Replicate)
        seed = 1000 * version + 10 * i + 3 * dp + (0 if whole_over_tp else tp)
        g = torch.Generator().manual_seed(seed)
        local = p.to_local()
        local.mul_(0.5).add_(torch.randn(local.shape, generator=g))


def _trainer(rank, port, mesh_port, mode, transport):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    members = _rollout_ranks(WORLD)
    group = ss.sync.init_group("127.0.0.1", port, WORLD + len(members), rank, timeout=60)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=WORLD
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(_tp_model(), mesh["tp"], _tp_trainer_plan())
    fully_shard(model, mesh=mesh["dp"])
    counter = Collectives(mesh.get_all_groups())
    out: dict = {"counts": [], "full": {}, "placements": {}}
    with ss.WeightPublisher(
        group, list(range(WORLD)), members, bucket_bytes=BUCKET, mode=mode, transport=transport
    ) as pub:
        for version in VERSIONS:
            _step(model, mesh, version)
            state = model.state_dict()
            before = counter.now()
            handle = pub.publish(state, version=version)
            handle.staged.result(timeout=60)
            assert handle.delivered.result(timeout=60) == version
            out["counts"].append(counter.now() - before)
            out["full"][version] = {n: _np(t.full_tensor()) for n, t in state.items()}
        out["placements"] = {n: str(t.placements) for n, t in state.items()}
        later = {"later": torch.arange(64.0).view(2, 4, 8)}  # what the rollouts take last
        pub.publish(later, version=len(VERSIONS) + 1).delivered.result(timeout=60)
    torch.distributed.destroy_process_group()
    group.close()
    return out


def _run(rank, port, mesh_port, mode, transport, tp_port):
    if rank < WORLD:
        return _trainer(rank, port, mesh_port, mode, transport)
    return _rollout(rank, port, WORLD, "tp", tp_port)


@pytest.mark.parametrize(("mode", "transport"), [("direct", "auto"), ("cached", "relay")])
def test_fsdp_over_tensor_parallel_trainers_send_their_own_shards(mode, transport):
    members = _rollout_ranks(WORLD)
    out = spawn(_run, WORLD + len(members), free_port(), mode, transport, free_port(), timeout=300)
    assert "_StridedShard" in out[0]["placements"]["1.weight"], out[0]["placements"]
    assert out[0]["placements"]["2.weight"] == "(Shard(dim=0),)", out[0]["placements"]
    for trainer in range(WORLD):
        assert out[trainer]["counts"] == [0] * len(VERSIONS), (trainer, out[trainer]["counts"])
    check_rollouts(out, WORLD, TP_SPLIT.get)
