"""Framework checkpoint benchmark: the training-loop time a save costs with the Hugging Face
Trainer and accelerate, their own saves against slipstream's integrations.

One model (a Llama built from a config, fp32, random weights) with AdamW state after one
step: a checkpoint of weights + both Adam moments of ``--params-m`` million parameters
(the default gives about 700 MB). The peers run in two groups, the Trainer's and
accelerate's (``GROUPS`` says why), each in rounds of its own that run each of its peers
once, in a new seeded order, on the same model and optimizer:

* ``no save``: ``--steps`` training steps (forward, backward, optimizer step);
* ``Trainer._save_checkpoint``: the Trainer's default save (safetensors + ``torch.save``
  of the optimizer and scheduler, RNG, trainer_state.json, rotation), then the steps;
* ``SlipstreamTrainer``: the same call on ``SlipstreamTrainer`` (the same files, the
  Trainer's own; it returns once the state is copied into reused host memory and the small
  files are written, and the rest is written, fsynced and renamed into place in the
  background), then the steps;
* ``Accelerator.save_state``, ``SlipstreamAccelerator.save_state`` (the same files,
  accelerate's own; it returns once they are written and fsynced) and
  ``SlipstreamAccelerator(background_write=True)`` (it returns once the state is copied
  into host memory; the same files are written in the background), then the steps;
* a bare copy and durable write (a lower bound, no checkpoint format): a thread copies the
  weights and moments into one buffer and writes it with ``O_DIRECT`` and an fsync, the
  first optimizer step waiting for the copy. No asynchronous checkpoint that reaches the
  disk does less, so its round cost is what this host charges for durability alone.

Every peer runs in two environments, interleaved in the same rounds: ``all cores``
(training on torch's default intra-op threads, one per usable core, so slipstream's
staging and write threads compete with the steps for every core) and ``a core to spare``
(``torch.set_num_threads(usable cores - 1)`` for the peer's steps and save, as on a GPU host
whose training leaves host cores idle). Each is reported and has its floors.

Two costs of a save to the training loop: the time the training thread waited (the save
call; for the bare writer also its copy wait before the next optimizer step), and the round
cost, the round's time minus the same round's ``no save`` time: the wait plus what the
background work slowed the steps that ran beside it (on few busy cores, most of it).
slipstream's background write is then waited for outside the
timed region, so it never overlaps another peer, and so is the kernel's writeback of what
any peer left in the page cache (``os.sync``: the Trainer's and accelerate's saves return
before their files are on disk), which would otherwise land in another peer's round. A
third figure is the work a save adds:
the process's CPU seconds (every thread) over the same round's ``no save`` run, counted
until the background work is done. Medians over the rounds.

    python benchmarks/hf_trainer_checkpoint.py --out benchmarks/results/hf_trainer.json
    python benchmarks/hf_trainer_checkpoint.py --quick     # a small model, 2 rounds
    python benchmarks/hf_trainer_checkpoint.py --group accelerate   # one group only
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Result, Table, fmt, interleave, median, scratch  # noqa: E402

from slipstream.core.threads import usable_cores  # noqa: E402

NONE = "no save"
TRAINER = "Trainer._save_checkpoint"
SS_TRAINER = "SlipstreamTrainer"
ACCEL = "Accelerator.save_state"
SS_ACCEL = "SlipstreamAccelerator.save_state"
SS_BACKGROUND = "SlipstreamAccelerator(background_write=True)"
BARE = "bare copy + durable write (a lower bound)"
SHUFFLE_SEED = 0
GROUPS = {
    "Trainer": [NONE, TRAINER, SS_TRAINER, BARE],
    "accelerate": [NONE, ACCEL, SS_ACCEL, SS_BACKGROUND, BARE],
}
"""Peers measured together, each group in rounds of its own. slipstream keeps one staging
buffer per process for the layout it saved last, so the Trainer's state and accelerate's
(different keys) in the same rounds would make every save of one allocate and fault in a
new buffer after a save of the other, which a job using one framework never does."""
PAIRS = [(SS_TRAINER, TRAINER), (SS_BACKGROUND, ACCEL)]
ALL_CORES = "all cores"
SPARE_CORE = "a core to spare"


def environments() -> dict[str, int]:
    """Each environment's torch intra-op thread count for the training steps."""
    cores = usable_cores()
    return {ALL_CORES: cores, SPARE_CORE: max(1, cores - 1)}


