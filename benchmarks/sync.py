"""Weight sync, side by side: 1 trainer and 2 rollout processes, the same weights for every peer.

Peers (run interleaved, median of ``--repeats`` after one warm-up):

- ``raw broadcast``: one gloo broadcast of a flat buffer as large as the weights (the limit);
- ``per-tensor loop``: one broadcast per tensor, straight into the rollout's tensors;
- ``verl-style``: copy every tensor into a host cache, then per bucket copy the cache into a
  bucket buffer and broadcast it; rollouts copy each bucket out (one buffer, no overlap);
- ``slipstream direct`` / ``cached`` over the network: relayed (what ``transport="auto"``
  picks for host weights across hosts: the trainer sends once, the first rollout passes
  each message on) and broadcast; and ``direct`` / ``cached`` over each colocated transport
  (the copying shared-memory ring, cross-memory reads, and ``ipc``: bucket slots shared
  once through torch's tensor sharing, what ``auto`` picks on one host);
- ``refetch``: one rollout asks a ``cached`` publisher (broadcast, cma) for its cached
  version again (no publish), beside a raw broadcast of the same bytes to that rollout alone.

A third part publishes two models (a policy, the layout above, and a reward model of half
its size) from one sync group, each on a channel of its own, with the default transport
(``auto``) in ``direct`` mode: each alone, and both back to back (the rollouts receive
them in the same order), so the cost of sharing a group shows as the ratio of the pair's
time to the sum of the two alone.

A second part runs ``direct`` on transformer-shaped weights (a few dozen matrices of 8 to
125 MiB) over relay and broadcast, with every slice packed and with big slices sent on
their own (the default), beside a raw broadcast of the same bytes.

Before every run the trainer adds 1 to every weight (outside the timing), so each run ships
bytes no rollout has held before and slipstream's skipping of unchanged tensors never
applies (a negation would not do: an even number of peers between two runs of the same
peer would bring its rollouts' bytes back). Each slipstream run checks it sent every byte.
Times are taken on the trainer from the start of a run until every rollout has applied the
weights; "blocked" is how long the trainer's thread could not train (the whole run for the
broadcast peers, the cache copy for verl-style, ``publish()`` for slipstream).

python benchmarks/sync.py --out benchmarks/results/sync.json

``--realistic`` runs instead the realistic-update section (:mod:`sync_realistic`): deltas of
bf16 weights after AdamW steps, and one staged snapshot for a checkpoint and a publish.

python benchmarks/sync.py --realistic --out benchmarks/results/sync_realistic.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import Result, Table, interleave, median, peak_rss_mib  # noqa: E402
from sync_realistic import realistic_runs  # noqa: E402
from sync_realistic import report as realistic_report  # noqa: E402

import slipstream as ss  # noqa: E402

GIB = 2**30
SLIPSTREAM = [
    ("slipstream direct", "direct", "relay"),
    ("slipstream cached", "cached", "relay"),
    ("slipstream direct broadcast", "direct", "broadcast"),
    ("slipstream cached broadcast", "cached", "broadcast"),
    ("slipstream direct shm", "direct", "shm"),
    ("slipstream cached shm", "cached", "shm"),
    ("slipstream direct cma", "direct", "cma"),
    ("slipstream cached cma", "cached", "cma"),
    ("slipstream direct ipc", "direct", "ipc"),
    ("slipstream cached ipc", "cached", "ipc"),
]
#: refetch peers: name -> index in SLIPSTREAM of the ``cached`` publisher that serves it
REFETCHES = {
    f"slipstream cached {transport}: refetch by rollout 1": [
        (mode, tr) for _, mode, tr in SLIPSTREAM
    ].index(("cached", transport))
    for transport in ("broadcast", "cma")
}
RAW_PAIR = "raw broadcast to rollout 1 alone"


def shapes(total_bytes: int, count: int) -> list[tuple[int, torch.dtype]]:
    """``count`` tensors of mixed sizes (7 small : 2 medium : 1 large) and dtypes."""
    units = [1 if i % 10 < 7 else 16 if i % 10 < 9 else 128 for i in range(count)]
    dtypes = [torch.float32 if i % 2 == 0 else torch.bfloat16 for i in range(count)]
    unit_bytes = total_bytes / sum(units)
    out = []
    for u, dt in zip(units, dtypes, strict=True):
        numel = max(64, int(u * unit_bytes / dt.itemsize) // 64 * 64)
        out.append((numel, dt))
    short = total_bytes - sum(n * dt.itemsize for n, dt in out)
    if short > 0:  # top up the first tensor so the total is at least what was asked
        numel, dt = out[0]
        out[0] = (numel + -(-short // (64 * dt.itemsize)) * 64, dt)
    return out


def transformer_shapes(quick: bool) -> list[tuple[int, torch.dtype]]:
    """A decoder-only transformer's weights in bf16 (hidden 2048, MLP 5632, vocab 32000, 7
    layers: 0.79 GiB in 51 tensors), where most bytes sit in matrices of 8 to 125 MiB."""
    hidden, mlp, vocab, layers = (256, 704, 4000, 2) if quick else (2048, 5632, 32000, 7)
    attention = [hidden, 3 * hidden * hidden, hidden * hidden]
    feed_forward = [hidden, hidden * mlp, hidden * mlp, mlp * hidden]
    sizes = [vocab * hidden] + (attention + feed_forward) * layers + [hidden]
    return [(n, torch.bfloat16) for n in sizes]


TRANSFORMER_PEERS = {
    "slipstream direct relay, every slice packed": {
        "transport": "relay",
        "separate_min_bytes": None,
    },
    "slipstream direct relay (slices of 1 MiB and up sent on their own)": {"transport": "relay"},
    "slipstream direct broadcast, every slice packed": {
        "transport": "broadcast",
        "separate_min_bytes": None,
    },
    "slipstream direct broadcast (slices of 16 MiB and up sent on their own)": {
        "transport": "broadcast"
    },
}


def endpoints(
    rank: int,
    group,
    layout: list[tuple[int, torch.dtype]],
    peers: dict[str, dict],
    bucket_bytes: int,
    seed: int,
) -> tuple[list[torch.Tensor], nn.Module | None, list]:
    """The weights, and per channel of ``peers`` (channel -> publisher keyword arguments) a
    publisher on the trainer (rank 0) or a subscriber on a rollout. On the trainer the
    weights are random and there is no destination module; on a rollout they are the
    destination module's zeroed buffers."""
    if rank == 0:
        g = torch.Generator().manual_seed(seed)
        tensors = [torch.randn(n, generator=g).to(dt) for n, dt in layout]
        ends = [
            ss.WeightPublisher(group, [0], [1, 2], bucket_bytes=bucket_bytes, channel=c, **kw)
            for c, kw in peers.items()
        ]
        return tensors, None, ends
    dest = Weights(layout)
    ends = [ss.WeightSubscriber(group, [0], [1, 2], channel=c) for c in peers]
    return [b for _, b in dest.named_buffers()], dest, ends


