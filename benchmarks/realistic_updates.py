"""Realistic weight updates for delta sync: bf16 weights cast from fp32 masters after AdamW steps.

In RL post-training the trainer keeps fp32 master weights and an AdamW state, and publishes
the bf16 cast of the masters after every optimizer step. At the small learning rates of
post-training most bf16 values do not move from one step to the next: an update of about
``lr`` changes a weight's bf16 value only where it carries the master across a rounding
boundary. :class:`RealisticUpdates` reproduces that: tensors shaped like a transformer's
(matrices initialised N(0, 0.02), norm weights at 1), a gradient that is a fixed direction
per element (kept in bf16) plus fresh noise each step, and a real AdamW step
(bias-corrected first and second moments, decoupled weight decay) on the masters, each
tensor updated in place.

Used by ``benchmarks/sync.py`` (about 1 GiB of bf16) and by the tests (a few MiB).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def transformer_like_shapes(total_bytes: int, hidden: int = 2048) -> list[tuple[int, ...]]:
    """Shapes of about ``total_bytes`` of bf16 weights, laid out like transformer blocks:
    attention and MLP matrices of ``hidden`` columns and a norm vector per block."""
    per_block = [(hidden, hidden)] * 4 + [(4 * hidden, hidden), (hidden, 4 * hidden), (hidden,)]
    block_bytes = 2 * sum(_numel(s) for s in per_block)
    blocks = max(1, round(total_bytes / block_bytes))
    return [shape for _ in range(blocks) for shape in per_block]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class AdamW:
    """AdamW's hyper-parameters (torch.optim.AdamW's defaults but for the learning rate)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01


class RealisticUpdates:
    """fp32 masters with an AdamW state, and the bf16 weights cast from them.

    ``weights`` are the bf16 tensors a publisher sends; :meth:`step` runs one AdamW step on
    the masters and casts them into ``weights`` in place. ``seed`` fixes everything, so two
    instances built alike step through the same weights.
    """

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        signal: float = 1.0,
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.masters: list[torch.Tensor] = []
        self.direction: list[torch.Tensor] = []
        for shape in shapes:
            if len(shape) == 1:
                master = torch.ones(shape)
            else:
                master = torch.randn(shape, generator=self.gen) * 0.02
            self.masters.append(master)
            self.direction.append((torch.randn(shape, generator=self.gen) * signal).to(dtype))
        self.exp_avg = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.masters]
        self.weights = [m.to(dtype) for m in self.masters]
        self.steps = 0

    def step(self, opt: AdamW) -> float:
        """One AdamW step with gradient ``direction + N(0, 1)``; returns the fraction of
        bf16 values that changed."""
        self.steps += 1
        beta1, beta2 = opt.betas
        correction1 = 1 - beta1**self.steps
        correction2 = 1 - beta2**self.steps
        changed = 0
        total = 0
        for master, direction, m, v, w in zip(
            self.masters, self.direction, self.exp_avg, self.exp_avg_sq, self.weights, strict=True
        ):
            grad = torch.randn(master.shape, generator=self.gen).add_(direction)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = v.div(correction2).sqrt_().add_(opt.eps)
            master.mul_(1 - opt.lr * opt.weight_decay)
            master.addcdiv_(m, denom, value=-opt.lr / correction1)
            before = w.clone()
            w.copy_(master)
            changed += int(torch.ne(before.view(torch.int16), w.view(torch.int16)).sum())
            total += w.numel()
        return changed / max(1, total)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)
