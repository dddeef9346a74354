"""FSDP2 trainers publish each rank's own shards: no collective on the trainers' mesh during
a publish, no full tensor on a trainer, and every rollout (a module, a ``load_weights``
callable, two tensor-parallel ranks holding their rows and columns, or two such ranks and a
plain module at once) holds exactly the trainers' weights after each version, in ``direct``
and ``cached`` mode, over 2 and 4 trainer ranks, FSDP and HSDP (a replicated mesh dimension:
the replicas of a shard split it). Each tensor-parallel rank copies out of the shared slots
(``ipc``, the transport on one host) only the bytes of its own shards and of the replicated
tensors (``bytes_received``, against the bytes of its ``state_dict()``'s local tensors); over
the network (relay, broadcast) the trainers send it only those.

The reference is each version's full tensors, gathered by the trainers with
``full_tensor()`` after the publish (outside the counted window). The count: the default
group's collective sequence number, and calls to ``DTensor.full_tensor`` and
``DTensor.redistribute``; a DTensor placed ``Partial()`` (which the publisher gathers: its
``full_tensor`` sums the ranks' parts) shows the count is live."""

from __future__ import annotations

from math import prod

import numpy as np
import pytest
import torch
from dist_utils import free_port
from sync_procs import spawn
from torch import nn

import slipstream as ss

BUCKET = 256 * 1024
VERSIONS = (1, 2, 3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(97, 48),
        nn.Linear(48, 160),
        nn.LayerNorm(160),
        nn.Linear(160, 48, bias=False),
        nn.Linear(48, 97),
    )


def _step(model: nn.Module, opt: torch.optim.Optimizer, version: int) -> None:
    torch.manual_seed(100 + version)
    tokens = torch.randint(0, 97, (4, 6))
    model(tokens).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


class Collectives:
    """Counts what a publish could gather with: the default group's collectives and the
    DTensor calls that run them."""

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor

        self.calls = 0
        for name in ("full_tensor", "redistribute"):
            original = getattr(DTensor, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(DTensor, name, counted)

    def now(self) -> int:
        seq = torch.distributed.group.WORLD._get_sequence_number_for_group()
        return seq + self.calls


def _rollout_ranks(world: int, rollouts: str) -> list[int]:
    return list(range(world, world + (3 if rollouts == "mixed" else 2)))


def _trainer(rank, port, mesh_port, mesh_shape, mode, rollouts, transport):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial

    world = prod(mesh_shape)
    members = _rollout_ranks(world, rollouts)
    group = ss.sync.init_group("127.0.0.1", port, world + len(members), rank, timeout=60)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=world
    )
    names = ("replicate", "shard")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)  # 2-D: HSDP
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = Collectives()
    out: dict = {"counts": [], "full": {}}
    with ss.WeightPublisher(
        group, list(range(world)), members, bucket_bytes=BUCKET, mode=mode, transport=transport
    ) as pub:
        for version in VERSIONS:
            _step(model, opt, version)
            state = model.state_dict()
            before = counter.now()
            handle = pub.publish(state, version=version)
            handle.staged.result(timeout=60)
            out["counts"].append(counter.now() - before)
            assert handle.delivered.result(timeout=60) == version
            out["full"][version] = {n: t.full_tensor().numpy().copy() for n, t in state.items()}
        parts = torch.arange(64.0).view(2, 4, 8) / world  # each rank's part of the sum
        later = DTensor.from_local(parts, mesh, [Partial()] * len(mesh_shape), run_check=False)
        strided = {"strided": later}
        before = counter.now()
        pub.publish(strided, version=len(VERSIONS) + 1).delivered.result(timeout=60)
        out["gathered"] = counter.now() - before
    torch.distributed.destroy_process_group()
    group.close()
    return out if rank == 0 else {"counts": out["counts"], "gathered": out["gathered"]}


def _rollout(rank, port, world, rollouts):
    members = _rollout_ranks(world, rollouts)
    group = ss.sync.init_group("127.0.0.1", port, world + len(members), rank, timeout=60)
    into_module = rank != world + 1
    target: nn.Module | dict = _model() if into_module else {}
    held = {}
    with ss.WeightSubscriber(group, list(range(world)), members) as sub:
        for version in VERSIONS:
            if into_module:
                assert sub.receive(target) == version
                held[version] = {n: t.numpy().copy() for n, t in target.state_dict().items()}
            else:
                sub.receive(lambda batch: target.update((n, t.numpy().copy()) for n, t in batch))
                held[version] = dict(target)
        sub.receive(lambda batch: held.update({"strided": dict(batch)["strided"].numpy().copy()}))
    group.close()
    return held


