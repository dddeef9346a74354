"""slipstream FSDP on a CUDA device under NCCL: gathers on the communication stream, and the
trained weights match one process training the unsharded model on the same device.

Skipped without a CUDA device (CI has none); README.md's Development section says how to run
them on one. One GPU allows one NCCL rank, so this runs world size 1: the gathers, copies
and stream orderings all run, the cross-rank arithmetic is the CPU tests' job.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_workers
from fsdp_helpers import LR, data, full_state, make_model, max_diff, reference_step, shard

import slipstream as ss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train_on_device(rank: int, world_size: int, tmp: str) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    ref = make_model().to(dev)
    model = copy.deepcopy(ref)
    ctx = shard(model, device=dev)
    assert ctx.comm.stream is not None
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(4):
        model.loss(data(step, rank).to(dev)).backward()
        opt.step()
        opt.zero_grad()
        reference_step(ref, ref_opt, step, world_size, device=dev)
    ctx.wait()
    assert max_diff(full_state(model), full_state(ref)) < 1e-5
    assert ctx.stats.prefetch_count > 0
    # the sharded state on the device checkpoints and reloads through the pinned path
    ss.save(model.state_dict(), checkpoint_id=f"{tmp}/fsdp")
    want = {k: v.clone() for k, v in full_state(model).items()}  # at world size 1 a view
    for unit in ctx.units:
        for group in unit.groups:
            group.main.zero_()  # the flat storage every local shard views
    assert max_diff(full_state(model), want) > 0
    ss.load(model.state_dict(), checkpoint_id=f"{tmp}/fsdp")
    assert max_diff(full_state(model), want) == 0


def test_fsdp_on_the_device_trains_like_one_process(tmp_path):
    run_workers(_train_on_device, 1, str(tmp_path), backend="nccl")
