"""slipstream FSDP side by side with torch FSDP2 (``torch.distributed.fsdp.fully_shard``).

Two ranks on gloo, the same model, initial weights, data and optimizer for both peers; each
(peer, device) configuration runs in a fresh pair of processes so peak memory is its own,
and configurations are interleaved across repetitions.

Three devices:
- ``real``: the demo's TinyGPT computing on the CPU (1 thread per rank).
- ``host``: a TinyGPT so small (dim 64) that the host work around the compute dominates a
  step, as it does on a GPU whose kernels are queued faster than they run: after the timed
  steps, ``--profile-steps`` more run under ``torch.profiler``, which counts per step the
  self CPU time of every recorded op and the calls of ``aten::slice``, ``aten::view`` and
  the copy ops (:data:`COPY_OPS`).
- ``standin``: an MLP stack whose Linear layers do their math on a few rows, then sleep for
  the time their FLOPs would take on a full batch at an assumed rate (``--standin-tflops``).
  Sleeping frees the CPU the way a GPU kernel frees the host, so this is what overlap can
  buy when compute is not on the CPU.

Measured per step: wall time; all-gather time (slipstream: issue to completion of each async
gather; FSDP2: duration of its ``all_gather_single`` calls, synchronous on CPU); exposed
all-gather time (slipstream: time blocked waiting; FSDP2: all of it); peak RSS above the
process's RSS before the model was built. Parity: the peers' final weights are compared.

    python benchmarks/fsdp.py --out benchmarks/results/fsdp.json [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import Result, Table, current_rss_mib, interleave, median, peak_rss_mib  # noqa: E402

WORLD = 2
#: The ops that copy tensor data between buffers in an FSDP step's host work.
COPY_OPS = (
    "aten::copy_",
    "aten::_to_copy",
    "aten::split_with_sizes_copy",
    "aten::_foreach_copy_",
    "aten::_chunk_cat",
)
#: Recorded ops whose self time is mostly waiting for the other rank (collectives, barrier),
#: with the spans whose names end in ``.wait`` (slipstream's waits on async collectives).
WAIT_PREFIXES = ("c10d::", "gloo:", "record_param_comms")
#: What the host device's profile counts per step (op name -> metric name).
COUNTED = {"aten::slice": "slice_ops", "aten::view": "view_ops"}


class _SleepLinear(torch.autograd.Function):
    """Linear on the real (few-row) input, then a sleep standing in for the full-batch kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, seconds):
        ctx.save_for_backward(x, weight)
        ctx.seconds = seconds
        time.sleep(seconds)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        time.sleep(2 * ctx.seconds)
        flat_g = grad.reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1])
        return grad @ weight, flat_g.T @ flat_x, flat_g.sum(0), None


class StandInLinear(nn.Linear):
    """A Linear whose forward takes ``2 * tokens * in * out / rate`` seconds (asleep)."""

    def __init__(self, d_in: int, d_out: int, tokens: int, rate: float) -> None:
        super().__init__(d_in, d_out)
        self.seconds = 2 * tokens * d_in * d_out / rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepLinear.apply(x, self.weight, self.bias, self.seconds)


