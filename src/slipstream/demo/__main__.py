"""slipstream's demo: checkpoint every step for (almost) free, survive SIGKILL, resume exactly.

    python -m slipstream.demo            # ~1-2 minutes on 2 cores
    python -m slipstream.demo --tiny     # seconds: the same phases on a toy model

Phases, each on 2 local training processes joined by gloo, training with slipstream FSDP:
1. reference: train without checkpoints (the step time to beat, and the weights to match);
2. checkpointed: the same run, saving asynchronously every step, SIGKILLed mid-run;
3. resumed: restart from ``Checkpointer.latest()`` and train to the end;
then check that the resumed run's weights and optimizer state equal the reference's bit
for bit, and print what checkpointing cost the training loop.
4. rl: the trainers go on from the last checkpoint, saving every step, and publish their
weights every few steps to a third process, a rollout worker, which generates tokens with
each version; they must match the tokens the trainers generate with their own weights. The
phase is traced: ``trace.json`` (open it in Perfetto) and ``timeline.png`` (its last steps
on one time axis) are written to the output directory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import Checkpointer
from ..core import tracing
from .model import ModelConfig
from .rollout import RlPhase, read_generated, rollout, trace_path, trainer
from .train import Phase, StepRecord, read_records, run

WORLD_SIZE = 2
PHASE_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(phase: Phase, expect_killed: bool = False) -> None:
    """Run ``phase`` on ``WORLD_SIZE`` training processes."""
    port = _free_port()
    run_processes(
        {f"{phase.name}-rank{r}": (run, (r, WORLD_SIZE, port, phase)) for r in range(WORLD_SIZE)},
        expect_killed,
    )


def run_processes(targets: dict[str, tuple], expect_killed: bool = False) -> None:
    """Start one process per ``name -> (function, args)``; join them all, with a timeout."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=fn, args=args, name=name) for name, (fn, args) in targets.items()]
    for p in procs:
        p.start()
    for p in procs:
        p.join(PHASE_TIMEOUT_S)
    hung = [p.name for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    if hung:
        raise SystemExit(f"demo: {hung} did not finish within {PHASE_TIMEOUT_S:.0f} s")
    expected = -signal.SIGKILL if expect_killed else 0
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode != expected]
    if bad:
        raise SystemExit(f"demo: processes exited with unexpected codes {bad}")


def _steady(records: list[StepRecord]) -> list[StepRecord]:
    """Steps after each phase's first (which plans the save and allocates staging buffers)."""
    return records[1:] if len(records) > 1 else records


