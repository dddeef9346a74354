"""Shared pieces of the FSDP tests: a small model with uneven shapes, data, and references.

The model is the demo's TinyGPT at sizes chosen so that dim-0 sizes do not divide the world
size (vocab 101, 9 positions over 4 ranks gives one rank no rows), which exercises padding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from slipstream.demo.model import ModelConfig, TinyGPT, batch, build_model
from slipstream.fsdp import FsdpContext, MixedPrecision, fully_shard

CFG = ModelConfig(vocab=101, dim=20, layers=3, heads=4, seq_len=9)
LR = 1e-2


def data(step: int, rank: int) -> torch.Tensor:
    return batch(step, rank, 2, CFG)


def make_model(seed: int = 0) -> TinyGPT:
    return build_model(CFG, seed)


def shard(
    model: TinyGPT,
    release_delay: int = 2,
    nested: bool = False,
    mp: MixedPrecision | None = None,
    overlap_reduce_scatter: bool = True,
    device: torch.device | str = "cpu",
) -> FsdpContext:
    """Blocks (and, if ``nested``, each block's MLP up-projection inside them), then the root."""
    ctx = FsdpContext(
        release_delay=release_delay, overlap_reduce_scatter=overlap_reduce_scatter, device=device
    )
    for block in model.blocks:
        if nested:
            fully_shard(block.up, context=ctx)
        fully_shard(block, context=ctx)
    fully_shard(model, context=ctx, mixed_precision=mp)
    return ctx


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full plain tensor (DTensors via ``full_tensor``)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def reference_step(
    ref: TinyGPT,
    opt: torch.optim.Optimizer,
    step: int,
    world_size: int,
    micro_batches: int = 1,
    compute_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """One data-parallel step on one process: every rank's batches, gradients averaged.

    Gradients are averaged per micro-batch, then accumulated, in the order FSDP sums them
    (AdamW amplifies rounding differences in near-zero gradients such as the key bias's).
    With ``compute_dtype`` each rank's forward/backward runs on a copy cast to it, and the
    gradients are cast back to fp32 before averaging: the casts FSDP mixed precision does.
    """
    grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters() if p.requires_grad}
    for micro in range(micro_batches):
        averaged = {n: torch.zeros_like(g) for n, g in grads.items()}
        for r in range(world_size):
            work = ref if compute_dtype is None else copy.deepcopy(ref).to(compute_dtype)
            work.zero_grad()
            work.loss(data(step * micro_batches + micro, r).to(device)).backward()
            for n, p in work.named_parameters():
                if p.requires_grad and p.grad is not None:
                    averaged[n] += p.grad.float()
        for n, g in averaged.items():
            grads[n] += g / world_size
    for n, p in ref.named_parameters():
        if p.requires_grad:
            p.grad = grads[n]
    opt.step()
    opt.zero_grad()


def fsdp_step(
    model: TinyGPT, opt: torch.optim.Optimizer, step: int, rank: int, micro_batches: int = 1
) -> None:
    for micro in range(micro_batches):
        model.loss(data(step * micro_batches + micro, rank)).backward()
    opt.step()
    opt.zero_grad()
