"""Weight sync between Ray actors: one trainer and two rollouts, one of which dies and comes back.

RL frameworks (verl, OpenRLHF, NeMo-RL, SkyRL) run the trainer and the inference engines as
Ray actors. Here the trainer actor hosts the sync group (rank 0) and publishes its weights
after each step; the rollout actors (ranks 1 and 2) receive them in place. Half-way through,
rollout 2 is killed; Ray restarts it (``max_restarts``), its constructor joins the group again
at its old rank, and its first receive brings it to the trainer's latest version. The other
rollout and the trainer go on without being rebuilt.

python examples/ray_weight_sync.py --steps 6 --kill-after 3

Prints one JSON line at the end: each rollout's version and whether its weights equal the
trainer's exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import ray
import torch
from torch import nn

import slipstream as ss

ROLLOUT_RANKS = [1, 2]
WORLD_SIZE = 1 + len(ROLLOUT_RANKS)
TIMEOUT = 180.0
"""Bounds each wait on an actor, sized for a loaded machine (an actor's first call starts
its process and imports torch); a peer that dies is still named within seconds, by the
heartbeats, whatever this is."""


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


@ray.remote(num_cpus=0)
class Trainer:
    """Rank 0: hosts the sync group's store, trains, and publishes (cached mode: a rollout that
    comes back is served from the trainer's host copy)."""

    def __init__(self, port: int) -> None:
        torch.set_num_threads(1)
        self.group = ss.sync.init_group("127.0.0.1", port, WORLD_SIZE, rank=0, timeout=TIMEOUT)
        self.model = make_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.pub = ss.WeightPublisher(
            self.group, trainer_ranks=[0], rollout_ranks=ROLLOUT_RANKS, mode="cached"
        )

    def train_and_publish(self, step: int) -> dict:
        tokens = torch.randint(0, 512, (8, 16))
        loss = self.model(tokens).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        handle = self.pub.publish(self.model.state_dict(), version=step)
        delivered = handle.delivered.result(timeout=TIMEOUT)
        return {"version": step, "delivered": str(delivered)}

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        self.pub.close()
        self.group.close()


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
class Rollout:
    """A rollout rank. Its constructor is also what runs when Ray restarts it: it joins the
    group at the same rank and subscribes again; its first receive brings the latest version."""

    def __init__(self, port: int, rank: int) -> None:
        torch.set_num_threads(1)
        self.group = ss.sync.init_group("127.0.0.1", port, WORLD_SIZE, rank=rank, timeout=TIMEOUT)
        self.model = make_model()
        self.sub = ss.WeightSubscriber(self.group, trainer_ranks=[0], rollout_ranks=ROLLOUT_RANKS)

    def receive(self) -> int:
        return self.sub.receive(self.model)

    def pid(self) -> int:
        return os.getpid()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        self.sub.close()
        self.group.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_restart(actor, old_pid: int, deadline: float) -> int:
    """Ray restarts a killed actor asynchronously: wait until it answers from a new process."""
    while time.monotonic() < deadline:
        try:
            pid = ray.get(actor.pid.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            pid = None
        if pid is not None and pid != old_pid:
            return pid
        time.sleep(0.2)
    raise TimeoutError(f"rollout actor (pid {old_pid}) was not restarted by Ray in time")


def run(steps: int, kill_after: int) -> dict:
    port = free_port()
    trainer = Trainer.remote(port)
    rollouts = {rank: Rollout.remote(port, rank) for rank in ROLLOUT_RANKS}
    killed_rank = ROLLOUT_RANKS[-1]
    events = []
    for step in range(1, steps + 1):
        receives = {rank: actor.receive.remote() for rank, actor in rollouts.items()}
        published = ray.get(trainer.train_and_publish.remote(step), timeout=TIMEOUT)
        versions = {rank: ray.get(ref, timeout=TIMEOUT) for rank, ref in receives.items()}
        events.append({"step": step, "published": published, "received": versions})
        print(f"step {step}: rollouts hold {versions}", flush=True)
        if step == kill_after:
            victim = rollouts[killed_rank]
            old_pid = ray.get(victim.pid.remote(), timeout=TIMEOUT)
            ray.kill(victim, no_restart=False)
            new_pid = wait_for_restart(victim, old_pid, time.monotonic() + TIMEOUT)
            print(f"rollout {killed_rank}: pid {old_pid} killed, now {new_pid}", flush=True)
            events.append({"killed": killed_rank, "old_pid": old_pid, "new_pid": new_pid})
    final = ray.get(trainer.weights.remote(), timeout=TIMEOUT)
    exact = {}
    for rank, actor in rollouts.items():
        held = ray.get(actor.weights.remote(), timeout=TIMEOUT)
        exact[rank] = held.keys() == final.keys() and all(
            torch.equal(held[k], final[k]) for k in final
        )
    for actor in [*rollouts.values(), trainer]:
        ray.get(actor.close.remote(), timeout=TIMEOUT)
    return {"steps": steps, "events": events, "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = run(args.steps, args.kill_after)
    finally:
        ray.shutdown()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