def transformer_runs(rank: int, group, args: argparse.Namespace) -> dict:
    """``direct`` on transformer-shaped weights with and without sending big slices on
    their own, beside one raw broadcast of the same bytes (interleaved, like the rest)."""
    layout = transformer_shapes(args.quick)
    total = sum(n * dt.itemsize for n, dt in layout)
    trainer = rank == 0
    peers = {f"transformer/{k}": kwargs for k, kwargs in enumerate(TRANSFORMER_PEERS.values())}
    tensors, dest, ends = endpoints(rank, group, layout, peers, args.bucket_mib * 2**20, seed=1)
    named = {f"w{i}": t for i, t in enumerate(tensors)}
    flat = torch.zeros(total, dtype=torch.uint8)
    versions = iter(range(1, 10**9))

    def runner(k: int | None):
        def run(_: int) -> dict[str, float]:
            if trainer:
                for t in tensors:
                    t.add_(1)
            _barrier()
            start = time.perf_counter()
            if k is None:
                dist.broadcast(flat, 0)
            elif trainer:
                before = ends[k].bytes_sent
                ends[k].publish(named, version=next(versions)).delivered.result(timeout=600)
                if ends[k].bytes_sent - before < total:
                    raise RuntimeError("a transformer-shaped run skipped bytes: not a full sync")
            else:
                ends[k].receive(dest)
            _barrier()
            return {"seconds": time.perf_counter() - start, "bytes": float(total)}

        return run

    runners = {"raw broadcast": runner(None)}
    runners.update({name: runner(k) for k, name in enumerate(TRANSFORMER_PEERS)})
    kept = interleave(runners, args.repeats, warmup=1)
    for end in ends:
        end.close()
    return kept


