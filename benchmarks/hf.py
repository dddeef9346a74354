"""Hugging Face import benchmark: ss.load of a save_pretrained directory into FSDP2-style
DTensor shards, against DCP's Hugging Face reader and two hand-written loops.

A Llama built from a config (about 400 MB of fp32, random weights) is written once by
``save_pretrained`` into a temporary directory. Then 1 and 4 ranks (spawned processes,
gloo on 127.0.0.1, a one-dimensional CPU mesh) each hold every weight as a DTensor sharded
``Shard(0)`` (the layout ``fully_shard`` gives parameters) and fill it, in rounds, with:

* ``ss.load``: slipstream's import (ranged reads straight into each rank's shard);
* ``dcp.load + HuggingFaceStorageReader``: PyTorch DCP's Hugging Face reader;
* ``safetensors load_file + copy``: each rank reads the whole file, then copies its rows;
* ``safe_open get_slice + copy``: each rank slices its rows of each tensor with
  safetensors and copies them in, no planning at all (the reference the import is held to).

The file is in the page cache (a warm load: what a job reads right after a download or
a previous run). Every loader runs once per round, in a new order each round; a rank's
time is from a barrier to its last byte, and a round's time is the slowest rank's.
Medians over the rounds.

    python benchmarks/hf.py --out benchmarks/results/hf.json
    python benchmarks/hf.py --quick            # a small model, a few rounds (~1 min)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Result, Table, free_port, join_all, median, scratch  # noqa: E402

SS = "ss.load"
DCP = "dcp.load + HuggingFaceStorageReader"
LOAD_FILE = "safetensors load_file + copy"
SLICE = "safe_open get_slice + copy (reference)"
LOADERS = [SS, DCP, LOAD_FILE, SLICE]
SHUFFLE_SEED = 0


def llama_config(quick: bool) -> Any:
    import transformers

    if quick:
        sizes = dict(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=2)
    else:
        sizes = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8)
    return transformers.LlamaConfig(
        **sizes, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False
    )


def write_model(directory: Path, quick: bool) -> int:
    """Write the benchmark's Llama with save_pretrained; return its bytes on disk."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config(quick))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(directory)
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def rank_main(rank: int, world: int, port: int, directory: str, rounds: int, queue) -> None:
    """One rank: allocate the shards once, then time every loader in every round."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, empty

    import slipstream as ss

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    try:
        mesh = init_device_mesh("cpu", (world,))
        files = sorted(str(p) for p in Path(directory).glob("*.safetensors"))
        shapes = {}
        for file in files:
            with safe_open(file, "pt") as f:
                shapes.update({k: (file, f.get_slice(k).get_shape()) for k in f.keys()})
        sd = {
            k: empty(shape, dtype=torch.float32, device_mesh=mesh, placements=[Shard(0)])
            for k, (_, shape) in shapes.items()
        }
        for v in sd.values():
            v.to_local().zero_()

        def rows(key: str) -> tuple[int, int]:
            local = sd[key].to_local()
            full = -(-shapes[key][1][0] // world)
            return min(rank * full, shapes[key][1][0]), local.shape[0]

        def by_load_file() -> None:
            for file in files:
                for k, full in load_file(file).items():
                    start, n = rows(k)
                    sd[k].to_local().copy_(full.narrow(0, start, n))

        def by_slice() -> None:
            for file in files:
                with safe_open(file, "pt") as f:
                    for k in f.keys():
                        start, n = rows(k)
                        sd[k].to_local().copy_(f.get_slice(k)[start : start + n])

        loaders = {
            SS: lambda: ss.load(sd, directory),
            DCP: lambda: dcp.load(sd, storage_reader=HuggingFaceStorageReader(directory)),
            LOAD_FILE: by_load_file,
            SLICE: by_slice,
        }
        order = list(loaders)
        rng = random.Random(SHUFFLE_SEED)
        times: dict[str, list[float]] = {name: [] for name in loaders}
        for rnd in range(rounds + 1):
            rng.shuffle(order)
            for name in order:
                for v in sd.values():
                    v.to_local().zero_()
                dist.barrier()
                start = time.perf_counter()
                loaders[name]()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if not all(v.to_local().any() for v in sd.values() if v.to_local().numel()):
                    raise AssertionError(f"{name} left a shard of rank {rank} empty")
                if rnd > 0:
                    times[name].append(float(elapsed))
        if rank == 0:
            queue.put(times)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, directory: Path, rounds: int, timeout: float) -> dict[str, list[float]]:
    """Spawn ``world`` ranks running :func:`rank_main`; rank 0's times, within ``timeout``.
    Every process is joined, and killed if it does not exit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, str(directory), rounds, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        times: dict[str, list[float]] = queue.get(timeout=timeout)
        return times
    finally:
        join_all(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, a few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (7; quick 3)")
    parser.add_argument("--worlds", default="1,4", help="rank counts, comma-separated")
    parser.add_argument("--dir", default="/tmp/slipstream-bench/hf", help="scratch directory")
    parser.add_argument("--out", default=None, help="result JSON (benchmarks/results/hf.json)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    worlds = [int(w) for w in args.worlds.split(",")]

    result = Result(
        "hf",
        "Hugging Face import: ss.load vs DCP's HuggingFaceStorageReader, safetensors, "
        "and a bare slice + copy, into DTensor shards",
    )
    result.note_load("start")
    with scratch(args.dir) as directory:
        nbytes = write_model(directory, args.quick)
        cfg = llama_config(args.quick)
        result.setup["model"] = (
            f"Llama from a config ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"vocabulary {cfg.vocab_size}, untied), {nbytes / 2**20:.0f} MiB of fp32 in "
            f"{len(list(directory.glob('*.safetensors')))} file(s) written by save_pretrained"
        )
        result.setup["rounds"] = (
            f"1 warm-up + {rounds}, every loader once a round in a new order (seed "
            f"{SHUFFLE_SEED}); seconds of the slowest rank, medians; warm page cache"
        )
        medians: dict[int, dict[str, float]] = {}
        for world in worlds:
            times = run_ranks(world, directory, rounds, timeout=1800)
            medians[world] = {name: median(times[name]) for name in LOADERS}
            print(world, {k: round(v, 4) for k, v in medians[world].items()}, flush=True)
    result.note_load("end")

    for world, med in medians.items():
        rows = [[name, med[name], med[name] / med[SS]] for name in LOADERS]
        result.tables.append(
            Table(
                f"{world} rank{'s' if world > 1 else ''}, each weight a DTensor Shard(0) "
                "(seconds, medians; x = loader / ss.load)",
                ["loader", "seconds", "x"],
                rows,
            )
        )
        vs_dcp = med[DCP] / med[SS]
        result.floor(
            f"{world} rank(s): DCP's Hugging Face reader / ss.load", vs_dcp, ">= 1.6", vs_dcp >= 1.6
        )
        vs_slice = med[SS] / med[SLICE]
        result.floor(
            f"{world} rank(s): ss.load / bare slice + copy",
            vs_slice,
            "<= 1.25",
            vs_slice <= 1.25,
        )
    result.notes.append(
        f"The machine is shared ({os.cpu_count()} cores; the load averages above say how busy "
        "it was) and every loader ran in the same rounds, so the ratios are fairer than the "
        "absolute times. With more ranks than cores the ranks also compete with each other."
    )
    if args.out:
        result.write(args.out)


if __name__ == "__main__":
    main()
