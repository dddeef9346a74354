"""GPU benchmark: the CUDA paths, side by side with the peers, on a host with a CUDA device.

The development machine and CI have no GPU, so this runs where one is lent. Sections:

1. saves of ``--gib`` of state on the GPU (the checkpoint benchmark's tensors, moved to the
   device): caller blocked, staged and durable per peer, next to a warm device-to-host
   copy into pinned memory (the floor of staging) and a raw fsync'd write;
2. warm loads into existing GPU tensors, next to a host-to-device copy from pinned memory;
3. a training loop on the GPU (a GPT, bf16 autocast, fused AdamW) that checkpoints model
   and optimizer every K steps: the training time each save costs, per peer;
4. FSDP at world size 1 under NCCL: slipstream's against FSDP2's step time on one model
   (one GPU allows one NCCL rank, so this shows per-step overhead, not overlap).

    python benchmarks/gpu.py --out benchmarks/results/gpu.json
    python benchmarks/gpu.py --quick            # smoke test, a minute
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import (  # noqa: E402
    GIB,
    SavePeers,
    clear,
    default_stager,
    load_into,
    make_state,
    raw_write_seconds,
    state_bytes,
)
from common import Result, Table, interleave, median  # noqa: E402

SAVE_PEERS = [
    "torch.save",
    "dcp.save",
    "dcp.async_save",
    "dcp.async_save+DefaultStager",
    "ss.save",
    "ss.async_save",
]
LOAD_PEERS = ["torch.load", "dcp.load", "ss.load", "ss.load (dcp-written)"]
TRAIN_MODES = ["none", "ss.async_save", "dcp.async_save", "dcp.async_save+DefaultStager"]
D2H = "device -> pinned host copy"
H2D = "pinned host -> device copy"
NOTES = [
    "The targets are the checkpoint ones, applied to state on the GPU: the memcpy they are "
    "set against is a warm copy from the device into pinned host memory, and the loads go "
    "into existing GPU tensors.",
    "dcp.async_save+DefaultStager: pinned memory, staging on DCP's thread, non-blocking "
    "copies; no shared memory, which serves DCP's process-based upload executor (this is the "
    "thread-based one). Where async_save closes the stager it is given (torch 2.11), each "
    "save gets a new one (see default_stager in checkpoint.py).",
    "Training loop: ss.async_save's stall is mostly the wait for staging before the "
    "optimizer step: the copy of the checkpoint into pinned memory runs on a side stream "
    "beside the next forward and backward, and the optimizer must not change the state "
    "before it is done.",
]
FLOORS = [  # key in run()'s floors, claim, bound, whether the value must be at least it
    ("blocked", "caller blocked / dcp.async_save's (GPU state)", 0.05, False),
    ("staged", "staged / warm pinned device->host copy", 2.0, False),
    ("durable", "durable / raw fsync'd write", 1.2, False),
    ("load", "warm load into GPU tensors: dcp.load / ss.load", 2.0, True),
]
FAILED: dict[str, str] = {}
"""Peers that raised, with the error: they are left out of the tables and named in a note."""


def guarded(name: str, run: Callable[[int], dict]) -> Callable[[int], dict]:
    """``run``, except that once it raises it is recorded in FAILED and returns nothing."""

    def wrapped(rep: int) -> dict:
        if name in FAILED:
            return {}
        try:
            return run(rep)
        except Exception as exc:
            traceback.print_exc()
            FAILED[name] = f"{type(exc).__name__}: {exc}"[:400]
            return {}

    return wrapped


def device_copy_runner(state: dict, to_host: bool):
    """A warm copy of every tensor between the device and one pinned host buffer."""
    flat = torch.empty(state_bytes(state), dtype=torch.uint8, pin_memory=True)
    views, offset = [], 0
    for t in state.values():
        n = t.numel() * t.element_size()
        views.append((flat[offset : offset + n].view(t.dtype).view(t.shape), t))
        offset += n

    def run(_rep: int) -> dict[str, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for host, dev in views:
            (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        torch.cuda.synchronize()
        return {"seconds": time.perf_counter() - start}

    return run


def measure_saves(state: dict, workdir: Path, repeats: int) -> dict[str, dict[str, float]]:
    peers = SavePeers(state, workdir)
    runners = {p: guarded(p, lambda _r, p=p: peers.run(p)) for p in SAVE_PEERS}
    runners[D2H] = device_copy_runner(state, to_host=True)
    image = torch.full((state_bytes(state),), 7, dtype=torch.uint8)
    from slipstream.core.buffers import byte_view

    runners["raw write"] = lambda _r: {
        "seconds": raw_write_seconds(byte_view(image), workdir / "raw")
    }
    try:
        got = interleave(runners, repeats)
    finally:
        peers.close()
    clear(workdir / "raw")
    return {p: {k: median(v) for k, v in m.items()} for p, m in got.items() if m}


def measure_loads(state: dict, workdir: Path, repeats: int) -> dict[str, float]:
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    sources = {"torch.load": "torch.save", "dcp.load": "dcp.save", "ss.load": "ss.save"}
    sources["ss.load (dcp-written)"] = "dcp.save"

    def runner(peer: str):
        path = SavePeers(state, workdir).target(sources[peer])

        def run(_rep: int) -> dict[str, float]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            load_into(peer, path, dest)
            torch.cuda.synchronize()
            return {"seconds": time.perf_counter() - start}

        return run

    runners = {p: guarded(p, runner(p)) for p in LOAD_PEERS}
    runners[H2D] = device_copy_runner({k: torch.empty_like(v) for k, v in state.items()}, False)
    got = interleave(runners, repeats)
    for k, t in dest.items():
        if not torch.equal(t, state[k]):
            raise AssertionError(f"a loader got {k} wrong")
    return {p: median(m["seconds"]) for p, m in got.items() if m}


def gpt(quick: bool):
    from slipstream.demo.model import ModelConfig, build_model

    if quick:
        cfg = ModelConfig(vocab=4096, dim=256, layers=2, heads=4, seq_len=256)
    else:
        cfg = ModelConfig(vocab=32768, dim=1024, layers=16, heads=16, seq_len=1024)
    return cfg, build_model(cfg).cuda()


def train_blocks(opts: argparse.Namespace, workdir: Path) -> Table:
    """Blocks of K training steps per mode, a save at the first step of each block.

    A block ends once its save is durable (that wait is counted in the block), so each save's
    whole cost to the loop lands in its own block; a round runs every mode's block back to
    back and the cost of a save is its block's time minus the no-checkpoint block's of the
    same round. K (``--every``) should leave the write time to finish inside the block, as it
    would between the checkpoints of a real run; the tail column shows when it did not. A
    warm-up round of short blocks runs first.
    Every step ends with ``loss.item()``, the sync a loop that logs its loss makes.
    """
    import torch.distributed.checkpoint as dcp

    import slipstream as ss
    from slipstream.demo.model import batch

    cfg, model = gpt(opts.quick)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    stager = None
    step = 0

    def save(mode: str, path: Path):
        nonlocal stager
        state = {"model": model.state_dict(), "optim": optim.state_dict()}
        if mode == "ss.async_save":
            return ss.async_save(state, checkpoint_id=path)
        if mode == "dcp.async_save":
            return dcp.async_save(state, checkpoint_id=str(path))
        stager = default_stager(stager, {"any": next(model.parameters())})
        return dcp.async_save(state, checkpoint_id=str(path), async_stager=stager)

    def block(mode: str, steps: int) -> dict[str, float]:
        nonlocal step
        resp, stall = None, 0.0
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            tokens = batch(step, 0, opts.batch, cfg).cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss(tokens)
            loss.backward()
            t0 = time.perf_counter()
            if resp is not None and hasattr(resp, "staging_completion"):
                resp.staging_completion.result(600)
            stall += time.perf_counter() - t0
            optim.step()
            optim.zero_grad(set_to_none=False)
            if i == 0 and mode != "none":
                t0 = time.perf_counter()
                resp = save(mode, workdir / "train" / mode.replace("+", "_"))
                stall += time.perf_counter() - t0
            loss.item()
            step += 1
        t0 = time.perf_counter()
        if resp is not None:
            getattr(resp, "upload_completion", resp).result(600)
        tail = time.perf_counter() - t0
        return {"block": time.perf_counter() - start, "stall": stall, "tail": tail}

    for m in TRAIN_MODES:
        guarded(m, lambda _r, m=m: block(m, opts.warm_steps))(0)
    modes = [m for m in TRAIN_MODES if m not in FAILED]
    k = opts.every
    runs = interleave({m: (lambda _r, m=m: block(m, k)) for m in modes}, opts.rounds, 0)
    if stager is not None:
        stager.close()
    nbytes = sum(
        t.numel() * t.element_size() for t in [*model.state_dict().values(), *_optim_tensors(optim)]
    )
    base = runs["none"]["block"]
    rows = []
    for m in modes:
        costs = [b - n for b, n in zip(runs[m]["block"], base, strict=True)]
        lost = median(costs)
        rows.append(
            [
                m,
                median(runs[m]["block"]) / k * 1000,
                1000 * lost,
                1000 * median(runs[m]["stall"]),
                1000 * median(runs[m]["tail"]),
            ]
        )
    params = sum(p.numel() for p in model.parameters())
    table = Table(
        f"Training loop on the GPU: GPT of {params / 1e6:.0f} M parameters (bf16 autocast, "
        f"fused AdamW, batch {opts.batch} x {cfg.seq_len} tokens), a checkpoint of model and "
        f"optimizer ({nbytes / GIB:.2f} GiB) at the first of every {k} steps, {opts.rounds} "
        "rounds of interleaved blocks; cost = block time minus the same round's block "
        "without checkpoints (medians); stall = time in the save call and the wait for "
        "staging before the optimizer step; tail = wait at the block's end until durable",
        ["checkpointing", "ms / step", "cost per save ms", "stall ms", "tail ms"],
        rows,
    )
    return table


def _optim_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]


def fsdp_steps(opts: argparse.Namespace) -> Table:
    """Median step time of slipstream FSDP and FSDP2 on the same model, world size 1."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    import slipstream as ss
    from slipstream.demo.model import batch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    rows = []
    try:
        runners = {}
        for name in ("slipstream fsdp", "FSDP2"):
            cfg, model = gpt(opts.quick)
            if name == "FSDP2":
                for blk in model.blocks:
                    fsdp2_shard(blk)
                fsdp2_shard(model)
            else:
                ctx = ss.fsdp.FsdpContext(device="cuda")
                for blk in model.blocks:
                    ss.fsdp.fully_shard(blk, context=ctx)
                ss.fsdp.fully_shard(model, context=ctx)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def run(_rep: int, model=model, optim=optim, cfg=cfg) -> dict[str, float]:
                times = []
                for s in range(opts.fsdp_steps):
                    tokens = batch(s, 0, opts.batch, cfg).cuda()
                    start = time.perf_counter()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model.loss(tokens)
                    loss.backward()
                    optim.step()
                    optim.zero_grad()
                    loss.item()
                    times.append(time.perf_counter() - start)
                return {"step": median(times[1:])}

            runners[name] = run
        got = interleave(runners, opts.repeats)
        for name, m in got.items():
            rows.append([name, 1000 * median(m["step"])])
    finally:
        dist.destroy_process_group()
    return Table(
        "FSDP at world size 1 (NCCL), same GPT, bf16 autocast, blocks and root sharded: "
        f"median step ms over {opts.fsdp_steps} steps per repetition",
        ["implementation", "step ms"],
        rows,
    )


