"""slipstream as verl's checkpoint engine, on Ray actors: one trainer, two rollouts.

verl picks the transport between its actor and its rollout replicas by name from its
``CheckpointEngineRegistry``; ``custom_backend_module=slipstream.integrations.verl``
registers ``"slipstream"``. Each actor here builds its engine as verl's workers do
(``CheckpointEngineRegistry.new(backend, bucket_size=..., is_master=...)``), and this driver
plays verl's ``CheckpointEngineManager``: on every update ``prepare`` on every worker,
``build_topology``, ``init_process_group``, ``send_weights`` / ``receive_weights``, then
``finalize``. The sync group's store is hosted by the trainer at the node IP Ray gives it.

Half-way through, rollout 2's actor is killed and Ray restarts it: its new engine takes the
free rank and joins the running group there; the trainer and the other rollout go on.

python examples/verl_backend.py --updates 4 --kill-after 2

Prints one JSON line at the end: each update's channel and the version each rollout holds,
and whether every rollout's weights equal the trainer's exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import ray
import torch
from torch import nn
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

BACKEND = "slipstream"
MODULE = "slipstream.integrations.verl"
BUCKET = 1 << 20
TIMEOUT = 180.0
"""Bounds each wait on an actor, sized for a loaded machine (an actor's first call starts
its process and imports torch); a peer that dies is still named within seconds, by the
heartbeats, whatever this is."""


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def new_engine(**built_with):
    import_external_libs(MODULE)  # what verl does with custom_backend_module
    return CheckpointEngineRegistry.new(BACKEND, bucket_size=BUCKET, timeout=TIMEOUT, **built_with)


@ray.remote(num_cpus=0)
class Trainer:
    """verl's actor worker: trains, then hands its engine one tensor per item."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model = make_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.engine = new_engine(is_master=True)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    def train_and_send(self, global_steps):
        loss = self.model(torch.randint(0, 512, (8, 16))).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        weights = ((k, v.detach()) for k, v in self.model.state_dict().items())
        return asyncio.run(self.engine.send_weights(weights, global_steps))

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)
class Rollout:
    """verl's CheckpointEngineWorker beside an inference engine: what receive_weights
    yields is loaded into the engine's model (here an nn.Module)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.model = make_model()
        self.engine = new_engine()

    def call(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    def update_weights(self, global_steps):
        params = self.model.state_dict()

        async def load() -> None:
            async for name, tensor in self.engine.receive_weights(global_steps):
                params[name].copy_(tensor)

        asyncio.run(load())
        return self.engine.version

    def pid(self) -> int:
        return os.getpid()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def update(trainer, rollouts: list, global_steps) -> dict:
    """One ``CheckpointEngineManager.update_weights``, as verl's manager sequences it."""
    workers = [trainer, *rollouts]
    metadata = ray.get([w.call.remote("prepare") for w in workers], timeout=TIMEOUT)
    cls = CheckpointEngineRegistry.get(BACKEND)
    actor_kwargs, rollout_kwargs = cls.build_topology(1, len(rollouts), metadata)
    # each keyword's list holds one entry per worker; the manager passes them by name
    inits = [
        trainer.call.remote("init_process_group", **{k: v[0] for k, v in actor_kwargs.items()})
    ]
    for i, r in enumerate(rollouts):
        kwargs = {k: v[i] for k, v in rollout_kwargs.items()}
        inits.append(r.call.remote("init_process_group", **kwargs))
    ray.get(inits, timeout=TIMEOUT)
    sent = trainer.train_and_send.remote(global_steps)
    held = ray.get([r.update_weights.remote(global_steps) for r in rollouts], timeout=TIMEOUT)
    ray.get(sent, timeout=TIMEOUT)
    ray.get([w.call.remote("finalize") for w in workers], timeout=TIMEOUT)
    topology = actor_kwargs["topology"][0]
    ranks = [t.rank for t in rollout_kwargs["topology"]]
    return {"channel": topology.channel, "host": topology.host, "ranks": ranks, "versions": held}


def wait_for_restart(actor, old_pid: int) -> int:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            pid = ray.get(actor.pid.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            pid = None
        if pid is not None and pid != old_pid:
            return pid
        time.sleep(0.2)
    raise TimeoutError(f"rollout actor (pid {old_pid}) was not restarted by Ray in time")


def run(updates: int, kill_after: int) -> dict:
    trainer = Trainer.remote()
    rollouts = [Rollout.remote(), Rollout.remote()]
    events = []
    for u in range(updates):
        event = update(trainer, rollouts, global_steps=u)
        print(f"update {u}: {event}", flush=True)
        events.append(event)
        if u + 1 == kill_after:
            old = ray.get(rollouts[1].pid.remote(), timeout=TIMEOUT)
            ray.kill(rollouts[1], no_restart=False)
            new = wait_for_restart(rollouts[1], old)
            events.append({"killed": 1, "old_pid": old, "new_pid": new})
    final = ray.get(trainer.weights.remote(), timeout=TIMEOUT)
    exact = []
    for r in rollouts:
        held = ray.get(r.weights.remote(), timeout=TIMEOUT)
        same = held.keys() == final.keys() and all(torch.equal(held[k], final[k]) for k in final)
        exact.append(same)
    ray.get([w.call.remote("close") for w in [*rollouts, trainer]], timeout=TIMEOUT)
    return {"events": events, "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--kill-after", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = run(args.updates, args.kill_after)
    finally:
        ray.shutdown()
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
