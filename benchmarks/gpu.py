"""GPU benchmark: the CUDA paths, side by side with the peers, on a host with a CUDA device.

The development machine and CI have no GPU, so this runs where one is lent (through
``benchmarks/gpu_check.sh``, which runs it with the CUDA tests and a profiler trace), and
dry-runs on CPU with tiny sizes (``--dry-run``) so that every section is exercised in CI.
Sections:

1. ``save``: saves of ``--gib`` of state on the device (the checkpoint benchmark's tensors,
   moved there): caller blocked, staged and durable per peer, next to a warm device-to-host
   copy into pinned memory (the floor of staging) and a raw fsync'd write;
2. ``load``: warm loads into existing device tensors, next to a host-to-device copy;
3. ``train``: a training loop on the device (a GPT, bf16 autocast, fused AdamW) that
   checkpoints model and optimizer every K steps for each K of ``--every`` (1 and 2): the
   loop's time lost per checkpoint, per peer, against the same round's loop without
   checkpoints (the wait for the last save to be durable after the loop is not counted, and
   is reported as the tail);
4. ``trace``: a few steps of that loop with ``ss.async_save`` every 2 steps under
   ``torch.profiler``, written as a Chrome trace into ``--trace-dir``;
5. ``fsdp``: FSDP at world size 1 (NCCL; gloo on CPU): slipstream's against FSDP2's step
   time and the training thread's CPU time per step, interleaved repetitions, median and
   spread (one GPU allows one NCCL rank, so this shows per-step host cost, not overlap);
6. ``sync``: colocated weight sync of ``--sync-gib`` of bf16 from a trainer process to a
   rollout process on the same device (transport ``auto``, which picks ``ipc`` there),
   direct and cached, against one device-to-device copy of the same bytes.

    python benchmarks/gpu.py --out benchmarks/results/gpu.json
    python benchmarks/gpu.py --dry-run --out /tmp/gpu.json   # CPU, tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import os
import socket
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
SYNC_FLOORS = [("direct", 2.0), ("cached", 3.0)]  # mode, bound on time / one device copy
DEVICE = torch.device("cuda")
"""Where the benchmark's state lives: the GPU, or the CPU in a dry run."""
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


