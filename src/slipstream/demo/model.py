"""The demo's model: a small decoder-only transformer in plain PyTorch, made up on the spot.

Deterministic by construction (seeded init, no dropout), so two runs that see the same
batches end with bit-identical weights, which is what the demo's resume check relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class ModelConfig:
    vocab: int = 4096
    dim: int = 512
    layers: int = 5
    heads: int = 8
    seq_len: int = 128

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A model small enough for tests: same code paths, milliseconds per step."""
        return cls(vocab=128, dim=32, layers=2, heads=4, seq_len=16)


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the same weights always give the same tokens."""
        tokens = prompt
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.cfg.seq_len :])
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens


def batch(step: int, rank: int, batch_size: int, cfg: ModelConfig) -> torch.Tensor:
    """Synthetic token batch for ``(step, rank)``: the same in every run of the demo."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=g)


def build_model(cfg: ModelConfig, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(cfg)
