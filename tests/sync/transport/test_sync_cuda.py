"""Weight sync between processes whose weights live on a CUDA device: the trainer stages device
weights through pinned host memory, the rollout applies them to device tensors.

Skipped without a CUDA device (CI has none); README.md's Development section says how to run
them on one. Both processes share the one GPU, so the group is gloo: NCCL refuses two ranks
on the same device.
"""

from __future__ import annotations

import pytest
import torch
from sync_procs import spawn
from torch import nn

import slipstream as ss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIGS = [("direct", "broadcast"), ("cached", "broadcast"), ("cached", "auto")]


def _weights(version: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {}
    for i, size in enumerate([1, 7, 1000, 40_000, 300_000]):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = (torch.randn(size, generator=g) * 100).to(dtype)
            out[f"p{i}_{str(dtype)[6:]}"] = t.to(device)
    return out


def _deliver(rank: int, port: int) -> dict[str, bool]:
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=30)
    delivered = {}
    for mode, transport in CONFIGS:
        channel = f"{mode}-{transport}"
        if rank == 0:
            pub = ss.WeightPublisher(
                group,
                [0],
                [1],
                bucket_bytes=1 << 20,
                mode=mode,
                transport=transport,
                channel=channel,
            )
            with pub:
                for version in (1, 2):
                    handle = pub.publish(_weights(version, "cuda"), version=version)
                    assert handle.delivered.result(timeout=30) == version
        else:
            target = nn.Module()
            for name, t in _weights(0, "cuda").items():
                target.register_buffer(name, torch.zeros_like(t))
            with ss.WeightSubscriber(group, [0], [1], channel=channel) as sub:
                for version in (1, 2):
                    assert sub.receive(target) == version
                    want = _weights(version, "cpu")
                    delivered[f"{channel} v{version}"] = all(
                        target.get_buffer(k).is_cuda and torch.equal(target.get_buffer(k).cpu(), t)
                        for k, t in want.items()
                    )
    group.close()
    return delivered


def test_device_weights_reach_a_device_module_bit_exact():
    delivered = spawn(_deliver, 2, timeout=120)[1]
    assert delivered and all(delivered.values()), delivered


def _deliver_over_ipc(rank: int, port: int) -> dict[str, object]:
    """Both processes on the one GPU in a group whose transfer device is the GPU (backend
    nccl: colocated ranks over ipc build no NCCL communicator at all)."""
    torch.cuda.set_device(0)
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, backend="nccl", timeout=30)
    out: dict[str, object] = {}
    for mode in ("direct", "cached"):
        if rank == 0:
            with ss.WeightPublisher(group, [0], [1], bucket_bytes=1 << 20, mode=mode) as pub:
                out[f"{mode} transport"] = pub.transport
                for version in (1, 2, 3):
                    named = _weights(version, "cuda")
                    handle = pub.publish(named, version=version)
                    for t in named.values():  # changes after staged never reach the rollout
                        t.fill_(7)
                    assert handle.delivered.result(timeout=30) == version
                    out[f"{mode} v{version} timings"] = handle.timings.transport
        else:
            target = nn.Module()
            for name, t in _weights(0, "cuda").items():
                target.register_buffer(name, torch.zeros_like(t))
            with ss.WeightSubscriber(group, [0], [1]) as sub:
                for version in (1, 2, 3):
                    assert sub.receive(target) == version
                    want = _weights(version, "cpu")
                    out[f"{mode} v{version}"] = all(
                        target.get_buffer(k).is_cuda and torch.equal(target.get_buffer(k).cpu(), t)
                        for k, t in want.items()
                    )
    group.close()
    return out


def test_colocated_device_weights_sync_exact_through_cuda_ipc():
    out = spawn(_deliver_over_ipc, 2, timeout=120)
    assert all(v == "ipc" for k, v in out[0].items()), out[0]
    assert out[1] and all(out[1].values()), out[1]