#: The rollouts' tensor-parallel layers and the dimension each of their tensors is split on:
#: column-parallel (weight and bias ``Shard(0)``), row-parallel (weight ``Shard(1)``).
TP_SPLIT = {"1.weight": 0, "1.bias": 0, "3.weight": 1, "4.weight": 0, "4.bias": 0}


def _tp_rollout(rank, port, world, tp_port, rollouts):
    """Rollout ranks ``world`` and ``world + 1`` as one tensor-parallel model over a mesh of
    their own; each returns its local shards and the bytes it received of each version."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    members = _rollout_ranks(world, rollouts)
    group = ss.sync.init_group("127.0.0.1", port, world + len(members), rank, timeout=60)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=rank - world, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))
    plan = {"1": ColwiseParallel(), "3": RowwiseParallel(), "4": ColwiseParallel()}
    model = parallelize_module(_model(), mesh, plan)
    held: dict = {"received": []}
    with ss.WeightSubscriber(group, list(range(world)), members) as sub:
        for version in VERSIONS:
            before = sub.bytes_received
            assert sub.receive(model) == version
            held["received"].append(sub.bytes_received - before)
            held[version] = {
                n: (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().copy()
                for n, t in model.state_dict().items()
            }
        sub.receive(lambda batch: held.update({"strided": dict(batch)["strided"].numpy().copy()}))
    torch.distributed.destroy_process_group()
    group.close()
    return held


def _run(rank, port, mesh_port, mesh_shape, mode, rollouts, transport, tp_port):
    world = prod(mesh_shape)
    if rank < world:
        return _trainer(rank, port, mesh_port, mesh_shape, mode, rollouts, transport)
    if rollouts != "plain" and rank < world + 2:
        return _tp_rollout(rank, port, world, tp_port, rollouts)
    return _rollout(rank, port, world, rollouts)


@pytest.mark.parametrize(
    ("mesh_shape", "mode", "rollouts", "transport"),
    [
        ((2,), "direct", "plain", "auto"),
        ((2,), "cached", "plain", "auto"),
        ((4,), "direct", "plain", "auto"),
        ((2, 2), "cached", "plain", "auto"),
        ((2,), "direct", "tp", "auto"),
        ((4,), "cached", "tp", "auto"),
        ((2,), "cached", "mixed", "auto"),
        ((4,), "direct", "mixed", "auto"),
        ((2,), "direct", "tp", "broadcast"),
        ((2,), "cached", "mixed", "relay"),
    ],
)
def test_fsdp2_trainers_send_their_own_shards_without_a_collective_and_rollouts_are_exact(
    mesh_shape, mode, rollouts, transport
):
    world = prod(mesh_shape)
    members = _rollout_ranks(world, rollouts)
    out = spawn(
        _run,
        world + len(members),
        free_port(),
        mesh_shape,
        mode,
        rollouts,
        transport,
        free_port(),
        timeout=300,
    )
    for trainer in range(world):
        assert out[trainer]["counts"] == [0] * len(VERSIONS), (trainer, out[trainer])
        assert out[trainer]["gathered"] > 0, trainer  # the count sees a gather
    full = out[0]["full"]
    for tp_rank, rollout in enumerate(members):
        tp = rollouts != "plain" and tp_rank < 2
        for version in VERSIONS:
            got = out[rollout][version]
            assert set(got) == set(full[version]), (rollout, version)
            for name, t in full[version].items():
                dim = TP_SPLIT.get(name) if tp else None
                want = t if dim is None else np.array_split(t, 2, axis=dim)[tp_rank]
                assert np.array_equal(got[name], want), (rollout, version, name)
        if tp:  # its own shards and the replicated tensors, nothing more
            kept = sum(a.nbytes for a in out[rollout][VERSIONS[-1]].values())
            dense = sum(a.nbytes for a in full[VERSIONS[-1]].values())
            received = out[rollout]["received"]
            assert all(0 < n <= 1.1 * kept for n in received), (kept, received)
            assert kept < 0.7 * dense, (kept, dense)
        assert np.array_equal(out[rollout]["strided"], np.arange(64.0).reshape(2, 4, 8)), rollout
