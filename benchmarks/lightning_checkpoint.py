"""Lightning benchmark: the training-loop time each checkpoint costs, by CheckpointIO.

One process trains an MLP with Adam under Lightning (CPU) whose checkpoint (weights and
Adam's two moments) is over 500 MB. ``ModelCheckpoint(every_n_train_steps=N)`` saves during
the run; each run trains the same steps with one of:

* ``none``: no checkpoints (the loop's own time, the baseline);
* ``TorchCheckpointIO``: Lightning's default, ``torch.save`` on the training thread;
* ``AsyncCheckpointIO``: Lightning's threaded wrapper (clones every tensor on the training
  thread, then ``torch.save`` on a thread);
* ``SlipstreamCheckpointIO()``: ``slipstream.integrations.lightning`` as it comes, Lightning's
  own write on the training thread, then an fsync;
* ``SlipstreamCheckpointIO(background_write=True)``: the tensors copied into reused host
  memory on the training thread, the same file written on a thread of its own.

Every CheckpointIO writes the same file: one ``torch.save`` archive per checkpoint.

A run's loop time is from the first training batch's start to the last one's end. A
save's cost is (loop time - the ``none`` run's loop time in the same round) / saves: the
time the save held the training thread plus the time its background work slowed the
other steps. The saves leave steps after the last one for its background write to
finish inside the loop; the wait at ``teardown`` after the loop is reported beside it.
"held" is the median step that ran a save less the run's median plain step: the training
thread's wait alone. Runs are interleaved, in a new order each round; medians over rounds
(whole runs drift on a shared host, so the rounds are many).

    python benchmarks/lightning_checkpoint.py --out benchmarks/results/lightning.json
    python benchmarks/lightning_checkpoint.py --quick        # a small model, 2 rounds
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Result, Table, fmt, median, scratch  # noqa: E402

NONE = "none (no checkpoints)"
TORCH = "TorchCheckpointIO (default)"
ASYNC = "AsyncCheckpointIO"
SLIPSTREAM_SYNC = "SlipstreamCheckpointIO() (default)"
SLIPSTREAM = "SlipstreamCheckpointIO(background_write=True)"
PEERS = [NONE, TORCH, ASYNC, SLIPSTREAM_SYNC, SLIPSTREAM]
DIRECTORY = {
    NONE: "none",
    TORCH: "torch",
    ASYNC: "async",
    SLIPSTREAM_SYNC: "ss",
    SLIPSTREAM: "ss_bg",
}
SHUFFLE_SEED = 0


def build_module(width: int, depth: int) -> Any:
    from lightning.pytorch import LightningModule

    class Mlp(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[torch.nn.Module] = []
            for _ in range(depth):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    return Mlp()


class LoopClock:
    """Times the training loop: first batch start to last batch end, and each step."""

    def __init__(self) -> None:
        self.start = self.end = 0.0
        self.step_starts: list[float] = []

    def callback(self) -> Any:
        from lightning.pytorch.callbacks import Callback

        clock = self

        class _Clock(Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                now = time.perf_counter()
                if not clock.step_starts:
                    clock.start = now
                clock.step_starts.append(now)

            def on_train_batch_end(self, *args: Any) -> None:
                clock.end = time.perf_counter()

        return _Clock()


def _size(path: Path) -> int:
    """Bytes of one checkpoint: a file, or a directory's files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_once(
    peer: str, args: argparse.Namespace, root: Path, nbytes: list[int]
) -> dict[str, float]:
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from slipstream.integrations.lightning import SlipstreamCheckpointIO

    seed_everything(0, verbose=False)
    model = build_module(args.width, args.depth)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch * args.steps, args.width, generator=g)
    data = DataLoader(TensorDataset(x, torch.zeros_like(x)), batch_size=args.batch)
    dirpath = root / DIRECTORY[peer]
    shutil.rmtree(dirpath, ignore_errors=True)
    plugins: list[Any] = []
    if peer == ASYNC:
        plugins = [AsyncCheckpointIO(TorchCheckpointIO())]
    elif peer == SLIPSTREAM_SYNC:
        plugins = [SlipstreamCheckpointIO()]
    elif peer == SLIPSTREAM:
        plugins = [SlipstreamCheckpointIO(background_write=True)]
    clock = LoopClock()
    callbacks: list[Any] = [clock.callback()]
    if peer != NONE:
        callbacks.append(
            ModelCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=1)
        )
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=plugins,
        callbacks=callbacks,
        enable_checkpointing=peer != NONE,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    teardown = time.perf_counter() - clock.end
    if peer == TORCH and not nbytes:
        nbytes.append(max(_size(entry) for entry in dirpath.iterdir()))
    if peer != NONE:
        files = sorted(p.name for p in dirpath.iterdir())
        assert files and all(p.endswith(".ckpt") and (dirpath / p).is_file() for p in files), files
    shutil.rmtree(dirpath, ignore_errors=True)
    os.sync()  # what is left to write back does so now, not in the next peer's run
    steps = [b - a for a, b in zip(clock.step_starts, clock.step_starts[1:], strict=False)]
    save_steps = {args.every * k for k in range(1, args.steps // args.every + 1)}
    # The interval starting at step index s (0-based) holds the save made after step s+1.
    with_save = [t for i, t in enumerate(steps) if (i + 1) in save_steps]
    plain = [t for i, t in enumerate(steps) if (i + 1) not in save_steps]
    return {
        "loop": clock.end - clock.start,
        "teardown": teardown,
        "save_step": median(with_save) if with_save else 0.0,
        "plain_step": median(plain),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (7; quick 2)")
    parser.add_argument("--dir", default="/tmp/slipstream-bench/lightning", help="scratch dir")
    parser.add_argument("--out", default=None, help="result JSON")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 7)
    args.width, args.depth = (512, 4) if args.quick else (2048, 11)
    args.batch, args.steps, args.every = 4, 23, 4
    torch.set_num_threads(os.cpu_count() or 1)

    result = Result(
        "lightning",
        "Lightning: training-loop time each checkpoint costs, SlipstreamCheckpointIO vs "
        "TorchCheckpointIO and AsyncCheckpointIO, each writing Lightning's .ckpt file",
    )
    result.note_load("start")
    nbytes: list[int] = []
    kept: dict[str, dict[str, list[float]]] = {p: {} for p in PEERS}
    rng = random.Random(SHUFFLE_SEED)
    order = list(PEERS)
    with scratch(args.dir) as root:
        for rnd in range(1 + rounds):
            rng.shuffle(order)
            measured = {peer: run_once(peer, args, root, nbytes) for peer in order}
            print(
                rnd,
                {p: {k: round(v, 3) for k, v in m.items()} for p, m in measured.items()},
                flush=True,
            )
            if rnd == 0:
                continue  # warm-up
            saves = args.steps // args.every
            for peer, m in measured.items():
                m["cost"] = (m["loop"] - measured[NONE]["loop"]) / saves
                m["held"] = m["save_step"] - m["plain_step"]
                for metric, value in m.items():
                    kept[peer].setdefault(metric, []).append(value)
    result.note_load("end")
    params = args.depth * (args.width * args.width + args.width)
    result.setup["model"] = (
        f"MLP of {args.depth} Linear({args.width}, {args.width}) layers, {params / 1e6:.1f} M "
        f"fp32 parameters, Adam; checkpoint {nbytes[0] / 2**20:.0f} MiB on disk (torch.save)"
    )
    result.setup["run"] = (
        f"{args.steps} steps of batch {args.batch}, ModelCheckpoint(every_n_train_steps="
        f"{args.every}, save_top_k=1): {args.steps // args.every} saves a run; CPU, "
        f"{torch.get_num_threads()} threads"
    )
    result.setup["rounds"] = (
        f"1 warm-up + {rounds}, every peer once a round in a new order (seed {SHUFFLE_SEED}); "
        "medians"
    )
    med = {p: {k: median(v) for k, v in kept[p].items()} for p in PEERS}
    rows = []
    for peer in PEERS:
        m = med[peer]
        rows.append(
            [
                peer,
                fmt(m["loop"]),
                fmt(m["cost"]) if peer != NONE else "-",
                fmt(m["cost"] / med[TORCH]["cost"]) if peer != NONE else "-",
                fmt(m["held"]) if peer != NONE else "-",
                fmt(m["teardown"]),
            ]
        )
    result.tables.append(
        Table(
            "Seconds, medians over rounds (cost = loop time over the no-checkpoint run's, per"
            " save;"
            " x = cost / TorchCheckpointIO's)",
            [
                "CheckpointIO",
                "loop s",
                "cost per save s",
                "x default",
                "held s",
                "teardown wait s",
            ],
            rows,
        )
    )
    ratio = med[SLIPSTREAM]["cost"] / med[TORCH]["cost"]
    result.floor(
        "SlipstreamCheckpointIO(background_write=True)'s loop cost per save / TorchCheckpointIO's",
        ratio,
        "<= 0.2",
        ratio <= 0.2,
    )
    to_async = med[SLIPSTREAM]["cost"] / med[ASYNC]["cost"]
    result.floor(
        "SlipstreamCheckpointIO(background_write=True)'s loop cost per save / AsyncCheckpointIO's",
        to_async,
        "<= 0.6",
        to_async <= 0.6,
    )
    result.notes.append(
        "held: the median step that ran a save less the run's median plain step, the "
        "training thread's wait alone; the cost per save adds what the save's background "
        "work (a copy, a write) took from the other steps on this host's cores. The default "
        "SlipstreamCheckpointIO() is synchronous because Lightning's flow reads a checkpoint "
        "as soon as save_checkpoint returns (trainer.save_checkpoint then torch.load in its "
        "own test_trainer.py::test_model_checkpoint_only_weights, and 19 more of its tests; "
        "docs/integrations/lightning.md)."
    )
    for row in rows:
        print(row)
    for f in result.floors:
        print(f)
    if args.out:
        result.write(args.out)


if __name__ == "__main__":
    main()