def env_runner(bench: Bench, env: str, threads: int, name: str) -> Any:
    """A runner for :func:`interleave`: ``name`` in ``env``, with training on ``threads``."""

    def run(_rep: int) -> dict[str, float]:
        torch.set_num_threads(threads)
        return bench.run(name)

    return run


def llama(params_m: float) -> Any:
    """A Llama with about ``params_m`` million parameters (untied embeddings)."""
    import transformers

    hidden = 512 if params_m >= 20 else 128
    vocab = 32000 if params_m >= 20 else 4000
    per_layer = 4 * hidden * hidden + 3 * hidden * 3 * hidden
    layers = max(1, round((params_m * 1e6 - 2 * vocab * hidden) / per_layer))
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Bench:
    """The shared model, optimizer and scheduler, and the four savers wrapped around them."""

    def __init__(self, root: Path, params_m: float, steps: int) -> None:
        import transformers
        from accelerate import Accelerator

        from slipstream.integrations.accelerate import SlipstreamAccelerator
        from slipstream.integrations.transformers import SlipstreamTrainer

        self.root = root
        self.steps = steps
        self.model = llama(params_m)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        g = torch.Generator().manual_seed(1)
        self.batch = torch.randint(0, self.model.config.vocab_size, (1, 64), generator=g)
        self.step(lambda: None)  # Adam's moments exist from here on

        def args(name: str) -> Any:
            return transformers.TrainingArguments(
                output_dir=str(root / name),
                save_total_limit=1,
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
            )

        self.trainer = transformers.Trainer(
            model=self.model, args=args("trainer"), optimizers=(self.optimizer, self.scheduler)
        )
        self.ss_trainer = SlipstreamTrainer(
            model=self.model, args=args("ss_trainer"), optimizers=(self.optimizer, self.scheduler)
        )
        self.accelerator = Accelerator(cpu=True)
        self.accelerator.prepare(self.model, self.optimizer, self.scheduler)
        self.ss_accelerator = SlipstreamAccelerator(cpu=True)
        self.ss_accelerator.prepare(self.model, self.optimizer, self.scheduler)
        self.ss_background = SlipstreamAccelerator(cpu=True, background_write=True)
        self.ss_background.prepare(self.model, self.optimizer, self.scheduler)
        self.bare = BareWriter(self.tensors(), root / "bare.bin")
        self.saves = 0

    def tensors(self) -> list[torch.Tensor]:
        """The weights and Adam's two moments, the tensors every peer saves."""
        params = list(self.model.parameters())
        moments = [self.optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        return params + moments

    def nbytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return 3 * weights  # the weights and Adam's two moments

    def step(self, before_optimizer_step: Any) -> None:
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        before_optimizer_step()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def steps_after(self, before_first: Any) -> None:
        self.step(before_first)
        for _ in range(self.steps - 1):
            self.step(lambda: None)

    def _trainer_save(self, trainer: Any) -> None:
        self.saves += 1
        trainer.state.global_step = self.saves
        trainer._save_checkpoint(self.model, trial=None)

    def run(self, name: str) -> dict[str, float]:
        waited = 0.0

        def timed_wait(wait: Any) -> Any:
            def before_optimizer_step() -> None:
                nonlocal waited
                start = time.perf_counter()
                wait()
                waited += time.perf_counter() - start

            return before_optimizer_step

        cpu_start = process_cpu()
        start = time.perf_counter()
        if name == NONE:
            self.steps_after(lambda: None)
        elif name == TRAINER:
            self._trainer_save(self.trainer)
            waited = time.perf_counter() - start
            self.steps_after(lambda: None)
        elif name == SS_TRAINER:
            self._trainer_save(self.ss_trainer)
            waited = time.perf_counter() - start
            self.steps_after(lambda: None)
        elif name == BARE:
            copy = self.bare.start()
            self.steps_after(timed_wait(copy.result))
        else:
            accelerator, folder = {
                ACCEL: (self.accelerator, "accelerate"),
                SS_ACCEL: (self.ss_accelerator, "ss_accelerate"),
                SS_BACKGROUND: (self.ss_background, "ss_background"),
            }[name]
            path = self.root / folder
            shutil.rmtree(path, ignore_errors=True)  # save_state keeps every directory
            cpu_start = process_cpu()  # the deletion is not the save's
            start = time.perf_counter()
            accelerator.save_state(str(path))
            waited = time.perf_counter() - start
            self.steps_after(lambda: None)
        elapsed = time.perf_counter() - start
        # The background write finishes outside the timed region, before the next peer.
        background = time.perf_counter()
        self.ss_trainer.wait_for_checkpoints()
        self.ss_accelerator.wait_for_checkpoints()
        self.ss_background.wait_for_checkpoints()
        self.bare.join()
        background = time.perf_counter() - background
        cpu = process_cpu() - cpu_start
        # What the save left in the page cache is written back now, before the next peer:
        # otherwise the kernel's writeback of one peer's files lands in another's round.
        flush = time.perf_counter()
        os.sync()
        return {
            "seconds": elapsed,
            "waited": waited,
            "background": background,
            "cpu": cpu,
            "flush": time.perf_counter() - flush,
        }


class BareWriter:
    """The least any asynchronous, durable checkpoint of these tensors can do: one thread
    copies them into one page-aligned buffer, then writes it with ``O_DIRECT`` in 64 MiB
    pieces and fsyncs; no checksums, no metadata, no Python between pieces. The training
    loop waits for the copy before its optimizer step."""

    PIECE = 64 * 1024 * 1024

    def __init__(self, tensors: list[torch.Tensor], path: Path) -> None:
        from slipstream.core.buffers import PAGE_BYTES, allocate_host

        self.tensors = tensors
        self.path = path
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.buffer = allocate_host(-(-total // PAGE_BYTES) * PAGE_BYTES, pin=False)
        self.thread: threading.Thread | None = None
        self.copied: Future[None] = Future()

    def start(self) -> Future[None]:
        self.copied = Future()
        self.thread = threading.Thread(target=self._run, name="bare-writer")
        self.thread.start()
        return self.copied

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _run(self) -> None:
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            self.buffer[offset : offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
            offset += n
        self.copied.set_result(None)
        data = memoryview(self.buffer.numpy())
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        try:
            for start in range(0, len(data), self.PIECE):
                os.pwrite(fd, data[start : start + self.PIECE], start)
            os.fsync(fd)
        finally:
            os.close(fd)


def process_cpu() -> float:
    """CPU seconds this process has used (every thread, user and system)."""
    times = os.times()
    return times.user + times.system


def paired(kept: dict[str, dict[str, list[float]]], name: str, metric: str) -> list[float]:
    """Per round: ``name``'s ``metric`` less the ``no save`` run's in the same round (rounds
    drift on a shared host; a difference within a round cancels what they share)."""
    return [ours - base for ours, base in zip(kept[name][metric], kept[NONE][metric], strict=True)]


def quartiles(values: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values * 3)
    return f"{fmt(q1)} to {fmt(q3)}"


def report(
    result: Result, group: str, env: str, kept: dict[str, dict[str, list[float]]], steps: int
) -> None:
    """The table and the floors of one group in one environment, from its measurements."""
    names = list(kept)
    med = {name: median(kept[name]["seconds"]) for name in names}
    waited = {name: median(kept[name]["waited"]) for name in names}
    costs = {name: paired(kept, name, "seconds") for name in names}
    cost = {name: median(costs[name]) for name in names}
    cpu = {name: median(paired(kept, name, "cpu")) for name in names}
    background = {name: median(kept[name]["background"]) for name in names}
    flush = {name: median(kept[name]["flush"]) for name in names}
    print(group, env, {k: round(v, 3) for k, v in waited.items()})
    print(group, env, {k: round(v, 3) for k, v in cost.items()})
    result.tables.append(
        Table(
            f"{group}, {env}: a save, then {steps} training steps (seconds, medians over rounds). "
            "waited: what the training thread waited for (the save call, and for the bare "
            "writer its copy wait before the next optimizer step); round cost: the round's time "
            f"less the '{NONE}' run's in the same round (the wait plus what background work "
            "slowed the steps beside it), with its quartiles; CPU: the process's CPU seconds "
            f"over the '{NONE}' run's in the same round, every thread, until the save's "
            "background work is done; background: slipstream's write still running after "
            "the steps; left to flush: how long writing back what the save left in the page "
            "cache took afterwards (os.sync, outside the round: the framework's own saves "
            "return before their files are on disk, slipstream's before its commit)",
            [
                "peer",
                "seconds",
                "waited",
                "round cost",
                "round cost quartiles",
                "CPU s",
                "background",
                "left to flush s",
            ],
            [
                [
                    n,
                    med[n],
                    waited[n],
                    cost[n],
                    quartiles(costs[n]),
                    cpu[n],
                    background[n],
                    flush[n],
                ]
                for n in names
            ],
        )
    )
    for ours, theirs in [(a, b) for a, b in PAIRS if a in kept and b in kept]:
        ratio = waited[ours] / waited[theirs]
        result.floor(
            f"{env}: {ours} / {theirs}: time the training loop waits", ratio, "<= 0.2", ratio <= 0.2
        )
        if cost[theirs] <= 0:  # the framework's own save was lost in the noise: no verdict
            result.floor(f"{env}: {ours} / {theirs}: round cost", float("nan"), "<= 0.2", False)
            continue
        ratio = max(cost[ours], 0.0) / cost[theirs]
        result.floor(f"{env}: {ours} / {theirs}: round cost", ratio, "<= 0.2", ratio <= 0.2)
    if SS_ACCEL in kept and ACCEL in kept:
        result.notes.append(
            f"{group}, {env}: {SS_ACCEL} (the same files as {ACCEL}, written and fsynced "
            f"before it returns) waited {fmt(waited[SS_ACCEL])} s, "
            f"{fmt(waited[SS_ACCEL] / waited[ACCEL])}x {ACCEL} (which returns before its "
            "files are on disk)."
        )
    default = TRAINER if TRAINER in kept else ACCEL
    if cost[default] > 0:
        result.notes.append(
            f"{group}, {env}: the bare copy and durable write, the least any asynchronous "
            f"checkpoint that reaches the disk does, cost the round {fmt(cost[BARE])} s, "
            f"{fmt(cost[BARE] / cost[default])}x {default} (which returns before its files "
            "are on disk)."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (15; quick 2)")
    parser.add_argument("--params-m", type=float, default=None, help="millions (58; quick 3)")
    parser.add_argument("--steps", type=int, default=2, help="training steps after a save")
    parser.add_argument("--dir", default="/tmp/slipstream-bench/hf_trainer", help="scratch")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--group", choices=list(GROUPS), default=None, help="one group only")
    args = parser.parse_args()
    groups = {g: names for g, names in GROUPS.items() if args.group in (None, g)}
    rounds = args.rounds or (2 if args.quick else 15)
    params_m = args.params_m or (3.0 if args.quick else 58.0)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    result = Result(
        "hf_trainer",
        "Hugging Face Trainer and accelerate: the training-loop time a checkpoint costs, "
        "their own saves against slipstream's",
    )
    result.note_load("start")
    envs = environments()
    with scratch(args.dir) as root:
        bench = Bench(root, params_m, args.steps)
        params = sum(p.numel() for p in bench.model.parameters())
        result.setup["model"] = (
            f"Llama from a config, {params / 1e6:.1f} M parameters, fp32, AdamW after one "
            f"step: {bench.nbytes() / 1e6:.0f} MB of weights + Adam moments"
        )
        result.setup["rounds"] = (
            f"per group ({', '.join(f'{g}: {len(n)} peers' for g, n in groups.items())}), "
            f"1 warm-up + {rounds}, every peer once a round in a new order (seed "
            f"{SHUFFLE_SEED}); each: one save then {args.steps} training steps (batch 1 x 64 "
            "tokens); medians"
        )
        result.setup["environments"] = (
            f"every peer in each, interleaved in the same rounds: {ALL_CORES!r} (torch "
            f"intra-op threads {envs[ALL_CORES]}, every usable core) and {SPARE_CORE!r} "
            f"(torch.set_num_threads({envs[SPARE_CORE]}), usable cores - 1)"
        )
        kept = {
            group: interleave(
                {
                    f"{env} / {name}": env_runner(bench, env, threads, name)
                    for env, threads in envs.items()
                    for name in names
                },
                repeats=rounds,
                shuffle_seed=SHUFFLE_SEED,
            )
            for group, names in groups.items()
        }
    result.note_load("end")
    for group, names in groups.items():
        for env in envs:
            by_name = {name: kept[group][f"{env} / {name}"] for name in names}
            report(result, group, env, by_name, args.steps)

    result.notes.append(
        f"The machine is shared ({os.cpu_count()} cores; the load averages above say how busy "
        "it was). slipstream's staging copy and background write run on threads beside the "
        "training steps, so on few cores part of their work shows up as slower steps: that "
        "is counted in the round cost, not in the wait. In 'all cores' training uses every "
        "core, so those threads take their time from the steps; 'a core to spare' leaves "
        "them one, as a GPU host, whose steps run on the device, leaves its cores mostly "
        "idle. Other jobs on the shared machine can still take that core. A negative round "
        "cost (noise) counts as 0 in its ratio."
    )
    if args.out:
        result.write(args.out)


if __name__ == "__main__":
    main()
