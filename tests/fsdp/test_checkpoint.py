"""Sharded FSDP state through ss.save/ss.load and dcp.save/dcp.load, resharded 2 -> 4 ranks."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_workers
from fsdp_helpers import LR, data, fsdp_step, full_state, make_model, max_diff, shard

import slipstream as ss


def _train_and_save(rank: int, world_size: int, root: str) -> None:
    model = make_model()
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(3):
        fsdp_step(model, opt, step, rank)
    state = model.state_dict()
    ss.save(state, f"{root}/ss")
    dcp.save(state, checkpoint_id=f"{root}/dcp")
    full = full_state(model)
    if rank == 0:
        torch.save(full, f"{root}/reference.pt")


def _load_resharded(rank: int, world_size: int, root: str) -> None:
    reference = torch.load(f"{root}/reference.pt")
    plain = make_model(seed=7)
    plain.load_state_dict(reference)
    expected_loss = plain.loss(data(9, rank))

    for seed, load in (
        (1, lambda sd: ss.load(sd, f"{root}/ss")),
        (2, lambda sd: dcp.load(sd, checkpoint_id=f"{root}/dcp")),
    ):
        model = make_model(seed=seed)
        shard(model)
        assert max_diff(full_state(model), reference) > 1e-2
        state = model.state_dict()
        load(state)
        assert max_diff(full_state(model), reference) == 0.0
        # The next forward gathers the loaded main weights.
        loss = model.loss(data(9, rank))
        assert torch.allclose(loss, expected_loss, atol=1e-6), (loss, expected_loss)
        loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        opt.step()


def test_save_on_2_ranks_load_into_4_ranks(tmp_path):
    run_workers(_train_and_save, 2, str(tmp_path))
    run_workers(_load_resharded, 4, str(tmp_path))
