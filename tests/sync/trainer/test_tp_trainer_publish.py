"""Tensor-parallel trainers publish each rank's own shards, placed by columns too: a trainer
parallelized with ``ColwiseParallel`` / ``RowwiseParallel`` over a 1-D mesh of 2 (weights
``Shard(0)`` and ``Shard(1)``, an embedding ``Shard(1)``, a replicated bias, plain norms),
and DTensors on a 2 x 2 mesh placed ``[Shard(0), Shard(1)]``, ``[Replicate(), Shard(0)]``,
``[Replicate(), Shard(1)]``, ``[Shard(1), Shard(0)]`` of a 3-D tensor, ``[Shard(1),
Shard(1)]``, ``[Shard(0), Shard(2)]`` and ``[Shard(2), Replicate()]`` (a head or expert
dimension), uneven, bf16 and wholly replicated ones. No collective runs on the trainers'
mesh during a publish, in ``direct`` and ``cached`` mode, and after each version a plain
rollout holds every tensor and a tensor-parallel rollout (2 ranks, placed so that most of
its shards cut the trainers' across: a band of columns of a shard of rows, rows of a band)
holds its shards, bit for bit, and received at most its own bytes and the replicated
tensors' plus 10%.

The reference is each version's full tensors, made from a seed on every trainer before they
are cut into the trainers' shards (``distribute_tensor`` with no source rank: each rank
keeps its own chunk, no collective), and cut for the tensor-parallel rollout with numpy.
The count: calls of ``DTensor.full_tensor`` and ``DTensor.redistribute``, of
``torch.distributed``'s gathers, broadcasts and reductions on the trainers' groups, and
those groups' collective sequence numbers; a DTensor placed ``Partial()`` (which the
publisher gathers: its ``full_tensor`` sums the ranks' parts) shows the count is live."""

from __future__ import annotations

from math import prod

import numpy as np
import pytest
import torch
from dist_utils import free_port
from sync_procs import spawn
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import slipstream as ss

BUCKET = 64 * 1024
VERSIONS = (1, 2, 3)
#: Tensors that keep version 2's values at version 3 (their slices are left out then).
FROZEN = ("1.weight", "b", "e")


def _tp_model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(97, 48),
        nn.Linear(48, 160),
        nn.LayerNorm(160),
        nn.Linear(160, 48, bias=False),
        nn.Linear(48, 97),
    )


def _tp_trainer_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # embedding Shard(1); 1 Shard(0) weight and bias; 3, 4 Shard(1) weights, 4's bias Replicate
    return {
        "0": ColwiseParallel(),
        "1": ColwiseParallel(),
        "3": RowwiseParallel(),
        "4": RowwiseParallel(),
    }


def _tp_rollout_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "0": RowwiseParallel(),
        "1": RowwiseParallel(),
        "3": ColwiseParallel(),
        "4": ColwiseParallel(),
    }


#: The tensor-parallel rollout's split dimension of each tensor of the ``tp`` case (the
#: others it holds whole: a replicated bias, the norm).
TP_SPLIT = {"0.weight": 0, "1.weight": 1, "3.weight": 0, "4.weight": 0, "4.bias": 0}

#: The ``2d`` case: each tensor's shape, dtype, placements on the trainers' 2 x 2 mesh
#: (``None``: a plain tensor) and the dimension the rollout pair splits it on (``None``:
#: whole).
MESH_2D = {
    "a": ((12, 40), torch.float32, (Shard(0), Shard(1)), 0),
    "b": ((40, 24), torch.float32, (Replicate(), Shard(0)), 1),
    "c": ((9, 33), torch.float32, (Replicate(), Shard(1)), 0),
    "d": ((7, 6, 8), torch.float32, (Shard(1), Shard(0)), 1),
    "e": ((10, 64), torch.float32, (Shard(1), Shard(1)), 0),
    "f": ((33,), torch.float32, (Shard(0), Replicate()), 0),
    "g": ((6, 40), torch.bfloat16, (Shard(0), Shard(1)), 1),
    "h": ((5, 5), torch.float32, (Replicate(), Replicate()), None),
    "j": ((4, 6, 10), torch.float32, (Shard(0), Shard(2)), 2),
    "k": ((3, 5, 8), torch.float32, (Shard(2), Replicate()), 1),
    "i": ((20,), torch.float32, None, None),
}


def _np(t: torch.Tensor) -> np.ndarray:
    """A copy of ``t``'s values as numpy (bf16 as its bits)."""
    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().copy()