class StandInBlock(nn.Module):
    def __init__(self, dim: int, tokens: int, rate: float) -> None:
        super().__init__()
        self.up = StandInLinear(dim, 4 * dim, tokens, rate)
        self.down = StandInLinear(4 * dim, dim, tokens, rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class StandInModel(nn.Module):
    def __init__(self, dim: int, layers: int, tokens: int, rate: float) -> None:
        super().__init__()
        self.inp = StandInLinear(dim, dim, tokens, rate)
        self.blocks = nn.ModuleList(StandInBlock(dim, tokens, rate) for _ in range(layers))
        self.head = StandInLinear(dim, dim, tokens, rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


def _build(device: str, args: argparse.Namespace) -> tuple[nn.Module, Callable[[int, int], object]]:
    torch.manual_seed(0)
    if device == "standin":
        model = StandInModel(args.standin_dim, args.layers, args.standin_tokens, args.tflops * 1e12)

        def data(step: int, rank: int):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(4, args.standin_dim, generator=g)
            return x, torch.randn(4, args.standin_dim, generator=g)

        return model, data
    from slipstream.demo.model import ModelConfig, TinyGPT, batch

    if device == "host":
        cfg = ModelConfig(vocab=256, dim=64, layers=args.layers, heads=4, seq_len=32)
    else:
        cfg = ModelConfig(layers=args.layers)
    model = TinyGPT(cfg)
    return model, lambda step, rank: batch(step, rank, args.batch, cfg)


class _GatherTimer:
    """Times FSDP2's ``dist.all_gather_single`` calls (synchronous on CPU: all exposed)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.exposed = 0.0
        self._orig = dist.all_gather_single

        def timed(*a, **kw):
            start = time.perf_counter()
            work = self._orig(*a, **kw)
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.exposed += elapsed
            if work is not None:
                raise RuntimeError("FSDP2 issued an async all-gather; this timer assumes sync")
            return work

        dist.all_gather_single = timed


def _worker(rank: int, port: int, device: str, peer: str, args, out_path: str, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=300),
    )
    try:
        baseline = current_rss_mib()
        model, data = _build(device, args)
        stats_fn: Callable[[], tuple[float, float]]
        if peer == "slipstream":
            from slipstream.fsdp import FsdpContext, fully_shard

            # Real compute saturates both cores: a reduce-scatter beside it only competes.
            ctx = FsdpContext(
                release_delay=args.release_delay, overlap_reduce_scatter=device == "standin"
            )
            for block in model.blocks:
                fully_shard(block, context=ctx)
            fully_shard(model, context=ctx)

            def stats_fn():
                return ctx.stats.allgather_seconds, ctx.stats.allgather_exposed_seconds

            reset = ctx.reset_stats
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard as fsdp2_shard

            mesh = init_device_mesh("cpu", (WORLD,))
            for block in model.blocks:
                fsdp2_shard(block, mesh=mesh)
            fsdp2_shard(model, mesh=mesh)
            timer = _GatherTimer()

            def stats_fn():
                return timer.seconds, timer.exposed

            def reset():
                timer.seconds = timer.exposed = 0.0

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                reset()
            dist.barrier()
            start = time.perf_counter()
            model.loss(data(step, rank)).backward()
            opt.step()
            opt.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        gathered, exposed = stats_fn()
        profiled = {}
        if device == "host":
            profiled = _profile_steps(model, opt, data, rank, args)
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0 and out_path:
            torch.save(full, out_path)
        peak = torch.tensor([peak_rss_mib() - baseline])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put(
                {
                    "step_s": median(times),
                    "allgather_s": gathered / args.steps,
                    "exposed_s": exposed / args.steps,
                    "peak_mib": float(peak.item()),
                    **profiled,
                }
            )
    finally:
        dist.destroy_process_group()


def _profile_steps(model, opt, data, rank: int, args) -> dict[str, float]:
    """Per-step host work of ``--profile-steps`` further steps under ``torch.profiler``: the
    self CPU time of every recorded op, and the calls of the ops :data:`COUNTED` and
    :data:`COPY_OPS` name."""
    from torch.profiler import ProfilerActivity, profile

    n = args.profile_steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(n):
            dist.barrier()
            model.loss(data(1000 + step, rank)).backward()
            opt.step()
            opt.zero_grad()
    events = prof.key_averages()
    calls = {e.key: e.count for e in events}
    waits = [e for e in events if e.key.startswith(WAIT_PREFIXES) or e.key.endswith(".wait")]
    total = sum(e.self_cpu_time_total for e in events)
    out = {
        "self_cpu_ms": total / 1000 / n,
        "self_cpu_no_wait_ms": (total - sum(e.self_cpu_time_total for e in waits)) / 1000 / n,
        "copy_ops": sum(calls.get(op, 0) for op in COPY_OPS) / n,
    }
    for op, metric in COUNTED.items():
        out[metric] = calls.get(op, 0) / n
    return out


def _spawn(device: str, peer: str, args, out_path: str) -> dict[str, float]:
    """One run of ``peer`` on ``WORLD`` processes, retried once if a process dies.

    torch's gloo teardown occasionally aborts a process at exit ("terminate called
    without an active exception"); a retry keeps that from losing the whole benchmark.
    """
    try:
        return _spawn_once(device, peer, args, out_path)
    except RuntimeError as exc:
        print(f"retrying once: {exc}", flush=True)
        return _spawn_once(device, peer, args, out_path)


def _spawn_once(device: str, peer: str, args, out_path: str) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mpc = mp.get_context("spawn")
    queue = mpc.SimpleQueue()
    procs = [
        mpc.Process(target=_worker, args=(r, port, device, peer, args, out_path, queue))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs) or queue.empty():
        raise RuntimeError(f"{device}/{peer} failed: exit codes {[p.exitcode for p in procs]}")
    return queue.get()


def _max_diff(a: str, b: str) -> float:
    sa, sb = torch.load(a), torch.load(b)
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small and short, for a smoke run")
    parser.add_argument("--out", default="benchmarks/results/fsdp.json")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2, help="real device: sequences per rank")
    parser.add_argument("--release-delay", type=int, default=2)
    parser.add_argument("--standin-dim", type=int, default=512)
    parser.add_argument("--standin-tokens", type=int, default=4096)
    parser.add_argument(
        "--tflops",
        type=float,
        default=0.25,
        help="stand-in device FLOP rate: a block's forward then takes ~2x its gather here",
    )
    parser.add_argument("--profile-steps", type=int, default=5, help="host device")
    parser.add_argument("--devices", default="standin,real,host", help="comma-separated subset")
    args = parser.parse_args()
    args.warmup = 2
    devices = tuple(args.devices.split(","))
    if args.quick:
        args.repeats, args.steps, args.layers = 1, 3, 3

    tmp = tempfile.mkdtemp(prefix="fsdp_bench_")
    configs = [(d, p) for d in devices for p in ("slipstream", "fsdp2")]
    runners = {
        f"{d}/{p}": (
            lambda rep, d=d, p=p: _spawn(d, p, args, os.path.join(tmp, f"{d}_{p}_{rep}.pt"))
        )
        for d, p in configs
    }
    kept = interleave(runners, args.repeats, warmup=0)
    med = {name: {m: median(v) for m, v in metrics.items()} for name, metrics in kept.items()}
    parity = {
        d: max(
            _max_diff(
                os.path.join(tmp, f"{d}_slipstream_{r}.pt"), os.path.join(tmp, f"{d}_fsdp2_{r}.pt")
            )
            for r in range(args.repeats)
        )
        for d in devices
    }

    result = Result(
        benchmark="fsdp",
        title="FSDP step time, memory and all-gather overlap vs torch FSDP2 (2 ranks, gloo)",
        setup={
            "world_size": WORLD,
            "repeats": args.repeats,
            "steps_per_run": args.steps,
            "warmup_steps": args.warmup,
            "layers": args.layers,
            "release_delay": args.release_delay,
            "real_model": f"TinyGPT dim 512, {args.layers} blocks, batch {args.batch} x 128",
            "host_model": (
                f"TinyGPT dim 64, {args.layers} blocks, batch {args.batch} x 32; "
                f"{args.profile_steps} profiled steps after the timed ones"
            ),
            "standin_model": (
                f"MLP dim {args.standin_dim} (4x hidden), {args.layers} blocks, "
                f"{args.standin_tokens} virtual tokens at {args.tflops} TFLOP/s"
            ),
            "optimizer": "AdamW lr 1e-3 eps 1e-3",
            "slipstream_options": (
                "release_delay 2; overlap_reduce_scatter on the stand-in device, off for real "
                "compute (both cores already compute; an async reduce-scatter only competes)"
            ),
        },
    )
    for device in devices:
        table = Table(
            f"{device} device (medians over {args.repeats} runs)",
            ["peer", "step s", "all-gather s/step", "exposed s/step", "exposed %", "peak MiB"],
        )
        for peer in ("slipstream", "fsdp2"):
            m = med[f"{device}/{peer}"]
            share = 100 * m["exposed_s"] / m["allgather_s"] if m["allgather_s"] else 0.0
            table.rows.append(
                [
                    peer,
                    round(m["step_s"], 4),
                    round(m["allgather_s"], 4),
                    round(m["exposed_s"], 4),
                    round(share, 1),
                    round(m["peak_mib"], 1),
                ]
            )
        result.tables.append(table)

    if "host" in devices:
        table = Table(
            f"host device: host work per step under torch.profiler (medians over "
            f"{args.repeats} runs, rank 0)",
            [
                "peer",
                "step s",
                "self CPU ms",
                "self CPU ms, waits excluded",
                "aten::slice",
                "aten::view",
                "copy ops",
            ],
        )
        for peer in ("slipstream", "fsdp2"):
            m = med[f"host/{peer}"]
            table.rows.append(
                [
                    peer,
                    round(m["step_s"], 4),
                    round(m["self_cpu_ms"], 2),
                    round(m["self_cpu_no_wait_ms"], 2),
                    m["slice_ops"],
                    m["view_ops"],
                    m["copy_ops"],
                ]
            )
        result.tables.append(table)

    for device in devices:
        result.floor(
            f"parity ({device}): max abs weight difference vs FSDP2 after "
            f"{args.warmup + args.steps} steps",
            parity[device],
            "<= 1e-4",
            parity[device] <= 1e-4,
        )

    def paired(device: str, metric: str) -> float:
        """Median over repetitions of slipstream's ``metric`` over FSDP2's in the same
        repetition (run back to back, so the host's drift between repetitions cancels)."""
        pairs = zip(
            kept[f"{device}/slipstream"][metric], kept[f"{device}/fsdp2"][metric], strict=True
        )
        return median([a / b for a, b in pairs])

    if "standin" in devices:
        ours = med["standin/slipstream"]
        exposed_share = ours["exposed_s"] / ours["allgather_s"]
        result.floor(
            "stand-in device: exposed all-gather / all-gather time",
            exposed_share,
            "<= 0.20",
            exposed_share <= 0.20,
        )
        ratio = paired("standin", "step_s")
        result.floor("stand-in device: step time / FSDP2's", ratio, "<= 0.9", ratio <= 0.9)
    if "real" in devices:
        ratio = paired("real", "step_s")
        result.floor("real compute: step time / FSDP2's", ratio, "<= 1.0", ratio <= 1.0)
        ratio = paired("real", "peak_mib")
        result.floor("real compute: peak memory / FSDP2's", ratio, "<= 1.0", ratio <= 1.0)
    if "host" in devices:
        ours, theirs = med["host/slipstream"], med["host/fsdp2"]
        ratio = paired("host", "self_cpu_ms")
        result.floor("host work: profiler self CPU per step / FSDP2's", ratio, "<= 1.0", ratio <= 1)
        ratio = paired("host", "self_cpu_no_wait_ms")
        result.floor(
            "host work: profiler self CPU per step, waits excluded / FSDP2's",
            ratio,
            "<= 1.0",
            ratio <= 1,
        )
        for metric, what in (
            ("slice_ops", "aten::slice calls"),
            ("view_ops", "aten::view calls"),
            ("copy_ops", "copy op calls"),
        ):
            result.floor(
                f"host work: {what} per step, slipstream vs FSDP2's {theirs[metric]:g}",
                ours[metric],
                f"<= {theirs[metric]:g}",
                ours[metric] <= theirs[metric],
            )
        ratio = paired("host", "step_s")
        result.floor("host-bound model: step time / FSDP2's", ratio, "<= 1.0", ratio <= 1.0)
        result.notes.append(
            "Copy ops are " + ", ".join(f"`{op}`" for op in COPY_OPS) + "; each counts the "
            "calls the profiler recorded (nested ones included), per step. Self CPU counts "
            "the time a rank blocked in a collective or a wait (gloo runs it on the caller's "
            "thread or makes it wait); 'waits excluded' leaves out ops named "
            + ", ".join(f"`{p}*`" for p in WAIT_PREFIXES)
            + " and spans named `*.wait`."
        )
    result.notes.append(
        "Ratios are medians of per-repetition ratios: each repetition runs both peers back "
        "to back, so the ratio of the two cancels the host's drift between repetitions."
    )
    result.notes.append(
        "FSDP2 on CPU issues its all-gathers synchronously, so all of its all-gather time is "
        "exposed; slipstream issues the next unit's gather as async gloo work before the "
        "current unit computes and waits for it only when that unit starts."
    )
    result.notes.append(
        "Peak MiB is the peak RSS above the RSS before the model was built, max over ranks; "
        "the machine is shared, so timings carry noise from other processes."
    )
    for t in result.tables:
        print(t.title)
        for row in t.rows:
            print("  ", row)
    for f in result.floors:
        print(("PASS " if f.passed else "MISS ") + f"{f.claim}: {f.measured} ({f.floor})")
    result.write(args.out)


if __name__ == "__main__":
    main()
