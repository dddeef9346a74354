"""A slipstream-FSDP model publishes its sharded weights to a rollout through weight sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import free_port, run_workers
from fsdp_helpers import LR, fsdp_step, full_state, make_model

import slipstream as ss
from slipstream.fsdp import FsdpContext, fully_shard

TRAINERS = [0, 1]
ROLLOUT = 2


def _trainers_publish_rollout_receives(rank: int, world_size: int, sync_port: int, root: str):
    trainer_group = dist.new_group(TRAINERS)
    sync_group = ss.sync.init_group("127.0.0.1", sync_port, world_size, rank, timeout=60)
    try:
        if rank in TRAINERS:
            model = make_model()
            ctx = FsdpContext(group=trainer_group)
            for block in model.blocks:
                fully_shard(block, context=ctx)
            fully_shard(model, context=ctx)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            with ss.WeightPublisher(sync_group, TRAINERS, [ROLLOUT], bucket_bytes=4096) as pub:
                for step in range(2):
                    fsdp_step(model, opt, step, rank)
                    pub.publish(model.state_dict(), version=step + 1).delivered.result(60)
            trained = full_state(model)  # a collective over the trainers
            if rank == 0:
                torch.save(trained, f"{root}/trained.pt")
        else:
            rollout = make_model(seed=5)
            with ss.WeightSubscriber(sync_group, TRAINERS, [ROLLOUT]) as sub:
                versions = [sub.receive(rollout) for _ in range(2)]
            assert versions == [1, 2], versions
            torch.save(dict(rollout.named_parameters()), f"{root}/received.pt")
    finally:
        sync_group.close()


def test_sharded_fsdp_weights_reach_a_rollout_whole_and_exact(tmp_path):
    run_workers(_trainers_publish_rollout_receives, 3, free_port(), str(tmp_path))
    trained = torch.load(tmp_path / "trained.pt")
    received = torch.load(tmp_path / "received.pt")
    assert trained.keys() == received.keys()
    for name, tensor in trained.items():
        assert torch.equal(received[name].detach(), tensor), name
