"""The demo's RL phase: FSDP trainers push weights to a rollout process every few steps.

Ranks ``0 .. WORLD_SIZE-1`` of the sync group train (slipstream FSDP over their own gloo
group) and publish; the last rank is a rollout with a plain, unsharded copy of the model
and no default process group. After each publish the trainers generate a few tokens with
their own weights and the rollout generates with what it received; the orchestrator
checks the two agree token for token, version by version.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer
from ..sync import WeightPublisher, WeightSubscriber, init_group
from .model import ModelConfig, batch, build_model
from .train import TrainState, join_training_group, shard_model

SYNC_TIMEOUT_S = 120.0
PROMPT = [[1, 2, 3, 4]]
NEW_TOKENS = 8


@dataclass
class RlPhase:
    """Train ``steps`` more steps from the latest checkpoint, publishing every ``every``."""

    out_dir: str
    trainers: int
    steps: int
    every: int
    model: ModelConfig = field(default_factory=ModelConfig)
    batch_size: int = 4
    mode: str = "cached"

    @property
    def rollout_rank(self) -> int:
        return self.trainers

    def versions(self, start: int) -> list[int]:
        return [s for s in range(start, start + self.steps) if (s - start + 1) % self.every == 0]


def trainer(rank: int, train_port: int, sync_port: int, phase: RlPhase) -> None:
    join_training_group(rank, phase.trainers, train_port)
    group = init_group("127.0.0.1", sync_port, phase.trainers + 1, rank, timeout=SYNC_TIMEOUT_S)
    try:
        _train_and_publish(rank, group, phase)
    finally:
        group.close()
        dist.destroy_process_group()


def _train_and_publish(rank: int, group, phase: RlPhase) -> None:
    model = build_model(phase.model, seed=0)
    shard_model(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = TrainState(model, optim)
    with Checkpointer(Path(phase.out_dir) / "checkpoints") as ck:
        ck.load({"train": state})
    start = state.step + 1
    generated: dict[int, list[int]] = {}
    pub = WeightPublisher(group, list(range(phase.trainers)), [phase.rollout_rank], mode=phase.mode)
    with pub:
        for step in range(start, start + phase.steps):
            model.loss(batch(step, rank, phase.batch_size, phase.model)).backward()
            optim.step()
            optim.zero_grad()
            if step not in phase.versions(start):
                continue
            begin = time.perf_counter()
            handle = pub.publish(model.state_dict(), version=step)
            handle.staged.result(SYNC_TIMEOUT_S)
            blocked = time.perf_counter() - begin
            sync_seconds = _time_to(handle.delivered, begin)
            tokens = model.generate(torch.tensor(PROMPT), NEW_TOKENS)
            generated[step] = tokens[0, len(PROMPT[0]) :].tolist()
            if rank == 0:
                print(
                    f"[rl] trainer published version {step} over {pub.transport}: blocked "
                    f"{blocked * 1e3:.0f} ms, "
                    f"every rollout held it {sync_seconds.result(SYNC_TIMEOUT_S) * 1e3:.0f} ms "
                    f"after the publish; generates {generated[step]}",
                    flush=True,
                )
        if rank == 0:
            print(f"[rl] rollout versions seen by the trainer: {pub.rollout_versions}", flush=True)
    if rank == 0:
        _write(phase, "trainer", generated)


def _time_to(fut: Future, begin: float) -> Future:
    """A future of the seconds from ``begin`` until ``fut`` resolved (its error, if it failed)."""
    seconds: Future = Future()

    def stamp(done: Future) -> None:
        if done.exception() is not None:
            seconds.set_exception(done.exception())
        else:
            seconds.set_result(time.perf_counter() - begin)

    fut.add_done_callback(stamp)
    return seconds


def rollout(sync_port: int, start: int, phase: RlPhase) -> None:
    torch.set_num_threads(1)
    group = init_group(
        "127.0.0.1", sync_port, phase.trainers + 1, phase.rollout_rank, timeout=SYNC_TIMEOUT_S
    )
    model = build_model(phase.model, seed=1)
    generated: dict[int, list[int]] = {}
    try:
        with WeightSubscriber(group, list(range(phase.trainers)), [phase.rollout_rank]) as sub:
            for _ in phase.versions(start):
                begin = time.perf_counter()
                version = sub.receive(model)
                took = time.perf_counter() - begin
                tokens = model.generate(torch.tensor(PROMPT), NEW_TOKENS)
                generated[version] = tokens[0, len(PROMPT[0]) :].tolist()
                print(
                    f"[rl] rollout holds version {version} ({took * 1e3:.0f} ms after asking, "
                    f"waiting for the trainers included); generates {generated[version]}",
                    flush=True,
                )
    finally:
        group.close()
    _write(phase, "rollout", generated)


def _write(phase: RlPhase, who: str, generated: dict[int, list[int]]) -> None:
    Path(phase.out_dir, f"rl.{who}.json").write_text(json.dumps(generated))


def read_generated(out_dir: str, who: str) -> dict[str, list[int]]:
    return json.loads(Path(out_dir, f"rl.{who}.json").read_text())
