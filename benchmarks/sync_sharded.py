"""Shard-aware publishes, side by side with today's gather path: 2 FSDP trainer ranks, 2
tensor-parallel rollout ranks.

``--mib`` MiB of transformer-shaped bf16 weights (``--hidden``, ``--ffn``; layers of q, k, v,
o, gate, up, down and two norms, as many as fit, plus an embedding), each a DTensor placed
``Shard(0)`` over the two trainers' gloo mesh (made with ``DTensor.from_local``: no trainer
ever holds a full tensor). Two publishers in the same processes, one channel each, interleaved
A B A B, median of ``--repeats`` after one warm-up, in ``direct`` and ``cached`` mode:

- ``gather``: today's path: the publisher's holders turned off, so every DTensor is gathered
  (``full_tensor``) bucket by bucket on the caller's thread and each trainer sends the buckets
  it owns of the gathered stream;
- ``sharded``: each trainer sends its own shards (:mod:`slipstream.sync.layout.holders`).

Per publish, on each trainer: ``blocked`` (until ``publish`` returned: the caller's loop stalls
this long) and ``delivered`` (until every rollout acknowledged). The two rollouts are one
tensor-parallel model over a gloo mesh of their own: q, k, v, gate, up and the embedding
column-parallel (``Shard(0)``: each rank its rows), o and down row-parallel (``Shard(1)``:
its band of columns), the norms replicated; ``auto`` transport: ``ipc`` on one host. The
last version of each peer is checked on the rollouts, every byte of each rank's shards
against the value its trainer wrote, and each rank's bytes received per version are
reported against its shards' bytes.

``--trainers tp`` places the trainers' DTensors as a tensor-parallel trainer's (as the
rollouts' below: o and down ``Shard(1)``, each trainer its band of columns, the rest
``Shard(0)``), where the default (``fsdp``) places every one ``Shard(0)``.

``--compare rollouts`` (``--transport relay`` by default there) compares the rollouts'
side instead, both peers' trainers sending their own shards: ``full``: each rollout rank
receives every tensor whole into a plain module (what a rollout unaware of its own
parallelism gets), against ``own``: the tensor-parallel pair above, each rank sent only its
own bytes.

python benchmarks/sync_sharded.py --compare rollouts \
    --out benchmarks/results/sync_sharded_rollouts.json

python benchmarks/sync_sharded.py --out benchmarks/results/sync_sharded.json

python benchmarks/sync_sharded.py --trainers tp --out benchmarks/results/sync_sharded_tp.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import Result, Table, fmt, free_port, interleave, median  # noqa: E402

import slipstream as ss  # noqa: E402

MiB = 2**20
PEERS = {"trainers": ["gather", "sharded"], "rollouts": ["full", "own"]}
TRAINERS = 2


def shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """Transformer-shaped tensors of about ``--mib`` MiB in bf16 (each row count even)."""
    h, f = args.hidden, args.ffn
    out: dict[str, tuple[int, ...]] = {"embed.weight": (args.vocab, h)}
    layer = {
        "q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h),
        "gate": (f, h), "up": (f, h), "down": (h, f), "norm1": (h,), "norm2": (h,),
    }  # fmt: skip
    per_layer = sum(torch.Size(s).numel() for s in layer.values()) * 2
    budget = args.mib * MiB - args.vocab * h * 2
    for i in range(max(1, budget // per_layer)):
        out.update({f"layers.{i}.{n}": s for n, s in layer.items()})
    return out


def value(version: int, trainer: int) -> float:
    return float(version * 4 + trainer)


def trainer(rank: int, group, args: argparse.Namespace) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.mesh_port}",
        rank=rank,
        world_size=TRAINERS,
        timeout=timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (TRAINERS,))
    dims = {n: trainer_dim(args, n, s) for n, s in shapes(args).items()}
    local = {
        n: torch.empty([k // TRAINERS if d == dims[n] else k for d, k in enumerate(s)])
        for n, s in shapes(args).items()
    }
    local = {n: t.to(torch.bfloat16) for n, t in local.items()}
    state = {
        n: DTensor.from_local(t, mesh, [Shard(dims[n])], run_check=False) for n, t in local.items()
    }
    results = {
        mode: measure(rank, group, args, mode, local, state) for mode in ("direct", "cached")
    }
    torch.distributed.destroy_process_group()
    return results


def measure(
    rank: int, group, args: argparse.Namespace, mode: str, local: dict, state: dict
) -> dict:
    """Both peers' publishes in ``mode``, interleaved; each version's rows carry its value."""
    peers = PEERS[args.compare]
    pubs = {
        peer: ss.WeightPublisher(
            group,
            list(range(TRAINERS)),
            [TRAINERS, TRAINERS + 1],
            bucket_bytes=args.bucket_mib * MiB,
            mode=mode,
            transport=args.transport,
            delta=False,
            channel=f"{mode}-{peer}",
        )
        for peer in peers
    }
    if "gather" in pubs:
        pubs["gather"]._holders = lambda specs, tensors: None  # type: ignore[method-assign]
    versions = dict.fromkeys(peers, 0)

    def runner(peer: str):
        def run(rep: int) -> dict[str, float]:
            versions[peer] += 1
            for t in local.values():
                t.fill_(value(versions[peer], rank))
            start = time.perf_counter()
            handle = pubs[peer].publish(state, version=versions[peer])
            blocked = time.perf_counter() - start
            handle.delivered.result(timeout=600)
            return {"blocked": blocked, "delivered": time.perf_counter() - start}

        return run

    kept: dict = interleave({p: runner(p) for p in peers}, args.repeats)
    kept["transport"] = pubs[peers[-1]].transport
    for pub in pubs.values():
        pub.close()
    return kept


#: The rollouts' row-parallel tensors (``Shard(1)``); the other matrices are ``Shard(0)``.
ROW_PARALLEL = (".o", ".down")


def trainer_dim(args: argparse.Namespace, name: str, shape: tuple[int, ...]) -> int:
    """The dimension the trainers split tensor ``name`` on."""
    return 1 if args.trainers == "tp" and split_dim(name, shape) == 1 else 0


def split_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """The dimension the rollouts split tensor ``name`` on (``None``: replicated)."""
    if len(shape) == 1:
        return None
    return 1 if name.endswith(ROW_PARALLEL) else 0


def tp_target(mesh, sizes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A module of buffers over the rollouts' ``mesh``: DTensors placed as :func:`split_dim`
    says (each rank's local shard zeroed), the rest plain (replicated)."""
    from torch.distributed.tensor import DTensor, Shard

    target = nn.Module()
    tp = mesh.get_local_rank()
    for i, (n, s) in enumerate(sizes.items()):
        dim = split_dim(n, s)
        if dim is None:
            target.register_buffer(f"t{i}", torch.zeros(s, dtype=torch.bfloat16))
            continue
        local = torch.zeros(s, dtype=torch.bfloat16).chunk(2, dim)[tp].contiguous()
        target.register_buffer(f"t{i}", DTensor.from_local(local, mesh, [Shard(dim)]))
    return target