def synchronize() -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def device_copy_runner(state: dict, to_host: bool):
    """A warm copy of every tensor between the device and one pinned host buffer."""
    pin = DEVICE.type == "cuda"
    flat = torch.empty(state_bytes(state), dtype=torch.uint8, pin_memory=pin)
    views, offset = [], 0
    for t in state.values():
        n = t.numel() * t.element_size()
        views.append((flat[offset : offset + n].view(t.dtype).view(t.shape), t))
        offset += n

    def run(_rep: int) -> dict[str, float]:
        synchronize()
        start = time.perf_counter()
        for host, dev in views:
            (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        synchronize()
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
            synchronize()
            start = time.perf_counter()
            load_into(peer, path, dest)
            synchronize()
            return {"seconds": time.perf_counter() - start}

        return run

    runners = {p: guarded(p, runner(p)) for p in LOAD_PEERS}
    runners[H2D] = device_copy_runner({k: torch.empty_like(v) for k, v in state.items()}, False)
    got = interleave(runners, repeats)
    for k, t in dest.items():
        if not torch.equal(t, state[k]):
            raise AssertionError(f"a loader got {k} wrong")
    return {p: median(m["seconds"]) for p, m in got.items() if m}


def gpt(opts: argparse.Namespace):
    from slipstream.demo.model import ModelConfig, build_model

    if opts.dry_run:
        cfg = ModelConfig(vocab=128, dim=32, layers=2, heads=4, seq_len=16)
    elif opts.quick:
        cfg = ModelConfig(vocab=4096, dim=256, layers=2, heads=4, seq_len=256)
    else:
        cfg = ModelConfig(vocab=32768, dim=1024, layers=16, heads=16, seq_len=1024)
    return cfg, build_model(cfg).to(DEVICE)


class Loop:
    """The GPU training loop every loop section runs: one model, its optimizer, the saves.

    Every step ends with ``loss.item()``, the sync a loop that logs its loss makes.
    """

    def __init__(self, opts: argparse.Namespace, workdir: Path) -> None:
        from slipstream.demo.model import batch

        self.opts = opts
        self.workdir = workdir
        self.cfg, self.model = gpt(opts)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.batch = batch
        self.stager = None
        self.step_count = 0

    def save(self, mode: str):
        import torch.distributed.checkpoint as dcp

        import slipstream as ss

        path = self.workdir / "train" / mode.replace("+", "_")
        state = {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
        if mode == "ss.async_save":
            return ss.async_save(state, checkpoint_id=path)
        if mode == "dcp.async_save":
            return dcp.async_save(state, checkpoint_id=str(path))
        self.stager = default_stager(self.stager, {"any": next(self.model.parameters())})
        return dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)

    def run(self, mode: str, steps: int, every: int) -> dict[str, float]:
        """``steps`` steps with a save of ``mode`` at every ``every``-th; the loop's time
        (saves included, the wait for the last one to be durable not), the stall (time in
        the save call and the wait for staging before the optimizer step) and that tail."""
        resp, stall, saves = None, 0.0, 0
        synchronize()
        start = time.perf_counter()
        for i in range(steps):
            tokens = self.batch(self.step_count, 0, self.opts.batch, self.cfg).to(DEVICE)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                loss = self.model.loss(tokens)
            loss.backward()
            t0 = time.perf_counter()
            if resp is not None and hasattr(resp, "staging_completion"):
                resp.staging_completion.result(600)
            stall += time.perf_counter() - t0
            self.optim.step()
            self.optim.zero_grad(set_to_none=False)
            if mode != "none" and i % every == 0:
                t0 = time.perf_counter()
                if resp is not None:  # a save in flight must finish before the next
                    getattr(resp, "upload_completion", resp).result(600)
                resp = self.save(mode)
                saves += 1
                stall += time.perf_counter() - t0
            loss.item()
            self.step_count += 1
        synchronize()
        loop = time.perf_counter() - start
        t0 = time.perf_counter()
        if resp is not None:
            getattr(resp, "upload_completion", resp).result(600)
        return {"loop": loop, "stall": stall, "tail": time.perf_counter() - t0, "saves": saves}

    def nbytes(self) -> int:
        optim = [v for s in self.optim.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(
            t.numel() * t.element_size() for t in [*self.model.state_dict().values(), *optim]
        )

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def train_loop(opts: argparse.Namespace, loop: Loop) -> Table:
    """For each K of ``--every``: rounds of interleaved loops of ``--loop-steps`` steps per
    mode, a save every K steps; the time lost per checkpoint is the loop's time minus the
    same round's loop without checkpoints, over the saves made."""
    modes = opts.loop_modes.split(",")
    for m in modes:
        guarded(m, lambda _r, m=m: loop.run(m, 2, 1))(0)
    modes = [m for m in modes if m not in FAILED]
    rows = []
    for k in (int(e) for e in opts.every.split(",")):
        runs = interleave(
            {m: (lambda _r, m=m, k=k: loop.run(m, opts.loop_steps, k)) for m in modes},
            opts.rounds,
            0,
        )
        base = runs["none"]["loop"]
        for m in modes:
            lost = [
                (t - n) / max(1, s)
                for t, n, s in zip(runs[m]["loop"], base, runs[m]["saves"], strict=True)
            ]
            rows.append(
                [
                    k,
                    m,
                    1000 * median(runs[m]["loop"]) / opts.loop_steps,
                    1000 * median(lost) if m != "none" else 0.0,
                    1000 * median(runs[m]["stall"]),
                    1000 * median(runs[m]["tail"]),
                ]
            )
    params = sum(p.numel() for p in loop.model.parameters())
    return Table(
        f"Training loop on the device: GPT of {params / 1e6:.0f} M parameters (bf16 autocast, "
        f"fused AdamW, batch {opts.batch} x {loop.cfg.seq_len} tokens), a checkpoint of model "
        f"and optimizer ({loop.nbytes() / GIB:.2f} GiB) every K steps over {opts.loop_steps} "
        f"steps, {opts.rounds} rounds of interleaved loops; lost per save = loop time minus "
        "the same round's loop without checkpoints, over the saves (medians); stall = time in "
        "the save call and the wait for staging before the optimizer step; tail = wait after "
        "the loop until the last save is durable (not counted as lost)",
        ["K", "checkpointing", "ms / step", "lost per save ms", "stall ms", "tail ms"],
        rows,
    )


def profile_loop(opts: argparse.Namespace, loop: Loop, trace_dir: Path) -> Path:
    """A few steps of the loop with ``ss.async_save`` every 2 steps under torch.profiler,
    written as a Chrome trace; returns its path."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if DEVICE.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / "train_loop_trace.json"
    with profile(activities=activities) as prof:
        loop.run("ss.async_save", opts.trace_steps, 2)
    prof.export_chrome_trace(str(path))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_steps(opts: argparse.Namespace) -> tuple[Table, dict[str, float]]:
    """Step time and the training thread's CPU time per step of slipstream FSDP and FSDP2 on
    the same model, world size 1, interleaved repetitions."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    import slipstream as ss

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    backend = "nccl" if DEVICE.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    rows = []
    try:
        runners = {}
        for name in ("slipstream fsdp", "FSDP2"):
            cfg, model = gpt(opts)
            if name == "FSDP2":
                for blk in model.blocks:
                    fsdp2_shard(blk)
                fsdp2_shard(model)
            else:
                ctx = ss.fsdp.FsdpContext(device=DEVICE)
                for blk in model.blocks:
                    ss.fsdp.fully_shard(blk, context=ctx)
                ss.fsdp.fully_shard(model, context=ctx)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
            from slipstream.demo.model import batch

            def run(_rep: int, model=model, optim=optim, cfg=cfg) -> dict[str, float]:
                times, host = [], []
                for s in range(opts.fsdp_steps):
                    tokens = batch(s, 0, opts.batch, cfg).to(DEVICE)
                    start, cpu = time.perf_counter(), time.thread_time()
                    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                        loss = model.loss(tokens)
                    loss.backward()
                    optim.step()
                    optim.zero_grad()
                    host.append(time.thread_time() - cpu)  # before the sync: enqueueing only
                    loss.item()
                    times.append(time.perf_counter() - start)
                return {"step": median(times[1:]), "host": median(host[1:])}

            runners[name] = run
        got = interleave(runners, opts.fsdp_repeats)
        for name, m in got.items():
            rows.append(
                [
                    name,
                    1000 * median(m["step"]),
                    1000 * min(m["step"]),
                    1000 * max(m["step"]),
                    1000 * median(m["host"]),
                ]
            )
        ours, theirs = got["slipstream fsdp"], got["FSDP2"]
        ratios = {
            "step": median([a / b for a, b in zip(ours["step"], theirs["step"], strict=True)]),
            "host": median([a / b for a, b in zip(ours["host"], theirs["host"], strict=True)]),
        }
    finally:
        dist.destroy_process_group()
    return (
        Table(
            f"FSDP at world size 1 ({backend}), same GPT, bf16 autocast, blocks and root "
            f"sharded, {opts.fsdp_repeats} interleaved repetitions of {opts.fsdp_steps} steps: "
            "step ms (median of the repetitions' medians, and their spread) and the training "
            "thread's CPU ms per step until the loss is read (host time)",
            ["implementation", "step ms", "min", "max", "host ms"],
            rows,
        ),
        ratios,
    )


def _sync_worker(rank: int, port: int, opts: argparse.Namespace, results) -> None:
    """One side of the colocated sync section: rank 0 publishes, rank 1 receives."""
    try:
        results.put((rank, _sync_side(rank, port, opts)))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _sync_layout(opts: argparse.Namespace) -> list[int]:
    """Element counts of ``--sync-gib`` of bf16 in tensors of at most 256 MiB (transformer
    matrices), with a few small ones (norms) between them."""
    total = int(opts.sync_gib * GIB) // 2
    big = min(total, 128 * 2**20)
    sizes = []
    while total > 0:
        n = min(big, total)
        sizes += [n, min(4096, max(1, n // 64))]
        total -= n
    return sizes


def _sync_side(rank: int, port: int, opts: argparse.Namespace) -> dict:
    import slipstream as ss

    device = torch.device(opts.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"  # the transfer device: the GPU
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, backend=backend, timeout=300)
    sizes = _sync_layout(opts)
    bucket = opts.sync_bucket_mib * 2**20
    out: dict = {}
    try:
        if rank == 0:
            g = torch.Generator(device=device).manual_seed(0)
            named = {
                f"w{i}": torch.randn(n, generator=g, device=device).to(torch.bfloat16)
                for i, n in enumerate(sizes)
            }
            flat = torch.cat([t.view(-1) for t in named.values()])
            copy_to = torch.empty_like(flat)

            def d2d(_rep: int) -> dict[str, float]:
                synchronize_on(device)
                start = time.perf_counter()
                copy_to.copy_(flat)
                synchronize_on(device)
                return {"seconds": time.perf_counter() - start}

            runners: dict[str, Callable[[int], dict[str, float]]] = {"one device copy": d2d}
            pubs = {}
            for mode in ("direct", "cached"):
                pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=bucket, mode=mode)
                pubs[mode] = pub

                def publish(_rep: int, pub=pub) -> dict[str, float]:
                    for t in named.values():
                        t.add_(1)  # new bytes every round: nothing is skipped as unchanged
                    synchronize_on(device)
                    start = time.perf_counter()
                    handle = pub.publish(named)
                    handle.delivered.result(timeout=300)
                    seconds = time.perf_counter() - start
                    return {"seconds": seconds, "staged": handle.timings.staged or seconds}

                runners[f"{mode} ({pub.transport})"] = publish
            got = interleave(runners, opts.sync_rounds)
            for pub in pubs.values():
                pub.close()
            out = {k: {m: median(v) for m, v in ms.items()} for k, ms in got.items()}
            out["bytes"] = flat.numel() * 2
            out["sum"] = float(sum(t.double().sum().item() for t in named.values()))
        else:
            module = torch.nn.Module()  # the weights land straight in its buffers
            for i, n in enumerate(sizes):
                module.register_buffer(f"w{i}", torch.zeros(n, dtype=torch.bfloat16, device=device))
            target = dict(module.named_buffers())
            subs = [ss.WeightSubscriber(group, [0], [1]) for _ in ("direct", "cached")]
            for _ in range(1 + opts.sync_rounds):  # the warm-up, then each round
                for sub in subs:  # in the trainer's order of the publishers
                    sub.receive(module)
            for sub in subs:
                sub.close()
            out["sum"] = float(sum(t.double().sum().item() for t in target.values()))
    finally:
        group.close()
    return out


def synchronize_on(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def colocated_sync(opts: argparse.Namespace) -> tuple[Table, dict[str, float]]:
    """A trainer and a rollout process on the one device: each publish's time from the call
    until the rollout applied every byte, against one device-to-device copy of the bytes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")  # torch and slipstream imported once, for both
    ctx.set_forkserver_preload(["torch", "slipstream"])
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_sync_worker, args=(r, port, opts, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + opts.sync_timeout
    while len(got) < 2 and time.monotonic() < deadline:
        if not results.empty():
            rank, value = results.get()
            got[rank] = value
        elif not any(p.is_alive() for p in procs) and results.empty():
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    for rank, value in got.items():
        if isinstance(value, str):
            raise RuntimeError(f"sync rank {rank} failed:\n{value}")
    if len(got) < 2:
        raise RuntimeError(f"sync ranks {sorted({0, 1} - set(got))} gave no result")
    trainer = got[0]
    if trainer.pop("sum") != got[1]["sum"]:
        raise RuntimeError("the rollout's weights after the last round differ from the trainer's")
    nbytes = trainer.pop("bytes")
    copy_s = trainer["one device copy"]["seconds"]
    rows = [
        [name, m["seconds"], nbytes / GIB / m["seconds"], m["seconds"] / copy_s]
        for name, m in trainer.items()
    ]
    ratios = {
        mode: m["seconds"] / copy_s
        for name, m in trainer.items()
        for mode in ("direct", "cached")
        if name.startswith(mode)
    }
    table = Table(
        f"Colocated weight sync of {nbytes / GIB:.2f} GiB of bf16 ({len(_sync_layout(opts))} "
        f"tensors) from a trainer process to a rollout process on one {DEVICE.type} device, "
        f"transport 'auto', buckets of {opts.sync_bucket_mib} MiB, {opts.sync_rounds} "
        "interleaved rounds: seconds from publish until the rollout applied every byte "
        "(medians), against one device-to-device copy of the same bytes",
        ["peer", "seconds", "GiB/s", "x one copy"],
        rows,
    )
    return table, ratios


def run(opts: argparse.Namespace) -> Result:
    global DEVICE
    DEVICE = torch.device(opts.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device (or --dry-run on CPU)")
    workdir = Path(opts.workdir)
    clear(workdir)
    workdir.mkdir(parents=True)
    sections = set(opts.sections.split(","))
    result = Result(
        "gpu",
        "the CUDA paths: checkpoints of GPU state, a GPU training loop, FSDP, colocated sync",
        setup={
            "device": str(DEVICE) + (" (dry run)" if opts.dry_run else ""),
            "repetitions": f"1 warm-up + {opts.repeats}, interleaved, medians",
            "directory": str(workdir.resolve()),
            "sections": sorted(sections),
        },
    )
    floors: dict[str, float] = {}
    began = time.perf_counter()
    seconds: dict[str, float] = {}
    result.setup["section_seconds"] = seconds

    def section(name: str) -> None:
        """Note that section ``name`` starts; the one before it ended now."""
        now = time.perf_counter() - began
        if seconds:
            last = next(reversed(seconds))
            seconds[last] = round(now - seconds[last], 1)
        seconds[name] = now
        print(f"{name} ... ({now:.0f} s in)", flush=True)

    if "save" in sections:
        state = {k: v.to(DEVICE) for k, v in make_state(int(opts.gib * GIB), opts.tensors).items()}
        nbytes = state_bytes(state)
        result.setup["state"] = f"{nbytes / GIB:.2f} GiB fp32 on the device in {len(state)} tensors"
        section("save")
        saves = measure_saves(state, workdir, opts.repeats)
        rows = [
            [p, m["blocked"], m["staged"], m["durable"], nbytes / GIB / m["durable"]]
            for p, m in saves.items()
            if p in SAVE_PEERS
        ]
        result.tables.append(
            Table(
                "Saves of device state (seconds)",
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
            section("load")
            loads = measure_loads(state, workdir, opts.repeats)
            rows = [[p, s, nbytes / GIB / s] for p, s in loads.items()]
            result.tables.append(
                Table("Warm loads into existing device tensors", ["peer", "seconds", "GiB/s"], rows)
            )
            if "dcp.load" in loads:
                floors["load"] = loads["dcp.load"] / loads["ss.load"]
        del state
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    if sections & {"train", "trace"}:
        loop = Loop(opts, workdir)
        try:
            if "train" in sections:
                section("train")
                result.tables.append(train_loop(opts, loop))
            if "trace" in sections:
                section("trace")
                trace = profile_loop(opts, loop, Path(opts.trace_dir))
                result.notes.append(f"Profiler trace of the training loop: {trace.name}")
        finally:
            loop.close()
            del loop
    if "fsdp" in sections:
        section("fsdp")
        table, ratios = fsdp_steps(opts)
        result.tables.append(table)
        result.floor(
            "FSDP: median step / FSDP2's (median of per-repetition ratios)",
            ratios["step"],
            "<= 0.95",
            ratios["step"] <= 0.95,
        )
        result.floor(
            "FSDP: host time per step / FSDP2's", ratios["host"], "<= 1.0", ratios["host"] <= 1
        )
    if "sync" in sections:
        section("sync")
        table, ratios = colocated_sync(opts)
        result.tables.append(table)
        for mode, bound in SYNC_FLOORS:
            if mode in ratios:
                result.floor(
                    f"colocated sync, {mode}: time / one device-to-device copy",
                    ratios[mode],
                    f"<= {bound:g}",
                    ratios[mode] <= bound,
                )
    section("end")
    seconds.pop("end")
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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the saved state in GiB")
    p.add_argument("--tensors", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the training loop")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--every", default="1,2", help="steps between checkpoints, one loop per K")
    p.add_argument("--loop-steps", type=int, default=8, help="steps of one training loop")
    p.add_argument(
        "--loop-modes",
        default="none,ss.async_save,dcp.async_save+DefaultStager",
        help="checkpointing peers of the training loop ('none' first)",
    )
    p.add_argument("--trace-steps", type=int, default=6)
    p.add_argument("--trace-dir", default="benchmarks/results/traces")
    p.add_argument("--fsdp-steps", type=int, default=20)
    p.add_argument("--fsdp-repeats", type=int, default=5)
    p.add_argument("--sync-gib", type=float, default=8.0)
    p.add_argument("--sync-bucket-mib", type=int, default=256)
    p.add_argument("--sync-rounds", type=int, default=3)
    p.add_argument("--sync-timeout", type=float, default=300.0)
    p.add_argument("--sections", default="save,load,train,trace,fsdp,sync")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/gpu.json")
    p.add_argument("--workdir", default="/tmp/slipstream-bench/gpu")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test on a GPU")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: seconds")
    opts = p.parse_args(argv)
    if opts.quick or opts.dry_run:
        opts.gib, opts.tensors, opts.repeats, opts.rounds = 0.05, 32, 1, 1
        opts.batch, opts.loop_steps, opts.fsdp_steps, opts.fsdp_repeats = 2, 4, 4, 2
        opts.trace_steps, opts.sync_gib, opts.sync_bucket_mib, opts.sync_rounds = 4, 0.25, 64, 1
    if opts.dry_run:
        opts.device = "cpu"
        opts.gib, opts.tensors, opts.sync_gib, opts.sync_bucket_mib = 1 / 256, 8, 1 / 128, 1
        opts.fsdp_steps, opts.trace_steps, opts.loop_steps = 3, 2, 2
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
