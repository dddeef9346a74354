"""One training process of the demo: slipstream FSDP over gloo, checkpointed with slipstream.

Each phase of the demo runs this on every rank. A phase is a plain dataclass, so the
orchestrator (``__main__``) says what to do and the worker reports back through files in
the output directory: nothing is shared but the filesystem and the process group.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from ..checkpoint import Checkpointer
from ..fsdp import FsdpContext, fully_shard
from .model import ModelConfig, TinyGPT, batch, build_model

GROUP_TIMEOUT_S = 120.0


@dataclass
class Phase:
    """What one run of the training processes does."""

    name: str
    out_dir: str
    steps: int
    model: ModelConfig = field(default_factory=ModelConfig)
    batch_size: int = 4
    checkpoint: bool = False
    resume: bool = False
    kill_at: int | None = None
    """SIGKILL every rank right after starting the save of this step."""


class TrainState:
    """Model, optimizer and step as one Stateful object (the pattern DCP recommends)."""

    def __init__(self, model: TinyGPT, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, -1

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.step = sd["step"]


def shard_model(model: TinyGPT) -> FsdpContext:
    """Each transformer block is an FSDP unit, the rest belongs to the root unit."""
    ctx = FsdpContext(release_delay=2)
    for block in model.blocks:
        fully_shard(block, context=ctx)
    fully_shard(model, context=ctx)
    return ctx


@dataclass
class StepRecord:
    step: int
    loss: float
    seconds: float
    save_blocked: float
    """Seconds this step spent in slipstream calls: starting the save and waiting on staging."""


def join_training_group(rank: int, world_size: int, port: int) -> None:
    """One compute thread per process (2 ranks share 2 cores) and the trainers' gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )


def run(rank: int, world_size: int, port: int, phase: Phase) -> None:
    """Train ``phase.steps`` steps on this rank; write step records and its final shards."""
    join_training_group(rank, world_size, port)
    try:
        _train(rank, phase)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(rank: int, phase: Phase) -> None:
    out = Path(phase.out_dir)
    model = build_model(phase.model, seed=0)
    fsdp = shard_model(model)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = TrainState(model, optim)
    ck = Checkpointer(out / "checkpoints", keep_last=2) if phase.checkpoint else None
    records: list[StepRecord] = []
    try:
        if phase.resume and ck is not None:
            ck.load({"train": state})
            _log(rank, f"[{phase.name}] resumed from committed step {state.step}")
        pending = None
        for step in range(state.step + 1, phase.steps):
            start = time.perf_counter()
            loss = model.loss(batch(step, rank, phase.batch_size, phase.model))
            loss.backward()
            blocked = 0.0
            if pending is not None:
                t = time.perf_counter()
                pending.staging_completion.result()
                blocked += time.perf_counter() - t
            optim.step()
            optim.zero_grad()
            state.step = step
            if ck is not None:
                t = time.perf_counter()
                pending = ck.save(step, {"train": state})
                blocked += time.perf_counter() - t
            rec = StepRecord(step, loss.item(), time.perf_counter() - start, blocked)
            records.append(rec)
            _log(
                rank,
                f"[{phase.name}] step {step:3d}/{phase.steps - 1}  loss {rec.loss:.4f}  "
                f"{rec.seconds * 1e3:7.1f} ms"
                + (f"  (save cost the loop {blocked * 1e3:.2f} ms)" if ck is not None else ""),
            )
            _write_records(out, phase, rank, records)
            if len(records) == 1:
                fsdp.reset_stats()  # the first step records the unit order and cannot prefetch
            if phase.kill_at == step:
                _log(rank, f"[{phase.name}] SIGKILL at step {step}, with its save in flight")
                os.kill(os.getpid(), signal.SIGKILL)
        if ck is not None:
            ck.wait()
        stats = fsdp.stats
        _log(
            rank,
            f"[{phase.name}] FSDP: {stats.hidden_allgather_fraction:.0%} of "
            f"{stats.allgather_seconds:.2f} s of all-gathers hidden behind compute, at most "
            f"{stats.peak_live_units} blocks unsharded at once",
        )
    finally:
        if ck is not None:
            ck.close()
    local = tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v, state.state_dict())
    torch.save(local, out / f"{phase.name}.rank{rank}.final.pt")


def _write_records(out: Path, phase: Phase, rank: int, records: list[StepRecord]) -> None:
    path = out / f"{phase.name}.rank{rank}.json"
    path.write_text(json.dumps([asdict(r) for r in records]))


def read_records(out_dir: str, name: str, rank: int = 0) -> list[StepRecord]:
    path = Path(out_dir) / f"{name}.rank{rank}.json"
    return [StepRecord(**r) for r in json.loads(path.read_text())] if path.exists() else []


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)
