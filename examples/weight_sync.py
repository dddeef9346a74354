"""A trainer and a rollout process: the trainer publishes its weights every few steps.

After the first version arrives, the rollout loses its weights (as an inference engine that
restarts would) and refetches them from the trainer's cache without waiting for a publish.

python examples/weight_sync.py --steps 6 --every 2
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

import slipstream as ss


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def trainer(port: int, steps: int, every: int) -> None:
    group = ss.sync.init_group("127.0.0.1", port, world_size=2, rank=0, timeout=60)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ss.WeightPublisher(group, trainer_ranks=[0], rollout_ranks=[1], mode="cached") as pub:
        for step in range(1, steps + 1):
            loss = model(torch.randn(8, 64)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % every == 0:
                handle = pub.publish(model.state_dict(), version=step)
                handle.staged.result(timeout=60)  # weights may change from here on
        handle.delivered.result(timeout=60)
        checksum = sum(p.double().sum().item() for p in model.parameters())
        print(
            f"trainer: last version {step}, rollouts hold {pub.rollout_versions}, "
            f"checksum {checksum:.6f}",
            flush=True,
        )
    group.close()


def rollout(port: int, steps: int, every: int) -> None:
    group = ss.sync.init_group("127.0.0.1", port, world_size=2, rank=1, timeout=60)
    model = make_model()
    with ss.WeightSubscriber(group, trainer_ranks=[0], rollout_ranks=[1]) as sub:
        for i in range(steps // every):
            version = sub.receive(model)
            print(f"rollout: now at version {version}", flush=True)
            if i == 0:
                for layer in model:
                    if isinstance(layer, nn.Linear):
                        layer.reset_parameters()  # the engine restarted: its weights are gone
                version = sub.refetch(model)  # served by the trainer's publisher thread
                print(f"rollout: refetched version {version} from the trainer's cache", flush=True)
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"rollout: version {sub.version}, checksum {checksum:.6f}", flush=True)
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=fn, args=(port, args.steps, args.every)) for fn in (trainer, rollout)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("a process failed")


if __name__ == "__main__":
    main()
