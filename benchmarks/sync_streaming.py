"""Streamed publishes, side by side with publishes from a mapping: 1 trainer, 1 rollout.

A model of ``--mib`` MiB in ``--tensors`` fp32 tensors, sent with the default transport
(``auto``) in ``direct`` mode. Peers, interleaved, median of ``--repeats`` after one warm-up:

- ``mapping``: ``publish(dict)`` of tensors built beforehand (what ``publish`` did with any
  input: hold every tensor, then send);
- ``stream``: ``publish(generator)`` yielding the same tensors, read as it yields;
- ``mapping, fresh``: a generator that makes a fresh tensor per step (as verl's gathers one
  ``full_tensor()`` per ``next()``), handed over as ``list(generator)``;
- ``stream, fresh``: the same generator, streamed.

Time: from ``publish`` until the rollout acknowledged. Memory, for the fresh peers: the
yielded tensors alive at once, counted with a weak reference to each (``weakref.finalize``,
nothing kept), and the trainer's resident high-water mark during the publish (``VmHWM``,
reset through ``/proc/self/clear_refs`` just before it) over its resident size before it.
Before each run the trainer adds 1 to the prebuilt tensors (outside the timing) and the
fresh tensors carry the run's number, so every run ships new bytes; the last run of each
peer is checked on the rollout against its own reconstruction of the values.

python benchmarks/sync_streaming.py --out benchmarks/results/sync_streaming.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    Live,
    Result,
    Table,
    interleave,
    median,
    reset_high_water,
    status_bytes,
)

import slipstream as ss  # noqa: E402

MiB = 2**20
PEERS = ["mapping", "stream", "mapping, fresh", "stream, fresh"]


def fresh(numel: int, tensors: int, run: int, live: Live):
    for i in range(tensors):
        yield f"w{i}", live.track(torch.full((numel,), float(run * 10_000 + i)))


def trainer(group, args: argparse.Namespace, numel: int) -> dict:
    pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=args.bucket_mib * MiB)
    prebuilt = {f"w{i}": torch.zeros(numel) for i in range(args.tensors)}
    pub.set_layout(prebuilt)
    runs = 0

    def timed(publish, live: Live | None) -> dict[str, float]:
        nonlocal runs
        group.set_json(f"bench/run/{runs}", True)
        reset_high_water()
        before = status_bytes("VmRSS")
        start = time.perf_counter()
        handle = publish()
        handle.delivered.result(timeout=600)
        seconds = time.perf_counter() - start
        runs += 1
        out = {"seconds": seconds, "hwm_extra_mib": (status_bytes("VmHWM") - before) / MiB}
        if live is not None:
            out["live_peak_mib"] = live.peak / MiB
        return out

    def prebuilt_run(stream: bool):
        def run(rep: int) -> dict[str, float]:
            for t in prebuilt.values():
                t.add_(1)
            if stream:
                return timed(lambda: pub.publish(iter(prebuilt.items())), None)
            return timed(lambda: pub.publish(prebuilt), None)

        return run

    def fresh_run(stream: bool):
        def run(rep: int) -> dict[str, float]:
            live = Live()
            items = fresh(numel, args.tensors, runs, live)
            if stream:
                return timed(lambda: pub.publish(items), live)
            return timed(lambda: pub.publish(list(items)), live)

        return run

    runners = {
        "mapping": prebuilt_run(False),
        "stream": prebuilt_run(True),
        "mapping, fresh": fresh_run(False),
        "stream, fresh": fresh_run(True),
    }
    kept = interleave(runners, args.repeats)
    group.set_json(f"bench/run/{runs}", False)
    kept["transport"] = pub.transport  # type: ignore[assignment]
    pub.close()
    return kept


def rollout(group, args: argparse.Namespace, numel: int) -> dict:
    sub = ss.WeightSubscriber(group, [0], [1])
    target = nn.Module()
    for i in range(args.tensors):
        target.register_buffer(f"w{i}", torch.zeros(numel))
    runs = 0
    while group.get_json(f"bench/run/{runs}", 0, "the trainer's next run", 600):
        sub.receive(target, full=True)
        runs += 1
    last = runs - 1  # the last run is a fresh peer's: its values carry its number
    exact = all(
        bool((target.get_buffer(f"w{i}") == float(last * 10_000 + i)).all())
        for i in range(args.tensors)
    )
    checked = {"runs": runs, "last_exact": exact}
    sub.close()
    return checked


def worker(rank: int, args: argparse.Namespace, port: int, results) -> None:
    torch.set_num_threads(1)
    numel = args.mib * MiB // 4 // args.tensors
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=600)
    out = trainer(group, args, numel) if rank == 0 else rollout(group, args, numel)
    results.put((rank, out))
    if rank == 1:
        group.set_json("bench/done", True)
    else:  # rank 0 hosts the store: it waits for the rollout to be done with it
        group.get_json("bench/done", 1, "the rollout to finish", 600)
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384)
    parser.add_argument("--tensors", type=int, default=768)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="128 MiB in 256 tensors, 3 repeats")
    parser.add_argument("--out", default="benchmarks/results/sync_streaming.json")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.tensors, args.repeats, args.bucket_mib = 128, 256, 3, 8

    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(results.get() for _ in procs)
    for p in procs:
        p.join(120)
    kept, checked = by_rank[0], by_rank[1]
    transport = kept.pop("transport")
    model = args.mib * MiB
    bucket = args.bucket_mib * MiB
    bound_mib = (4 * bucket + model / 10) / MiB

    result = Result(
        benchmark="sync_streaming",
        title=(
            f"Streamed publish of {args.mib} MiB in {args.tensors} tensors beside a publish "
            f"from a mapping, 1 trainer -> 1 rollout ({transport}, direct)"
        ),
        setup={
            "bytes": model,
            "tensors": args.tensors,
            "bucket_mib": args.bucket_mib,
            "repeats": args.repeats,
            "transport": transport,
            "processes": "2 (1 trainer, 1 rollout), 1 torch thread each",
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "rollout_checked": checked,
        },
    )
    rows = []
    for name in PEERS:
        got = kept[name]
        live = median(got["live_peak_mib"]) if "live_peak_mib" in got else None
        rows.append(
            [
                name,
                round(median(got["seconds"]), 3),
                round(args.mib / 1024 / median(got["seconds"]), 3),
                "-" if live is None else round(live, 1),
                round(median(got["hwm_extra_mib"]), 1),
            ]
        )
    result.tables.append(
        Table(
            "median of the repetitions; live = yielded tensors alive at once (MiB), "
            "RSS extra = resident high-water mark during the publish over the size before (MiB)",
            ["peer", "time s", "GiB/s", "live MiB", "RSS extra MiB"],
            rows,
        )
    )

    def paired(slow: str, fast: str) -> float:
        pairs = zip(kept[slow]["seconds"], kept[fast]["seconds"], strict=True)
        return median([a / b for a, b in pairs])

    stream_vs_mapping = paired("stream", "mapping")
    live_peak = max(kept["stream, fresh"]["live_peak_mib"])
    hwm_peak = max(kept["stream, fresh"]["hwm_extra_mib"])
    result.floor(
        "streamed publish time / publish from a mapping (same tensors, median of per-round ratios)",
        stream_vs_mapping,
        "<= 1.1",
        stream_vs_mapping <= 1.1,
    )
    result.floor(
        f"yielded tensors alive at once during a streamed publish, MiB (worst run; bound = "
        f"4 buckets + 10% of the model = {bound_mib:.1f})",
        live_peak,
        f"<= {bound_mib:.1f}",
        live_peak <= bound_mib,
    )
    result.floor(
        "trainer's resident high-water mark over its size before, streamed publish of fresh "
        "tensors, MiB (worst run)",
        hwm_peak,
        f"<= {bound_mib:.1f}",
        hwm_peak <= bound_mib,
    )
    result.floor(
        "the rollout holds the last run's values exactly", 1.0, "== 1", checked["last_exact"]
    )
    result.notes.append(
        "'mapping, fresh' is what publish did with a generator before streaming: it held "
        "every yielded tensor (list()) and then sent, so its live and RSS columns show the "
        "whole model; 'stream, fresh' sends as the generator yields."
    )
    for floor in result.floors:
        print(f"{'PASS' if floor.passed else 'MISS'} {floor.claim}: {floor.measured}")
    for row in rows:
        print(row)
    result.write(args.out)


if __name__ == "__main__":
    main()