def _full(name: str, shape, dtype, version: int) -> torch.Tensor:
    """Version ``version`` of tensor ``name``, the same on every trainer."""
    v = min(version, 2) if name in FROZEN else version
    g = torch.Generator().manual_seed(1000 * v + sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


class Collectives:
    """Counts what a publish could gather with on the trainers' groups: the DTensor calls
    that run collectives, ``torch.distributed``'s collectives called on those groups, and
    the groups' collective sequence numbers."""

    NAMES = (
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "broadcast",
        "broadcast_object_list",
        "reduce_scatter_tensor",
        "scatter",
        "gather",
        "all_to_all_single",
    )

    def __init__(self, groups: list) -> None:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        self.groups = groups
        self.calls = 0
        for name in ("full_tensor", "redistribute"):
            setattr(DTensor, name, self._counted(getattr(DTensor, name), lambda a, k: True))
        world = dist.group.WORLD
        for name in self.NAMES:

            def ours(args, kwargs, _name=name):
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                return group is None or group is world or group in self.groups

            setattr(dist, name, self._counted(getattr(dist, name), ours))

    def _counted(self, original, ours):
        def counted(*args, **kwargs):
            if ours(args, kwargs):
                self.calls += 1
            return original(*args, **kwargs)

        return counted

    def now(self) -> int:
        import torch.distributed as dist

        groups = {id(g): g for g in [dist.group.WORLD, *self.groups]}
        return self.calls + sum(g._get_sequence_number_for_group() for g in groups.values())


def _rollout_ranks(world: int) -> list[int]:
    """The plain rollout, then the tensor-parallel pair."""
    return [world, world + 1, world + 2]


def _trainer_state(case: str, mesh) -> tuple[nn.Module, dict]:
    """The trainer's module and each tensor's shape and dtype."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    if case == "tp":
        model = parallelize_module(_tp_model(), mesh, _tp_trainer_plan())
        return model, {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    model = nn.Module()
    for name, (shape, dtype, placements, _) in MESH_2D.items():
        t = torch.zeros(shape, dtype=dtype)
        if placements is not None:
            t = distribute_tensor(t, mesh, placements, src_data_rank=None)
        model.register_parameter(name, nn.Parameter(t, requires_grad=False))
    return model, {n: (shape, dtype) for n, (shape, dtype, *_) in MESH_2D.items()}


@torch.no_grad()
def _set_version(model: nn.Module, shapes: dict, mesh, version: int) -> dict:
    """Write ``version`` into every parameter and buffer of ``model`` (a DTensor: its own
    chunk of the full tensor, cut by ``distribute_tensor``); return the full tensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = {n: _full(n, shape, dtype, version) for n, (shape, dtype) in shapes.items()}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, DTensor):
            mine = distribute_tensor(full[name], mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(mine.to_local())
        else:
            t.copy_(full[name])
    return {n: _np(t) for n, t in full.items()}


def _trainer(rank, port, mesh_port, case, mode, transport):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh_shape = (2,) if case == "tp" else (2, 2)
    world = prod(mesh_shape)
    members = _rollout_ranks(world)
    group = ss.sync.init_group("127.0.0.1", port, world + len(members), rank, timeout=60)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    model, shapes = _trainer_state(case, mesh)
    counter = Collectives(mesh.get_all_groups())
    out: dict = {"counts": [], "full": {}, "peak_gathered": 0}
    with ss.WeightPublisher(
        group, list(range(world)), members, bucket_bytes=BUCKET, mode=mode, transport=transport
    ) as pub:
        for version in VERSIONS:
            out["full"][version] = _set_version(model, shapes, mesh, version)
            state = model.state_dict()
            before = counter.now()
            handle = pub.publish(state, version=version)
            handle.staged.result(timeout=60)
            assert handle.delivered.result(timeout=60) == version
            out["counts"].append(counter.now() - before)
        out["peak_gathered"] = pub.peak_gathered_bytes
        later = torch.arange(64.0).view(2, 4, 8) / world  # each rank's part of the sum
        placements = [Partial()] * len(mesh_shape)
        gathered = {"later": DTensor.from_local(later, mesh, placements, run_check=False)}
        before = counter.now()
        pub.publish(gathered, version=len(VERSIONS) + 1).delivered.result(timeout=60)
        out["gathered"] = counter.now() - before
    torch.distributed.destroy_process_group()
    group.close()
    return out if rank == 0 else {k: v for k, v in out.items() if k != "full"}


def _plain_target(case: str) -> nn.Module:
    if case == "tp":
        return _tp_model()
    target = nn.Module()
    for name, (shape, dtype, *_) in MESH_2D.items():
        target.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype), False))
    return target