def run(opts: argparse.Namespace) -> Result:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    workdir = Path(opts.workdir)
    clear(workdir)
    workdir.mkdir(parents=True)
    state = {k: v.cuda() for k, v in make_state(int(opts.gib * GIB), opts.tensors).items()}
    nbytes = state_bytes(state)
    result = Result(
        "gpu",
        "the CUDA paths: checkpoints of GPU state, a GPU training loop, FSDP under NCCL",
        setup={
            "state": f"{nbytes / GIB:.2f} GiB fp32 on the GPU in {len(state)} tensors",
            "repetitions": f"1 warm-up + {opts.repeats}, interleaved, medians",
            "directory": str(workdir.resolve()),
        },
    )
    sections = set(opts.sections.split(","))
    floors: dict[str, float] = {}
    if "save" in sections:
        print("saves ...", flush=True)
        saves = measure_saves(state, workdir, opts.repeats)
        rows = [
            [p, m["blocked"], m["staged"], m["durable"], nbytes / GIB / m["durable"]]
            for p, m in saves.items()
            if p in SAVE_PEERS
        ]
        result.tables.append(
            Table(
                "Saves of GPU state (seconds)",
                ["peer", "blocked", "staged", "durable", "GiB/s"],
                rows,
            )
        )
        refs = [
            [r, saves[r]["seconds"], nbytes / GIB / saves[r]["seconds"]] for r in (D2H, "raw write")
        ]
        result.tables.append(Table("References (same bytes)", ["what", "seconds", "GiB/s"], refs))
        ss_save = saves["ss.async_save"]
        if "dcp.async_save" in saves:
            floors["blocked"] = ss_save["blocked"] / saves["dcp.async_save"]["blocked"]
        floors["staged"] = ss_save["staged"] / saves[D2H]["seconds"]
        floors["durable"] = ss_save["durable"] / saves["raw write"]["seconds"]
        if "load" in sections:
            print("loads ...", flush=True)
            loads = measure_loads(state, workdir, opts.repeats)
            rows = [[p, s, nbytes / GIB / s] for p, s in loads.items()]
            result.tables.append(
                Table("Warm loads into existing GPU tensors", ["peer", "seconds", "GiB/s"], rows)
            )
            if "dcp.load" in loads:
                floors["load"] = loads["dcp.load"] / loads["ss.load"]
    del state
    torch.cuda.empty_cache()
    if "train" in sections:
        print("training loop ...", flush=True)
        result.tables.append(train_blocks(opts, workdir))
    if "fsdp" in sections:
        print("fsdp ...", flush=True)
        result.tables.append(fsdp_steps(opts))
    for key, claim, bound, at_least in FLOORS:
        if key in floors:
            value = floors[key]
            met = value >= bound if at_least else value <= bound
            result.floor(claim, value, f"{'>=' if at_least else '<='} {bound:g}", met)
    result.notes += NOTES
    result.notes += [
        f"{peer} failed here and is left out: {error}" for peer, error in FAILED.items()
    ]
    clear(workdir)
    return result


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the saved state in GiB")
    p.add_argument("--tensors", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="rounds of the training loop")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warm-steps", type=int, default=10)
    p.add_argument(
        "--every", type=int, default=150, help="steps between checkpoints in the training loop"
    )
    p.add_argument("--fsdp-steps", type=int, default=20)
    p.add_argument("--sections", default="save,load,train,fsdp")
    p.add_argument("--out", default="benchmarks/results/gpu.json")
    p.add_argument("--workdir", default="/tmp/slipstream-bench/gpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    opts = p.parse_args()
    if opts.quick:
        opts.gib, opts.tensors, opts.repeats, opts.rounds = 0.05, 32, 1, 1
        opts.batch, opts.warm_steps, opts.fsdp_steps, opts.every = 2, 3, 4, 5
    return opts


def main() -> None:
    opts = parse()
    result = run(opts)
    result.write(opts.out)
    for table in result.tables:
        print(table.title)
        for row in table.rows:
            print("  ", row)
    for f in result.floors:
        print(f)


if __name__ == "__main__":
    main()
