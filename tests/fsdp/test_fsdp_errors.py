"""Misconfigurations raise FsdpError naming the unit, on every rank, before a collective hangs."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers
from fsdp_helpers import CFG, data, make_model, shard
from torch import nn

from slipstream.demo.model import ModelConfig, TinyGPT
from slipstream.errors import FsdpError
from slipstream.fsdp import FsdpContext, fully_shard


class Ordered(nn.Module):
    """Blocks run in ``self.order``: a model whose call order can differ by rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.order = [0, 1, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.blocks[i](x)
        return x


def _shard_ordered(model: Ordered) -> FsdpContext:
    ctx = FsdpContext()
    for block in model.blocks:
        fully_shard(block, context=ctx)
    fully_shard(model, context=ctx)
    return ctx


def _raises(match: str, fn) -> str:
    with pytest.raises(FsdpError, match=match) as info:
        fn()
    return str(info.value)


def _errors(rank: int, world_size: int) -> None:
    # Ranks whose modules disagree: rank 1 has a wider MLP in its last block.
    model = make_model()
    if rank == 1:
        model.blocks[2].up = nn.Linear(CFG.dim, 5 * CFG.dim)
        model.blocks[2].down = nn.Linear(5 * CFG.dim, CFG.dim)
    shard(model)
    msg = _raises("ranks disagree on the FSDP layout", lambda: model.loss(data(0, rank)))
    assert "blocks.2" in msg and "rank" in msg

    # Ranks whose call order disagrees: rank 1 runs the blocks backwards.
    ordered = Ordered()
    _shard_ordered(ordered)
    if rank == 1:
        ordered.order = [2, 1, 0]
    msg = _raises("call order", lambda: ordered(torch.ones(2, 4)))
    assert "blocks.0" in msg and "blocks.2" in msg

    # The order changes after the first (recorded) iteration, on every rank.
    ordered = Ordered()
    _shard_ordered(ordered)
    ordered(torch.ones(2, 4)).sum().backward()
    ordered.order = [0, 2, 1]
    msg = _raises("forward order changed", lambda: ordered(torch.ones(2, 4)))
    assert "blocks.2" in msg and "blocks.1" in msg

    # A unit run twice in one forward.
    ordered = Ordered()
    _shard_ordered(ordered)
    ordered.order = [0, 1, 1, 2]
    _raises("ran twice in one forward", lambda: ordered(torch.ones(2, 4)))

    # A parameter shared across units (tied between two blocks).
    tied = TinyGPT(ModelConfig.tiny())
    tied.blocks[1].up.weight = tied.blocks[0].up.weight
    ctx = FsdpContext()
    fully_shard(tied.blocks[0], context=ctx)
    msg = _raises("shared across units", lambda: fully_shard(tied.blocks[1], context=ctx))
    assert "up.weight" in msg and "Block" in msg

    # Unsupported modules: a 0-dim parameter; a module sharded twice.
    scalar = nn.Module()
    scalar.scale = nn.Parameter(torch.tensor(2.0))
    msg = _raises("unsupported", lambda: fully_shard(scalar, context=FsdpContext()))
    assert "'scale'" in msg and "shape ()" in msg
    ctx = FsdpContext()
    lin = fully_shard(nn.Linear(4, 4), context=ctx)
    _raises("called twice", lambda: fully_shard(lin, context=ctx))


def test_misconfigurations_raise_fsdp_error_on_every_rank():
    run_workers(_errors, 2)
