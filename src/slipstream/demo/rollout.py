"""The demo's RL phase: FSDP trainers checkpoint every step and push weights to a rollout
process every few steps, each process recording a trace (``trace.<who>.json``).

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
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer
from ..core import tracing
from ..sync import WeightPublisher, WeightSubscriber, init_group
from .model import ModelConfig, TinyGPT, batch, build_model
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


def trace_path(out_dir: str, who: str) -> Path:
    return Path(out_dir) / f"trace.{who}.json"


def trainer(rank: int, train_port: int, sync_port: int, phase: RlPhase) -> None:
    tracing.start(trace_path(phase.out_dir, f"trainer{rank}"))
    tracing.set_process_name(f"trainer rank {rank}")
    join_training_group(rank, phase.trainers, train_port)
    group = init_group("127.0.0.1", sync_port, phase.trainers + 1, rank, timeout=SYNC_TIMEOUT_S)
    try:
        _train_and_publish(rank, group, phase)
    finally:
        group.close()
        dist.destroy_process_group()
        tracing.stop()


def _train_and_publish(rank: int, group, phase: RlPhase) -> None:
    model = build_model(phase.model, seed=0)
    shard_model(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = TrainState(model, optim)
    ck = Checkpointer(Path(phase.out_dir) / "checkpoints", keep_last=2)
    ck.load({"train": state})
    start = state.step + 1
    generated: dict[int, list[int]] = {}
    pub = WeightPublisher(group, list(range(phase.trainers)), [phase.rollout_rank], mode=phase.mode)
    pending = None
    with ck, pub:
        for step in range(start, start + phase.steps):
            publish = step in phase.versions(start)
            with tracing.span("train.step", step=step, publish=publish):
                _step(model, optim, batch(step, rank, phase.batch_size, phase.model), pending)
                state.step = step
                with tracing.span("train.save_call"):
                    pending = ck.save(step, {"train": state})
                if not publish:
                    continue
                begin = time.perf_counter()
                begin_ns = time.monotonic_ns()
                with tracing.span("train.publish_call", version=step):
                    handle = pub.publish(model.state_dict(), version=step)
                    handle.staged.result(SYNC_TIMEOUT_S)
                blocked = time.perf_counter() - begin
            track = f"weight sync (version {step})"  # a publish may outlive the next one's start
            _trace_until(handle.delivered, begin_ns, f"publish version {step}", track)
            sync_seconds = _time_to(handle.delivered, begin)
            with tracing.span("train.generate", version=step):
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


def _step(model: TinyGPT, optim: torch.optim.Optimizer, data: torch.Tensor, pending: Any) -> None:
    """Forward, backward and the optimizer step, waiting for the previous save's staging
    before the optimizer writes the weights it copies."""
    with tracing.span("train.forward"):
        loss = model.loss(data)
    with tracing.span("train.backward"):
        loss.backward()
    if pending is not None:
        with tracing.span("train.wait_staging"):
            pending.staging_completion.result(SYNC_TIMEOUT_S)
    with tracing.span("train.optimizer"):
        optim.step()
        optim.zero_grad()


def _trace_until(fut: Future, begin_ns: int, name: str, track: str) -> None:
    """Trace the interval from ``begin_ns`` until ``fut`` resolves, on ``track``."""
    fut.add_done_callback(
        lambda _: tracing.record_interval(name, track, begin_ns, time.monotonic_ns())
    )


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
    tracing.start(trace_path(phase.out_dir, "rollout"))
    tracing.set_process_name("rollout")
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
                with tracing.span("slipstream.sync.receive"):
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
        tracing.stop()
    _write(phase, "rollout", generated)


def _write(phase: RlPhase, who: str, generated: dict[int, list[int]]) -> None:
    Path(phase.out_dir, f"rl.{who}.json").write_text(json.dumps(generated))


def read_generated(out_dir: str, who: str) -> dict[str, list[int]]:
    return json.loads(Path(out_dir, f"rl.{who}.json").read_text())