def _tp_target(case: str, mesh) -> nn.Module:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    if case == "tp":
        return parallelize_module(_tp_model(), mesh, _tp_rollout_plan())
    target = nn.Module()
    for name, (shape, dtype, _, dim) in MESH_2D.items():
        t = torch.zeros(shape, dtype=dtype)
        if dim is not None:
            t = distribute_tensor(t, mesh, [Shard(dim)], src_data_rank=None)
        target.register_parameter(name, nn.Parameter(t, requires_grad=False))
    return target


def _rollout(rank, port, world, case, tp_port):
    """The plain rollout (rank ``world``) or a rank of the tensor-parallel pair: each
    version's tensors it holds (a DTensor: its local shard) and the bytes it received."""
    from torch.distributed.device_mesh import init_device_mesh

    members = _rollout_ranks(world)
    group = ss.sync.init_group("127.0.0.1", port, world + len(members), rank, timeout=60)
    tp = rank > world
    if tp:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=rank - world - 1, world_size=2
        )
        target = _tp_target(case, init_device_mesh("cpu", (2,)))
    else:
        target = _plain_target(case)
    held: dict = {"received": []}
    with ss.WeightSubscriber(group, list(range(world)), members) as sub:
        for version in VERSIONS:
            before = sub.bytes_received
            assert sub.receive(target) == version
            held["received"].append(sub.bytes_received - before)
            held[version] = {
                n: _np(t.to_local() if hasattr(t, "to_local") else t)
                for n, t in target.state_dict().items()
            }
        sub.receive(lambda batch: held.update({"later": dict(batch)["later"].numpy().copy()}))
    if tp:
        torch.distributed.destroy_process_group()
    group.close()
    return held


def _run(rank, port, mesh_port, case, mode, transport, tp_port):
    world = 2 if case == "tp" else 4
    if rank < world:
        return _trainer(rank, port, mesh_port, case, mode, transport)
    return _rollout(rank, port, world, case, tp_port)


def _split_dim(case: str, name: str) -> int | None:
    return TP_SPLIT.get(name) if case == "tp" else MESH_2D[name][3]


@pytest.mark.parametrize(
    ("case", "mode", "transport"),
    [
        ("tp", "direct", "auto"),
        ("tp", "cached", "auto"),
        ("2d", "direct", "auto"),
        ("2d", "cached", "auto"),
        ("tp", "cached", "relay"),
        ("2d", "direct", "broadcast"),
    ],
)
def test_tensor_parallel_trainers_send_their_own_shards_and_rollouts_are_exact(
    case, mode, transport
):
    world = 2 if case == "tp" else 4
    members = _rollout_ranks(world)
    out = spawn(
        _run,
        world + len(members),
        free_port(),
        case,
        mode,
        transport,
        free_port(),
        timeout=300,
    )
    for trainer in range(world):
        assert out[trainer]["counts"] == [0] * len(VERSIONS), (trainer, out[trainer]["counts"])
        assert out[trainer]["peak_gathered"] == 0, trainer
        assert out[trainer]["gathered"] > 0, trainer  # the count sees a gather
    check_rollouts(out, world, lambda name: _split_dim(case, name))


def check_rollouts(out: dict, world: int, split_dim) -> None:
    """Every rollout of a run of ``world`` trainers (``out``: each rank's result) holds each
    version's tensors bit for bit (the tensor-parallel pair: its half of each on the
    dimension ``split_dim(name)`` gives, ``None``: whole), a rank of the pair received its
    own bytes and the replicated tensors' (plus 10%) only, and every rollout took the last
    publish."""
    full = out[0]["full"]
    for rollout in _rollout_ranks(world):
        tp_rank = rollout - world - 1
        for version in VERSIONS:
            got = out[rollout][version]
            assert set(got) == set(full[version]), (rollout, version)
            for name, t in full[version].items():
                dim = split_dim(name) if tp_rank >= 0 else None
                want = t if dim is None else np.array_split(t, 2, axis=dim)[tp_rank]
                assert got[name].dtype == want.dtype, (rollout, name)
                assert np.array_equal(got[name], want), (rollout, version, name)
        if tp_rank >= 0:  # its own shards and the replicated tensors, nothing more
            kept = sum(a.nbytes for a in out[rollout][VERSIONS[-1]].values())
            dense = sum(a.nbytes for a in full[VERSIONS[-1]].values())
            received = out[rollout]["received"]
            assert all(0 < n <= 1.1 * kept for n in received), (kept, received)
            assert kept < 0.7 * dense, (kept, dense)
        assert np.array_equal(out[rollout]["later"], np.arange(64.0).reshape(2, 4, 8)), rollout