def _equal_states(a: object, b: object, path: str = "") -> list[str]:
    """Paths at which two nested states differ (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} (keys differ)"]
        return [d for k in a for d in _equal_states(a[k], b[k], f"{path}.{k}".lstrip("."))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _equal_states(x, y, f"{path}.{i}")]
    return [] if a == b else [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="demo_out", help="working directory (recreated)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-at", type=int, default=7, help="step at which to SIGKILL")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rl-steps", type=int, default=6, help="training steps of the RL phase")
    parser.add_argument("--publish-every", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a toy model: seconds, not minutes")
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.steps - 1:
        parser.error("--kill-at must leave steps before and after it")

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = ModelConfig.tiny() if args.tiny else ModelConfig()
    common = dict(out_dir=str(out), steps=args.steps, model=cfg, batch_size=args.batch_size)

    print(f"== 1/4 reference: {args.steps} steps on {WORLD_SIZE} processes, no checkpoints")
    launch(Phase("reference", **common))
    print(f"== 2/4 checkpointed: saving every step, killed with SIGKILL at step {args.kill_at}")
    launch(Phase("checkpointed", checkpoint=True, kill_at=args.kill_at, **common), True)
    print("== 3/4 resumed: from the latest committed checkpoint to the end")
    launch(Phase("resumed", checkpoint=True, resume=True, **common))

    reference = read_records(str(out), "reference")
    saving = _steady(read_records(str(out), "checkpointed")) + _steady(
        read_records(str(out), "resumed")
    )
    base_ms = statistics.median(r.seconds for r in _steady(reference)) * 1e3
    with_ms = statistics.median(r.seconds for r in saving) * 1e3
    blocked_ms = statistics.median(r.save_blocked for r in saving) * 1e3
    ckpt_mib: float = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file())
    ckpt_mib /= 2**20 * max(1, len(list((out / "checkpoints").glob("step_*"))))
    print()
    print(f"checkpoint size per step: {ckpt_mib:.0f} MiB (model + AdamW state, DCP format)")
    print(f"median step time without checkpoints: {base_ms:8.1f} ms")
    print(f"median step time saving every step:   {with_ms:8.1f} ms ({with_ms / base_ms - 1:+.1%})")
    print(f"median time the save cost the loop:   {blocked_ms:8.2f} ms per step")
    if (os.cpu_count() or 1) <= WORLD_SIZE:
        print(
            f"  (this host has {os.cpu_count()} cores for {WORLD_SIZE} training processes, so the "
            "saver's copies and writes take CPU from training; these phases also run one after "
            "the other, so host drift shows here too: benchmarks/checkpoint.py measures the "
            "per-step cost in interleaved rounds, on this setup and with a spare core)"
        )

    for rank in range(WORLD_SIZE):
        ref_state = torch.load(out / f"reference.rank{rank}.final.pt", weights_only=True)
        resumed_state = torch.load(out / f"resumed.rank{rank}.final.pt", weights_only=True)
        diffs = _equal_states(ref_state, resumed_state)
        if diffs:
            print(f"FAILED: rank {rank}'s resumed shards differ from the reference at {diffs[:5]}")
            return 1
    print("resumed run matches the uninterrupted reference bit for bit: OK")
    return run_rl(out, cfg, args)


def run_rl(out: Path, cfg: ModelConfig, args: argparse.Namespace) -> int:
    """Phase 4: trainers publish to a rollout process; its generations must match theirs."""
    with Checkpointer(out / "checkpoints") as ck:
        latest = ck.latest()
    if latest is None:
        print("FAILED: no committed checkpoint to start the rl phase from")
        return 1
    start = latest + 1
    phase = RlPhase(str(out), WORLD_SIZE, args.rl_steps, args.publish_every, cfg, args.batch_size)
    print(
        f"\n== 4/4 rl: {args.rl_steps} more steps, weights published every "
        f"{args.publish_every} steps to a rollout process that generates with them"
    )
    train_port, sync_port = _free_port(), _free_port()
    targets: dict[str, tuple[Callable[..., None], tuple[object, ...]]] = {
        f"trainer-rank{r}": (trainer, (r, train_port, sync_port, phase)) for r in range(WORLD_SIZE)
    }
    targets["rollout"] = (rollout, (sync_port, start, phase))
    run_processes(targets)
    write_timeline(out)
    theirs, ours = read_generated(str(out), "rollout"), read_generated(str(out), "trainer")
    if not ours or theirs != ours:
        print(f"FAILED: rollout generated {theirs}, trainers generated {ours}")
        return 1
    print(f"rollout generations match the trainers' for versions {sorted(map(int, ours))}: OK")
    return 0


def write_timeline(out: Path) -> None:
    """Merge the rl phase's traces into one file and draw its last steps as a picture."""
    parts = [trace_path(str(out), f"trainer{r}") for r in range(WORLD_SIZE)]
    parts.append(trace_path(str(out), "rollout"))
    trace = tracing.merge(parts, out / "trace.json")
    for part in parts:
        part.unlink()
    print(f"trace of the rl phase (open in https://ui.perfetto.dev): {trace}")
    try:
        import matplotlib  # noqa: F401  (the demo, test and bench extras install it)
    except ImportError:
        print('  (pip install "slipstream[demo]" to draw it as a picture)')
        return
    from .timeline import render

    png = render(trace, out / "timeline.png", trainer="trainer rank 0")
    print(f"timeline of its last steps: {png}")


if __name__ == "__main__":
    sys.exit(main())