TWO_MODELS = ("policy alone", "reward alone", "policy + reward, back to back")


def two_model_runs(rank: int, group, args: argparse.Namespace) -> dict:
    """Two models published from one group (a channel each, ``auto`` transport, ``direct``):
    each alone and both back to back, interleaved; each run checks every byte was sent."""
    policy_layout = shapes(int(args.gib * GIB), args.tensors)
    reward_layout = shapes(int(args.gib * GIB / 2), args.tensors // 2)
    sizes = [sum(n * dt.itemsize for n, dt in lay) for lay in (policy_layout, reward_layout)]
    bucket = args.bucket_mib * 2**20
    trainer = rank == 0
    models = []
    for which, layout in (("policy", policy_layout), ("reward", reward_layout)):
        peers = {f"two-models/{which}": {}}
        tensors, dest, ends = endpoints(rank, group, layout, peers, bucket, seed=2)
        models.append(({f"w{i}": t for i, t in enumerate(tensors)}, tensors, dest, ends[0]))
    versions = iter(range(1, 10**9))

    def runner(which: tuple[int, ...]):
        def run(_: int) -> dict[str, float]:
            if trainer:
                for k in which:
                    for t in models[k][1]:
                        t.add_(1)
            _barrier()
            start = time.perf_counter()
            version = next(versions)
            if trainer:
                handles = []
                for k in which:
                    named, _, _, pub = models[k]
                    before = pub.bytes_sent
                    handles.append((k, before, pub.publish(named, version=version)))
                for k, before, handle in handles:
                    handle.delivered.result(timeout=600)
                    if models[k][3].bytes_sent - before < sizes[k]:
                        raise RuntimeError("a two-model run skipped bytes: not a full sync")
            else:
                for k in which:
                    models[k][3].receive(models[k][2])
            _barrier()
            moved = sum(sizes[k] for k in which)
            return {"seconds": time.perf_counter() - start, "bytes": float(moved)}

        return run

    runners = dict(zip(TWO_MODELS, (runner((0,)), runner((1,)), runner((0, 1))), strict=True))
    kept = interleave(runners, args.repeats, warmup=1)
    if trainer:
        kept["transport"] = models[0][3].transport
    for *_, end in models:
        end.close()
    return kept


class Weights(nn.Module):
    """The rollout's copy: one buffer per published tensor, touched once."""

    def __init__(self, layout: list[tuple[int, torch.dtype]]) -> None:
        super().__init__()
        for i, (numel, dt) in enumerate(layout):
            self.register_buffer(f"w{i}", torch.zeros(numel, dtype=dt))


def _barrier() -> None:
    dist.barrier()


def worker(rank: int, args: argparse.Namespace, ports: tuple[int, int], results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{ports[0]}",
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=600),
    )
    group = ss.sync.init_group("127.0.0.1", ports[1], 3, rank, timeout=600)
    if args.realistic:
        results.put((rank, realistic_runs(rank, group, args), peak_rss_mib(), 0, None, None))
        dist.destroy_process_group()
        group.close()
        return
    kept, total = layout_runs(rank, group, args)
    transformer = transformer_runs(rank, group, args)
    two = two_model_runs(rank, group, args)
    results.put((rank, kept, peak_rss_mib(), total, transformer, two))
    dist.destroy_process_group()
    group.close()


