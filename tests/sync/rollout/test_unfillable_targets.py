"""A rollout refuses, before any byte is received, a target tensor it cannot write in place
through a pointer of its own (a DTensor, a tensor on the meta device, a tensor subclass): its
receive raises naming each such tensor and why, the process lives on, the module holds the
bytes it held before, the trainer's publish reports the refusal, and the next publish into a
plain module arrives exactly. A plain-typed tensor without memory of its own (a functional
wrapper, ``data_ptr()`` 0) and a sparse one are refused the same way."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port
from sync_procs import spawn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

import slipstream as ss
from slipstream.sync.layout.aliases import unique_tensors
from slipstream.sync.layout.plan import BucketPlan
from slipstream.sync.rollout.apply import ModuleTarget

BUCKET = 64 * 1024


def weights(version: int) -> dict[str, torch.Tensor]:
    return {
        "fc.weight": torch.full((8, 4), float(version + 1)),
        "fc.bias": torch.full((8,), float(10 * (version + 1))),
    }


class Wrapped(torch.Tensor):
    """A tensor subclass whose values live in an inner tensor (``elem``): it has no memory of
    its own (``data_ptr()`` is 0)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> Wrapped:
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)
        t.elem = elem
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = tree_map_only(Wrapped, lambda t: t.elem, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        return tree_map_only(torch.Tensor, Wrapped, out)


def _plain() -> nn.Module:
    m = nn.Module()
    m.fc = nn.Linear(4, 8)
    return m


def _dtensor(mesh_port: int) -> nn.Module:
    """The weight a DTensor of a one-rank CPU mesh (its own gloo group on ``mesh_port``)
    holding a partial sum: no box of the tensor's bytes at all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    dist.init_process_group("gloo", f"tcp://127.0.0.1:{mesh_port}", world_size=1, rank=0)
    mesh = init_device_mesh("cpu", (1,))
    m = _plain()
    m.fc.weight = nn.Parameter(DTensor.from_local(torch.zeros(8, 4), mesh, [Partial()]))
    return m


def _meta(mesh_port: int) -> nn.Module:
    m = _plain()
    m.fc.weight = nn.Parameter(torch.empty(8, 4, device="meta"))
    return m


def _subclass(mesh_port: int) -> nn.Module:
    m = _plain()
    m.fc.weight = nn.Parameter(Wrapped(torch.zeros(8, 4)))
    return m


TARGETS: dict[str, Callable[[int], nn.Module]] = {
    "dtensor": _dtensor,
    "meta": _meta,
    "subclass": _subclass,
}


def _held(m: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the bytes each parameter of ``m`` holds (a DTensor's local shard, a wrapper's
    inner tensor; a meta tensor holds none)."""
    out = {}
    for name, p in m.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else getattr(p, "elem", p)
        if t.device.type != "meta":
            out[name] = t.detach().contiguous().view(-1).view(torch.uint8).clone()
    return out


def _refused_then_plain(rank, port, transport, kind, mesh_port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=30)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, transport=transport)
        out = []
        for version in range(2):
            try:
                pub.publish(weights(version)).delivered.result(timeout=30)
                out.append("delivered")
            except ss.SyncError as exc:
                out.append(str(exc))
        pub.close()
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1])
    module = TARGETS[kind](mesh_port)
    before = _held(module)
    try:
        sub.receive(module)
        refusal = "received"
    except ss.SyncError as exc:
        refusal = str(exc)
    after = _held(module)
    plain = _plain()
    version = sub.receive(plain)
    sub.close()
    group.close()
    return {
        "refusal": refusal,
        "unchanged": before.keys() == after.keys()
        and all(torch.equal(before[n], after[n]) for n in before),
        "version": version,
        "arrived": all(torch.equal(plain.get_parameter(n), t) for n, t in weights(1).items()),
    }


def _assert_refused(transport: str, kind: str, why: dict[str, str]) -> None:
    """The rollout refused version 0 naming each tensor of ``why`` with its reason, held its
    module's bytes, then took version 1 exactly; the trainer reported that refusal."""
    out = spawn(_refused_then_plain, 2, transport, kind, free_port(), timeout=120)
    rollout, (first, second) = out[1], out[0]
    assert "cannot be written in place" in rollout["refusal"], (transport, rollout)
    for name, reason in why.items():
        assert f"{name}: {reason}" in rollout["refusal"], (transport, name, rollout)
        assert f"{name}: {reason}" in first, (transport, name, first)
    assert "rollout rank 1 rejected version 0" in first, (transport, first)
    assert rollout["unchanged"], (transport, rollout)
    assert second == "delivered", (transport, second)
    assert rollout["version"] == 1 and rollout["arrived"], (transport, rollout)


@pytest.mark.parametrize("transport", ["shm", "relay"])
def test_a_dtensor_target_is_refused_by_name_and_left_as_it_was(transport):
    _assert_refused(transport, "dtensor", {"fc.weight": "DTensor placed [Partial(sum)]"})


@pytest.mark.parametrize("transport", ["shm", "relay"])
def test_a_meta_device_parameter_is_refused_by_name(transport):
    _assert_refused(transport, "meta", {"fc.weight": "on the meta device"})


@pytest.mark.parametrize("transport", ["shm", "relay"])
def test_a_tensor_subclass_parameter_is_refused_by_name(transport):
    _assert_refused(transport, "subclass", {"fc.weight": "a tensor subclass (Wrapped)"})


def test_a_wrapper_without_memory_and_a_sparse_tensor_are_refused_by_name():
    m = nn.Module()
    m.register_buffer("wrapper", torch._to_functional_tensor(torch.zeros(4)))
    m.register_buffer("sparse", torch.zeros(4).to_sparse())
    assert type(m.get_buffer("wrapper")) is torch.Tensor  # refused for its pointer, not its type
    specs, _ = unique_tensors([("wrapper", torch.ones(4)), ("sparse", torch.ones(4))])
    problems = ModuleTarget(m).check(BucketPlan.build(specs, BUCKET, [0]))
    assert len(problems) == 1 and problems[0].startswith("cannot be written in place"), problems
    assert "wrapper: its data_ptr() is 0" in problems[0], problems
    assert "sparse: torch.sparse_coo layout" in problems[0], problems


class EngineParameter(nn.Parameter):
    """A ``Parameter`` subclass that keeps its values in its own storage, as an inference
    engine's parameters do (vLLM's ``BasevLLMParameter``): written like a plain tensor."""


def test_a_parameter_subclass_with_memory_of_its_own_is_written():
    m = nn.Module()
    m.w = EngineParameter(torch.zeros(4))
    specs, _ = unique_tensors([("w", torch.ones(4))])
    assert ModuleTarget(m).check(BucketPlan.build(specs, BUCKET, [0])) == []