def plain_target(sizes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A module of plain buffers: every tensor whole."""
    target = nn.Module()
    for i, s in enumerate(sizes.values()):
        target.register_buffer(f"t{i}", torch.zeros(s, dtype=torch.bfloat16))
    return target


def exact(
    args: argparse.Namespace, target: nn.Module, sizes: dict, names: dict, version: int, tp: int
) -> bool:
    """Whether every byte of this rank's shards (of every tensor of a plain target) holds
    what its trainer wrote: trainer t's part of the dimension the trainers split a tensor on
    (:func:`trainer_dim`) is ``[t * half, (t + 1) * half)``."""
    ok = True
    for n, s in sizes.items():
        t = target.get_buffer(names[n])
        dim = trainer_dim(args, n, s)
        index = torch.arange(s[dim]) >= s[dim] // TRAINERS
        along = [1] * len(s)
        along[dim] = -1
        want = (index.to(torch.bfloat16) + value(version, 0)).view(along).expand(s)
        if hasattr(t, "to_local"):
            want = want.chunk(2, split_dim(n, s))[tp]
        local = t.to_local() if hasattr(t, "to_local") else t
        ok &= bool((local == want).all())
    return ok


def rollout(rank: int, group, args: argparse.Namespace) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.tp_port}",
        rank=rank - TRAINERS,
        world_size=2,
        timeout=timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (2,))
    tp = mesh.get_local_rank()
    sizes = shapes(args)
    names = {n: f"t{i}" for i, n in enumerate(sizes)}
    out: dict = {"checked": {}, "received": {}}
    peers = PEERS[args.compare]
    for mode in ("direct", "cached"):
        subs = {
            peer: ss.WeightSubscriber(
                group, list(range(TRAINERS)), [TRAINERS, TRAINERS + 1], channel=f"{mode}-{peer}"
            )
            for peer in peers
        }
        targets = {
            peer: plain_target(sizes) if peer == "full" else tp_target(mesh, sizes)
            for peer in peers
        }
        received: dict[str, list[int]] = {peer: [] for peer in peers}
        version = 0
        for _ in range(1 + args.repeats):
            version += 1
            for peer in peers:
                before = subs[peer].bytes_received
                assert subs[peer].receive(targets[peer], name_map=names) == version
                received[peer].append(subs[peer].bytes_received - before)
        for peer in peers:
            checked = exact(args, targets[peer], sizes, names, version, tp)
            out["checked"][f"{mode} {peer}"] = checked
            out["received"][f"{mode} {peer}"] = median(received[peer])
            subs[peer].close()
    box = targets[peers[-1]]
    out["kept"] = sum((b.to_local() if hasattr(b, "to_local") else b).nbytes for b in box.buffers())
    torch.distributed.destroy_process_group()
    return out


def worker(rank: int, args: argparse.Namespace, queue) -> None:
    try:
        group = ss.sync.init_group("127.0.0.1", args.port, TRAINERS + 2, rank, timeout=600)
        out = trainer(rank, group, args) if rank < TRAINERS else rollout(rank, group, args)
        group.close()
        queue.put((rank, out, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", choices=sorted(PEERS), default="trainers")
    parser.add_argument("--trainers", choices=("fsdp", "tp"), default="fsdp")
    parser.add_argument("--transport", default=None, help="auto; relay with --compare rollouts")
    parser.add_argument("--out", default="benchmarks/results/sync_sharded.json")
    args = parser.parse_args()
    if args.transport is None:
        args.transport = "relay" if args.compare == "rollouts" else "auto"
    args.port, args.mesh_port, args.tp_port = free_port(), free_port(), free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, args, queue)) for r in range(TRAINERS + 2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        rank, value_, error = queue.get()
        if error:
            raise SystemExit(f"rank {rank} failed:\n{error}")
        out[rank] = value_
    for p in procs:
        p.join(60)
    total = sum(torch.Size(s).numel() for s in shapes(args).values()) * 2
    peers = PEERS[args.compare]
    titles = {
        "trainers": ("sync_sharded", "Shard-aware publish vs today's gather path"),
        "rollouts": ("sync_sharded_rollouts", "TP rollouts sent their own bytes vs every byte"),
    }
    name, title = titles[args.compare]
    placed = "Shard(0)"
    if args.trainers == "tp":
        name, placed = f"{name}_tp", "Shard(0), o and down Shard(1)"
    result = Result(
        name,
        f"{title}: 2 {args.trainers.upper()} trainers, 2 TP rollouts",
        setup={
            "weights": f"{total / MiB:.0f} MiB bf16 in {len(shapes(args))} DTensors, {placed}",
            "bucket": f"{args.bucket_mib} MiB",
            "repeats": args.repeats,
            "transport": out[0]["direct"]["transport"],
        },
    )
    for mode in ("direct", "cached"):
        table = Table(
            f"{mode} mode (median s, trainer rank 0 / 1)", ["peer", "blocked", "delivered"]
        )
        med = {
            p: {
                m: [median(out[t][mode][p][m]) for t in range(TRAINERS)]
                for m in ("blocked", "delivered")
            }
            for p in peers
        }
        for p in peers:
            table.rows.append(
                [p, *(" / ".join(fmt(v) for v in med[p][m]) for m in ("blocked", "delivered"))]
            )
        result.tables.append(table)
        if args.compare == "trainers":
            for metric, floor in (("blocked", 0.3), ("delivered", 0.5)):
                ratio = max(med["sharded"][metric]) / max(med["gather"][metric])
                claim = f"{mode}: sharded {metric} / gather"
                result.floor(claim, ratio, f"<= {floor}", ratio <= floor)
            continue
        for r in (TRAINERS, TRAINERS + 1):
            ratio = out[r]["received"][f"{mode} own"] / out[r]["kept"]
            claim = f"{mode}: rollout rank {r}'s bytes received / its shards"
            result.floor(claim, ratio, "<= 1.1", ratio <= 1.1)
        ratio = max(med["own"]["delivered"]) / max(med["full"]["delivered"])
        result.notes.append(f"{mode}: own bytes delivered / every byte delivered: {ratio:.3f}")
    if args.trainers == "tp":
        result.notes.append(
            "The trainers hold o and down by columns (Shard(1)): the sharded peer sends each "
            "trainer's band of them as a slice per row, which both sides handle one by one."
        )
    if args.compare == "trainers":
        result.notes.append(
            "The gather peer is the publisher with its holders turned off: the path every "
            "DTensor took before. Both peers' rollouts are tensor-parallel and copy out of the "
            "shared slots only their own shards."
        )
    else:
        result.notes.append(
            "Both peers' trainers send their own shards. full: plain rollouts, every tensor "
            "whole (relayed); own: the tensor-parallel pair, each rank sent its own bytes point "
            "to point (routed)."
        )
    for r in (TRAINERS, TRAINERS + 1):
        received = ", ".join(f"{k} {v / MiB:.0f}" for k, v in out[r]["received"].items())
        result.notes.append(
            f"rollout rank {r}: shards {out[r]['kept'] / MiB:.0f} MiB of {total / MiB:.0f} MiB; "
            f"MiB received per version (median): {received}"
        )
    checked = out[TRAINERS]["checked"] | out[TRAINERS + 1]["checked"]
    checked = {k: out[TRAINERS]["checked"][k] and out[TRAINERS + 1]["checked"][k] for k in checked}
    result.notes.append(f"rollouts' last versions exact: {checked}")
    for table in result.tables:
        print(table.title)
        for row in table.rows:
            print("  ", *row)
    for f in result.floors:
        print(f"{f.claim}: {f.measured} ({f.floor}: {'met' if f.passed else 'NOT met'})")
    print(*result.notes, sep="\n")
    result.write(args.out)


if __name__ == "__main__":
    main()