def layout_runs(rank: int, group, args: argparse.Namespace) -> tuple[dict, int]:
    """Every peer on one layout (``--gib`` in ``--tensors`` tensors), interleaved;
    returns the measurements and the bytes moved per run."""
    layout = shapes(int(args.gib * GIB), args.tensors)
    total = sum(n * dt.itemsize for n, dt in layout)
    bucket = args.bucket_mib * 2**20
    trainer = rank == 0
    peers = {name: {"mode": mode, "transport": transport} for name, mode, transport in SLIPSTREAM}
    tensors, dest, ends = endpoints(rank, group, layout, peers, bucket, seed=0)
    named = {f"w{i}": t for i, t in enumerate(tensors)}
    if trainer:
        cache = [torch.empty_like(t) for t in tensors]  # verl-style host cache, reused
        for c in cache:
            c.zero_()
    flat = torch.zeros(total, dtype=torch.uint8)
    bucket_buf = torch.zeros(bucket, dtype=torch.uint8)
    pair = dist.new_group([0, 1])

    def timed_run(body, buffers: int) -> dict[str, float]:
        if trainer:
            for t in tensors:
                t.add_(1)  # every run ships bytes never sent before
        _barrier()
        start = time.perf_counter()
        blocked = body()
        _barrier()  # every rollout has applied the weights
        elapsed = time.perf_counter() - start
        return {
            "seconds": elapsed,
            "blocked": elapsed if blocked is None else blocked,
            "buffers": buffers / 2**20,
        }

    def raw(_: int) -> dict[str, float]:
        return timed_run(lambda: dist.broadcast(flat, 0), total)

    def per_tensor(_: int) -> dict[str, float]:
        def body():
            for t in tensors:
                dist.broadcast(t, 0)

        return timed_run(body, 0)

    def verl(_: int) -> dict[str, float]:
        def body():
            blocked = None
            if trainer:
                t0 = time.perf_counter()
                for c, t in zip(cache, tensors, strict=True):
                    c.copy_(t)
                blocked = time.perf_counter() - t0
            src = cache if trainer else tensors
            i = 0
            while i < len(src):
                j, used = i, 0
                while j < len(src) and used + src[j].numel() * src[j].element_size() <= bucket:
                    used += src[j].numel() * src[j].element_size()
                    j += 1
                j = max(j, i + 1)
                offsets, used = [], 0
                for t in src[i:j]:
                    nbytes = t.numel() * t.element_size()
                    offsets.append((t, used, nbytes))
                    used += nbytes
                buf = bucket_buf if used <= bucket else torch.empty(used, dtype=torch.uint8)
                if trainer:
                    for t, off, nbytes in offsets:
                        buf[off : off + nbytes].copy_(t.view(-1).view(torch.uint8))
                dist.broadcast(buf[:used], 0)
                if not trainer:
                    for t, off, nbytes in offsets:
                        t.view(-1).view(torch.uint8).copy_(buf[off : off + nbytes])
                i = j
            return blocked

        return timed_run(body, (total if trainer else 0) + bucket)

    def slipstream_runner(k: int):
        def run(_: int) -> dict[str, float]:
            def body():
                if trainer:
                    before = ends[k].bytes_sent
                    t0 = time.perf_counter()
                    handle = ends[k].publish(named, version=next_version())
                    blocked = time.perf_counter() - t0
                    handle.delivered.result(timeout=600)
                    if ends[k].bytes_sent - before < total:
                        raise RuntimeError(f"{SLIPSTREAM[k][0]} skipped bytes: not a full sync")
                    return blocked
                ends[k].receive(dest)
                return None

            return timed_run(body, ends[k].buffer_bytes)

        return run

    def raw_pair(_: int) -> dict[str, float]:
        def body():
            if rank in (0, 1):
                dist.broadcast(flat, 0, group=pair)

        return timed_run(body, total)

    def refetch_runner(k: int):
        def refetch(_: int) -> dict[str, float]:
            def body():
                if rank == 1:
                    before = ends[k].bytes_received
                    ends[k].refetch(dest)
                    if ends[k].bytes_received - before < total:
                        raise RuntimeError("a refetch received less than every byte")
                    return None
                return 0.0  # the trainer's thread takes no part: its publisher's worker serves

            return timed_run(body, 0)

        return refetch

    counter = iter(range(1, 10**9))

    def next_version() -> int:
        return next(counter)

    def memcpy(_: int) -> dict[str, float]:
        if not trainer:
            return {"seconds": 0.0}
        t0 = time.perf_counter()
        for c, t in zip(cache, tensors, strict=True):
            c.copy_(t)
        return {"seconds": time.perf_counter() - t0}

    runners = {
        "raw broadcast": raw,
        "per-tensor loop": per_tensor,
        "verl-style": verl,
        **{name: slipstream_runner(k) for k, (name, _, _) in enumerate(SLIPSTREAM)},
        RAW_PAIR: raw_pair,
        **{name: refetch_runner(k) for name, k in REFETCHES.items()},
        "warm memcpy": memcpy,
    }
    kept = interleave(runners, args.repeats, warmup=1)
    for end in ends:
        end.close()
    return kept, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="64 MiB in 256 tensors, 1 repeat")
    parser.add_argument("--out", default="benchmarks/results/sync.json")
    parser.add_argument("--realistic", action="store_true", help="the realistic-update section")
    parser.add_argument("--realistic-gib", type=float, default=1.0)
    args = parser.parse_args()
    if args.quick:
        args.gib, args.tensors, args.repeats, args.bucket_mib = 1 / 16, 256, 1, 8
        args.realistic_gib = 1 / 16

    from socket import socket

    ports = []
    for _ in range(2):
        with socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args, tuple(ports), results)) for r in range(3)]
    for p in procs:
        p.start()
    by_rank = {}
    for _ in procs:
        rank, kept, peak, total, transformer, two = results.get()
        by_rank[rank] = (kept, peak)
        if rank == 0:
            transformer_kept, two_kept = transformer, two
    for p in procs:
        p.join(120)
    if args.realistic:
        realistic_main(args, by_rank, load_before)
        return
    trainer, trainer_peak = by_rank[0]
    _, rollout_peak = by_rank[1]
    gib = total / GIB

    result = Result(
        benchmark="sync",
        title=f"Weight sync of {gib:.2f} GiB in {args.tensors} tensors, 1 trainer -> 2 rollouts",
        setup={
            "bytes": total,
            "tensors": args.tensors,
            "dtypes": "fp32 and bf16, alternating",
            "sizes": "7 small : 2 medium (16x) : 1 large (128x)",
            "bucket_mib": args.bucket_mib,
            "repeats": args.repeats,
            "processes": "3 (1 trainer, 2 rollouts), gloo on loopback, 1 torch thread each",
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    )
    raw_s = median(trainer["raw broadcast"]["seconds"])
    rows = []
    stats = {}
    for name in [n for n in trainer if n not in ("warm memcpy", RAW_PAIR, *REFETCHES)]:
        secs = median(trainer[name]["seconds"])
        blocked = median(trainer[name]["blocked"])
        rollout_buffers = median(by_rank[1][0][name]["buffers"])
        stats[name] = (secs, blocked)
        rows.append(
            [
                name,
                round(secs, 3),
                round(gib / secs, 3),
                round(raw_s / secs, 2),
                round(blocked, 3),
                round(median(trainer[name]["buffers"])),
                round(rollout_buffers),
            ]
        )
    memcpy_s = median(trainer["warm memcpy"]["seconds"])

    def paired(slow: str, fast: str, metric: str = "seconds") -> float:
        """Median over rounds of ``slow``'s ``metric`` over ``fast``'s time, both measured in
        the same round (so the host's drift between rounds cancels)."""
        pairs = zip(trainer[slow][metric], trainer[fast]["seconds"], strict=True)
        return median([a / b for a, b in pairs])

    pair_rows = []
    for name in (RAW_PAIR, *REFETCHES):
        secs = median(trainer[name]["seconds"])
        vs_pair = paired(RAW_PAIR, name)
        pair_rows.append([name, round(secs, 3), round(gib / secs, 3), round(vs_pair, 2)])
    result.tables.append(
        Table(
            "median of the repetitions; buffers = transfer buffers and caches the peer holds, MiB",
            [
                "peer",
                "time s",
                "GiB/s",
                "x raw",
                "trainer blocked s",
                "trainer buffers",
                "rollout buffers",
            ],
            rows,
        )
    )
    result.tables.append(
        Table(
            "One rollout asks again (refetch) for the cached version while the trainer trains "
            "and the other rollout idles: every byte, from the publisher's cache (over a "
            "trainer-rollout pair group, or read by the rollout itself for cma); x raw = "
            "median of per-round ratios to the raw broadcast to that rollout alone",
            ["peer", "time s", "GiB/s", "x raw"],
            pair_rows,
        )
    )
    result.tables.append(
        Table(
            "reference and peaks",
            ["what", "value"],
            [
                ["warm memcpy of the weights (s)", round(memcpy_s, 3)],
                ["peak RSS trainer (MiB)", round(trainer_peak)],
                ["peak RSS rollout (MiB)", round(rollout_peak)],
            ],
        )
    )

    vs_raw = paired("raw broadcast", "slipstream direct")
    result.floor(
        "direct over gloo (relay) >= 0.85x raw-broadcast throughput",
        vs_raw,
        ">= 0.85",
        vs_raw >= 0.85,
    )
    vs_loop = paired("per-tensor loop", "slipstream direct")
    result.floor(
        "direct over gloo (relay) >= 4x the per-tensor loop", vs_loop, ">= 4", vs_loop >= 4
    )
    auto_vs_loop = paired("per-tensor loop", "slipstream direct ipc")
    result.floor(
        "direct, transport='auto' (ipc on this one host) >= 4x the per-tensor loop",
        auto_vs_loop,
        ">= 4",
        auto_vs_loop >= 4,
    )
    cached_blocked = paired("slipstream cached", "warm memcpy", "blocked")
    result.floor(
        "cached blocks the trainer <= 2x a warm memcpy (ratio)",
        cached_blocked,
        "<= 2",
        cached_blocked <= 2,
    )
    cma = paired("raw broadcast", "slipstream direct cma")
    result.floor("colocated (cma, direct) >= 2x raw-broadcast throughput", cma, ">= 2", cma >= 2)
    ipc_vs_cma = paired("slipstream direct cma", "slipstream direct ipc")
    result.floor(
        "colocated: ipc direct at least as fast as cma direct (cma time / ipc time)",
        ipc_vs_cma,
        ">= 1",
        ipc_vs_cma >= 1,
    )
    ipc_vs_cma_cached = paired("slipstream cached cma", "slipstream cached ipc")
    shm = paired("raw broadcast", "slipstream direct shm")
    ipc = paired("raw broadcast", "slipstream direct ipc")
    result.notes.append(
        f"Colocated transports: 'ipc' (what transport='auto' picks here: the trainer packs "
        f"each bucket into slots it shared once through torch's tensor sharing, the rollouts "
        f"copy straight out of them) ran at {ipc:.2f}x the raw broadcast's throughput, "
        f"{auto_vs_loop:.1f}x the per-tensor loop's, and {ipc_vs_cma:.2f}x 'cma' direct "
        f"({ipc_vs_cma_cached:.2f}x cached); 'cma' (the rollouts copy straight out of the "
        f"trainer's memory, one copy in all) at {cma:.2f}x the raw broadcast's throughput, "
        f"'shm' (the copying ring in a file of its own) at {shm:.2f}x."
    )
    result.notes.append(
        "Floors are medians of per-round ratios: every round runs each peer once, back to "
        "back, so the ratio of two peers in one round cancels the host's drift between "
        "rounds (in this run the raw broadcast alone took "
        f"{min(trainer['raw broadcast']['seconds']):.2f} to "
        f"{max(trainer['raw broadcast']['seconds']):.2f} s from round to round)."
    )
    t_layout = transformer_shapes(args.quick)
    t_largest = max(n * dt.itemsize for n, dt in t_layout) / 2**20
    t_raw = transformer_kept["raw broadcast"]["seconds"]
    t_gib = transformer_kept["raw broadcast"]["bytes"][0] / GIB
    t_rows = []
    for name, got in transformer_kept.items():
        secs = median(got["seconds"])
        vs_raw = median([a / b for a, b in zip(t_raw, got["seconds"], strict=True)])
        t_rows.append([name, round(secs, 3), round(t_gib / secs, 3), round(vs_raw, 2)])
    result.tables.append(
        Table(
            f"Transformer-shaped weights: {t_gib:.2f} GiB in {len(t_layout)} bf16 tensors "
            f"(embedding, attention and MLP matrices, the largest {t_largest:.0f} MiB), direct "
            "over relay and broadcast; x raw = median of per-round ratios",
            ["peer", "time s", "GiB/s", "x raw"],
            t_rows,
        )
    )
    two_transport = two_kept.pop("transport")
    two_rows = []
    for name in TWO_MODELS:
        secs = median(two_kept[name]["seconds"])
        moved = two_kept[name]["bytes"][0] / GIB
        two_rows.append([name, round(moved, 3), round(secs, 3), round(moved / secs, 3)])
    pair_vs_sum = median(
        [
            both / (a + b)
            for a, b, both in zip(*(two_kept[n]["seconds"] for n in TWO_MODELS), strict=True)
        ]
    )
    result.tables.append(
        Table(
            f"Two models from one sync group (a channel each, transport='auto', here "
            f"'{two_transport}', direct): the pair back to back took {pair_vs_sum:.2f}x the "
            "sum of the two alone (median of per-round ratios)",
            ["peer", "GiB", "time s", "GiB/s"],
            two_rows,
        )
    )
    relay_vs_broadcast = paired("slipstream direct broadcast", "slipstream direct")
    result.notes.append(
        "Slices sent on their own (separate_min_bytes) go from the trainer's tensor into the "
        "rollout's parameter with no bucket copy on either side. Over relay a message is a "
        "point-to-point send, cheap enough that every slice of 1 MiB and up goes alone (in "
        "the 2048-tensor layout, the large tensors: 77% of the bytes); over broadcast a "
        "message is a collective, so only slices of 16 MiB and up do (none in that layout). "
        f"There direct over relay ran at {relay_vs_broadcast:.2f}x direct over broadcast."
    )
    raw_vs_loop = paired("per-tensor loop", "raw broadcast")
    result.notes.append(
        f"On this host the per-tensor loop is {raw_vs_loop:.1f}x slower than the raw "
        "broadcast itself, so 'direct >= 4x the per-tensor loop' would need direct to beat "
        f"the raw broadcast by {4 / raw_vs_loop:.2f}x over the same transport."
    )
    result.notes.append(
        "Every run ships changed bytes (the trainer adds 1 to each weight first, and each "
        "slipstream run checks that it sent every byte), so slipstream's skipping of "
        "unchanged tensors never kicks in here."
    )
    result.notes.append(
        "All peers run in the same three processes, so peak RSS is per side for the whole "
        "run; the per-peer memory is the buffers column (for shm and ipc, the ring is shared "
        "memory counted on the trainer's side; for cma, the rollout's bucket is reserved but its "
        "pages are touched only by tensors that cannot land in their parameter, none here)."
    )
    result.notes.append(
        "The verl-style baseline is written here after verl's checkpoint engine: host cache, "
        "then bucket copy, then broadcast, one bucket buffer, no overlap; its cache is "
        "allocated once (verl allocated fresh pinned buffers every sync)."
    )
    result.notes.append(
        "load_average_1min is the host's 1-minute load average before and after the run: "
        "on a shared 2-core host every extra copy (packing, checksums, unpacking into the "
        "rollout's tensors) competes with the transfer itself for CPU time."
    )
    for floor in result.floors:
        print(f"{'PASS' if floor.passed else 'MISS'} {floor.claim}: {floor.measured}")
    for row in rows:
        print(row)
    result.write(args.out)


def realistic_main(args: argparse.Namespace, by_rank: dict, load_before: float) -> None:
    from realistic_updates import transformer_like_shapes

    trainer, trainer_peak = by_rank[0]
    shapes = transformer_like_shapes(int(args.realistic_gib * GIB))
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes)
    result = Result(
        benchmark="sync-realistic",
        title=f"Weight sync of realistic updates ({total / GIB:.2f} GiB of bf16), and one "
        "snapshot for a checkpoint and a publish; 1 trainer -> 2 rollouts",
        setup={
            "bytes": total,
            "tensors": len(shapes),
            "repeats": args.repeats,
            "processes": "3 (1 trainer, 2 rollouts), gloo on loopback; trainer with every "
            "core as torch threads, rollouts 1",
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    )
    realistic_report(result, trainer, total)
    result.notes.append(
        f"Peak RSS: trainer {trainer_peak:.0f} MiB, rollout {by_rank[1][1]:.0f} MiB."
    )
    for floor in result.floors:
        print(f"{'PASS' if floor.passed else 'MISS'} {floor.claim}: {floor.measured}")
    for table in result.tables:
        for row in table.rows:
            print(row)
    result.write(args.out)


if __name__ == "__main__":
    main()
