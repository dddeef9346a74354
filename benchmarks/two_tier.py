"""Two-tier checkpoints: what the local tier costs the training loop, and how fast a lost
node recovers from peer replicas, beside the durable tier.

Two ranks on gloo stand in for two nodes of one rank (``ranks_per_node=1``); each holds a
state of ``--size-mib`` of its own.

- **Loop cost.** Interleaved rounds of ``--steps`` training steps (a matmul loop, then the
  "optimizer step" that mutates the state once the previous save has staged it), with no
  checkpoint, with a local-tier save every step (written to ``/dev/shm``, replicated to
  the other rank), and with a durable save to the local disk every step. Per step, the
  slowest rank's time; overhead = a mode's median step minus no checkpoint's.
- **Recovery.** One step saved to the local tier (replicated) and to the durable tiers
  (moto S3, the local disk); rank 1's local directory is deleted (its node was lost).
  Then, interleaved: every rank loads the step through the two-tier ``Checkpointer``
  (rank 1 from rank 0's replicas), from S3, from the local disk (page cache warm), and
  from the local disk with the page cache dropped. Rank 1's wall time of ``load`` is the
  recovery time.

- **Replication.** Each rank copies a file of ``--size-mib`` from its ``/dev/shm`` into
  the other rank's local tier (both at once, as a local save does: the tier's exchanges
  over its gloo group), interleaved with a bare gloo send and receive of the same bytes
  between tensors in memory (the transport alone). Per round, the slowest rank's time.

NVRx's ``LocalCheckpointManager`` is left out: see the note written into the result.

    flock /tmp/slipstream-bench.lock .venv/bin/python benchmarks/two_tier.py --quick
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import Result, Table, drop_page_cache, fmt, interleave, join_all, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from storage_server import CREDENTIALS, UNSET, moto_server  # noqa: E402

MIB = 2**20
BUCKET = "slipstream-two-tier"
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
NONE = "no checkpoint"
LOCAL = "local tier every step (/dev/shm, 1 replica on the other node)"
DISK = "durable save every step (local disk)"
RECOVER_LOCAL = "two-tier Checkpointer.load (rank 1 from peer replicas)"
RECOVER_S3 = "durable tier on S3 (moto), Checkpointer.load"
RECOVER_DISK = "durable tier on local disk, page cache warm"
RECOVER_DISK_COLD = "durable tier on local disk, page cache dropped"
RECOVERY_STEP = 1000
TIER_COPY = "a local save's copy (the tier's exchanges over its gloo group, mapped files)"
BARE = "bare gloo isend + irecv of the same bytes (tensors in memory)"
WAITS = "step waits on an accelerator (the training thread sleeps)"
CPU_BOUND = "step computes on the CPU (matmuls; both ranks' threads fill the 2 cores)"
NVRX_NOTE = (
    "NVRx's LocalCheckpointManager is not a peer here: nvidia-resiliency-ext 0.4.1 installs "
    "without replacing torch (pip install --dry-run), but its BasicTensorAwareStateDict "
    "asserts that every tensor is on a CUDA device and its async save calls "
    "torch.cuda.synchronize(); this machine has no GPU. Its pynvml dependency also makes "
    "every `import torch` print a FutureWarning, so it was not kept in the environment."
)


@dataclass
class Options:
    size_mib: int
    tensors: int
    steps: int
    repeats: int
    work_ms: float
    workdir: str
    shm: str


def make_state(rank: int, nbytes: int, count: int) -> dict[str, torch.Tensor]:
    """This rank's state: ``count`` fp32 tensors of its own (keys name the rank)."""
    g = torch.Generator().manual_seed(rank)
    per = nbytes // count // 4 // 256 * 256
    return {
        f"rank{rank}.layer{i:03d}": torch.empty(per // 256, 256).uniform_(-1, 1, generator=g)
        for i in range(count)
    }


def calibrate_work(ms: float) -> int:
    """Matmuls of 256x256 that take about ``ms`` on this thread."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    each = (time.perf_counter() - start) / 20
    return max(1, round(ms / 1000 / each))


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank: int, world: int, port: int, opts: Options, env: dict[str, str], queue) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out = run_rank(rank, opts)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def replication(rank: int, opts: Options) -> dict[str, Any]:
    """Each rank copies a file of ``size_mib`` into the other's local tier at once, as a
    local save replicates (the tier's four exchanges over its gloo group, both files
    memory-mapped), and the same bytes as one bare gloo send and receive between two
    tensors in memory (the transport alone), interleaved."""
    from slipstream.checkpoint.save.channel import RankChannel
    from slipstream.checkpoint.storage import LocalStorage
    from slipstream.checkpoint.tier.link import TierLink
    from slipstream.checkpoint.tier.nodes import NodeMap
    from slipstream.checkpoint.tier.replication import StepReplication, step_copies
    from slipstream.core.waits import Deadline

    root = os.path.join(opts.shm, "replication", f"node{rank}")
    location = LocalStorage(os.path.join(root, "step_1"), direct_io=False)
    location.prepare()
    name = f"__{rank}_0.distcp"
    payload = torch.randint(0, 256, (opts.size_mib * MIB,), dtype=torch.uint8)
    with open(os.path.join(location.path, name), "wb") as f:
        f.write(payload.numpy().tobytes())
    store = dist.distributed_c10d._get_default_store()
    channel = RankChannel(dist.PrefixStore("bench-replication", store), rank, 2, "bench")
    link = TierLink(channel, 60.0)
    nodes = NodeMap.from_ranks_per_node(2, 1)
    copies = [c for c in step_copies(nodes, 1) if c.file.startswith("__")]
    bare = dist.new_group(backend="gloo")
    landing = torch.empty_like(payload)
    received = os.path.join(location.path, f"__{1 - rank}_0.distcp")

    def tier_copy() -> dict[str, float]:
        if os.path.exists(received):
            os.remove(received)
        dist.barrier()
        start = time.perf_counter()
        errors = StepReplication(link, copies, rank, location, "step_1", None).run(Deadline(60))
        took = time.perf_counter() - start
        assert errors == [], errors
        return {"s": slowest(took)}

    def bare_copy() -> dict[str, float]:
        dist.barrier(group=bare)
        start = time.perf_counter()
        works = [
            dist.isend(payload, group=bare, group_dst=1 - rank),
            dist.irecv(landing, group=bare, group_src=1 - rank),
        ]
        for work in works:
            work.wait()
        return {"s": slowest(time.perf_counter() - start)}

    rounds = interleave({TIER_COPY: lambda rep: tier_copy(), BARE: lambda rep: bare_copy()},
                        opts.repeats * 4, shuffle_seed=13)  # fmt: skip
    sent: list[Any] = [None, None]
    dist.all_gather_object(sent, hashlib.sha256(payload.numpy()).hexdigest())
    with open(received, "rb") as f:  # the peer's file arrived whole
        assert hashlib.sha256(f.read()).hexdigest() == sent[1 - rank], "a replica differs"
    link.close()
    dist.destroy_process_group(bare)
    channel.close()
    location.close()
    shutil.rmtree(os.path.join(opts.shm, "replication"), ignore_errors=True)
    return rounds


def tier(root: str) -> Any:
    import slipstream as ss

    return ss.LocalTier(root=root, ranks_per_node=1, keep_last=2)


def run_rank(rank: int, opts: Options) -> dict[str, Any]:
    import slipstream as ss

    state = make_state(rank, opts.size_mib * MIB, opts.tensors)
    work = Path(opts.workdir)
    matmuls = calibrate_work(opts.work_ms)
    a = torch.randn(256, 256)
    never = 10**9
    savers = {
        LOCAL: ss.Checkpointer(
            work / "unused",
            local_tier=tier(os.path.join(opts.shm, "loop", f"node{rank}")),
            durable_every=never,
        ),
        DISK: ss.Checkpointer(work / "loop_disk", keep_last=2),
    }
    counter = [0]

    def loop(mode: str, kind: str) -> dict[str, float]:
        ck = savers.get(mode)
        dist.barrier()
        previous = None
        start = time.perf_counter()
        for _ in range(opts.steps):
            if kind == CPU_BOUND:
                for _ in range(matmuls):
                    a @ a
            else:
                time.sleep(opts.work_ms / 1000)  # the thread waits on its accelerator
            if previous is not None:
                previous.staging_completion.result()
            for t in state.values():
                t[0].add_(1e-3)  # the optimizer step: the state changes every step
            counter[0] += 1
            if ck is not None:
                previous = ck.save(counter[0], state)
        step = (time.perf_counter() - start) / opts.steps
        if ck is not None:
            ck.wait()
        return {"step_s": slowest(step)}

    copies = replication(rank, opts)
    loops = {
        kind: interleave(
            {m: (lambda rep, m=m, kind=kind: loop(m, kind)) for m in (NONE, LOCAL, DISK)},
            opts.repeats,
            shuffle_seed=7,
        )
        for kind in (WAITS, CPU_BOUND)
    }
    shm_bytes = du(os.path.join(opts.shm, "loop", f"node{rank}"))
    for ck in savers.values():
        ck.close()

    # -- recovery ---------------------------------------------------------------------
    s3_root = f"s3://{BUCKET}/run"
    two_tier = ss.Checkpointer(
        s3_root, local_tier=tier(os.path.join(opts.shm, "recover", f"node{rank}"))
    )
    s3_only = ss.Checkpointer(s3_root)
    disk = ss.Checkpointer(work / "recover_disk")
    two_tier.save(RECOVERY_STEP, state).result()  # local tier and S3, the same step
    disk.save(RECOVERY_STEP, state).result()
    dist.barrier()
    if rank == 1:  # node 1 is lost: its local tier is gone
        shutil.rmtree(os.path.join(opts.shm, "recover", f"node{rank}"))
        os.makedirs(os.path.join(opts.shm, "recover", f"node{rank}"))
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    tiers_served: list[str] = []

    def recover(mode: str) -> dict[str, float]:
        for t in dest.values():
            t.zero_()
        if mode == RECOVER_DISK_COLD:
            drop_page_cache([disk.path(RECOVERY_STEP)])
        dist.barrier()
        start = time.perf_counter()
        if mode == RECOVER_LOCAL:
            two_tier.load(dest, RECOVERY_STEP, strict=False)
            tiers_served.append(str(two_tier.last_load_tier))
        elif mode == RECOVER_S3:
            s3_only.load(dest, RECOVERY_STEP, strict=False)
        else:
            disk.load(dest, RECOVERY_STEP, strict=False)
        mine = time.perf_counter() - start
        assert all(torch.equal(dest[k], state[k]) for k in state), mode
        lost_node = torch.tensor([mine if rank == 1 else 0.0], dtype=torch.float64)
        dist.all_reduce(lost_node, op=dist.ReduceOp.MAX)
        return {"rank1_s": float(lost_node), "slowest_s": slowest(mine)}

    loads = interleave(
        {
            m: (lambda rep, m=m: recover(m))
            for m in (RECOVER_LOCAL, RECOVER_S3, RECOVER_DISK, RECOVER_DISK_COLD)
        },
        opts.repeats,
        shuffle_seed=11,
    )
    assert set(tiers_served) == {"local"}, tiers_served
    for ck in (two_tier, s3_only, disk):
        ck.close()
    return {
        "loops": loops,
        "loads": loads,
        "copies": copies,
        "matmuls": matmuls,
        "shm_bytes": shm_bytes,
    }


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def run(opts: Options) -> dict[str, Any]:
    import boto3
    import torch.multiprocessing as mp
    from dist_utils import free_port

    with moto_server() as endpoint:
        env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        for k in UNSET:
            os.environ.pop(k, None)
        os.environ.update(env)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, 2, port, opts, env, queue)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            return queue.get(timeout=3600)
        finally:
            join_all(procs)


def report(opts: Options, got: dict[str, Any]) -> Result:
    result = Result(
        "two_tier",
        "Two-tier checkpoints: loop cost of a local-tier save with replication, and recovery "
        "of a lost node from peer replicas, beside the durable tier",
    )
    result.setup = {
        "ranks": 2,
        "nodes (simulated, ranks_per_node=1)": 2,
        "state per rank MiB": opts.size_mib,
        "tensors per rank": opts.tensors,
        "steps per round": opts.steps,
        "repeats (interleaved, after one warm-up)": opts.repeats,
        "compute per step ms": opts.work_ms,
        "local tier": f"{opts.shm} (tmpfs), keep_last=2, replicas=1",
        "durable S3": "moto server (tests/storage_server.py) on 127.0.0.1",
    }
    ratios = {}
    for kind, runs in got["loops"].items():
        loops = {m: median(v["step_s"]) for m, v in runs.items()}
        over = {m: loops[m] - loops[NONE] for m in loops}
        table = Table(
            f"Training loop, one save per step, {kind} (slowest rank per step)",
            ["mode", "step ms", "overhead ms/step", "overhead vs durable disk save"],
        )
        for m in (NONE, LOCAL, DISK):
            vs = "" if m == NONE else fmt(over[m] / over[DISK]) if over[DISK] > 0 else "n/a"
            table.rows.append([m, fmt(1000 * loops[m]), fmt(1000 * over[m]), vs])
        result.tables.append(table)
        ratios[kind] = loops[LOCAL] / loops[DISK]
    result.floor(
        "a step with a local-tier save (replicated) costs the loop no more than one with a "
        "durable local-disk save (step time ratio; the step waits on an accelerator)",
        ratios[WAITS],
        "<= 1.0",
        ratios[WAITS] <= 1.0,
    )
    result.notes.append(
        f"Loop, CPU-bound steps: step time ratio local tier / durable disk save "
        f"{fmt(ratios[CPU_BOUND])}. Here every core trains, so the save's copies take CPU "
        "from the step: the local tier writes its file into tmpfs (a copy) and replicates it "
        "over loopback TCP (two more copies, which a NIC would do by DMA between nodes), "
        "where the durable disk save's O_DIRECT write leaves the copying to the disk's DMA."
    )
    loads = {m: median(v["rank1_s"]) for m, v in got["loads"].items()}
    slow = {m: median(v["slowest_s"]) for m, v in got["loads"].items()}
    table = Table(
        "Recovery of the lost node's rank (rank 1), the same step from each tier",
        ["source", "rank 1 load s", "slowest rank s", "GiB/s (rank 1)", "vs peer replicas"],
    )
    for m in (RECOVER_LOCAL, RECOVER_S3, RECOVER_DISK, RECOVER_DISK_COLD):
        gibs = opts.size_mib / 1024 / loads[m]
        table.rows.append(
            [m, fmt(loads[m]), fmt(slow[m]), fmt(gibs), fmt(loads[m] / loads[RECOVER_LOCAL])]
        )
    result.tables.append(table)
    s3_speedup = loads[RECOVER_S3] / loads[RECOVER_LOCAL]
    result.floor(
        "recovery from peer replicas vs the same step from the durable tier on S3 (moto)",
        s3_speedup,
        ">= 5",
        s3_speedup >= 5,
    )
    shm_mib = got["shm_bytes"] / MIB
    result.notes.append(
        f"Local tier memory: each node held {shm_mib:.0f} MiB in {opts.shm} at the end of the "
        f"loop rounds for a {opts.size_mib} MiB state per rank: (keep_last (2) + the one "
        "step's files kept aside for the next save to write over) x (its own file + the "
        "replica it holds) x the state, plus the small .metadata and index."
    )
    result.notes.append(
        f"Recovery, local disk: {fmt(loads[RECOVER_DISK] / loads[RECOVER_LOCAL])}x the peer-"
        "replica time with the page cache warm (it serves both tiers from memory here), "
        f"{fmt(loads[RECOVER_DISK_COLD] / loads[RECOVER_LOCAL])}x with it dropped."
    )
    copies = {m: median(v["s"]) for m, v in got["copies"].items()}
    table = Table(
        f"Replication of {opts.size_mib} MiB per rank, both ranks at once (slowest rank; "
        f"{len(got['copies'][BARE]['s'])} rounds)",
        ["copy", "s", "GiB/s per rank", "vs the bare gloo transfer"],
    )
    for m in (TIER_COPY, BARE):
        gibs = opts.size_mib / 1024 / copies[m]
        table.rows.append([m, fmt(copies[m]), fmt(gibs), fmt(copies[m] / copies[BARE])])
    result.tables.append(table)
    result.notes.append(
        f"Replication rides a gloo group of the tier's own (no listener, handshake or frame "
        f"format of slipstream's): a local save's copy of {opts.size_mib} MiB took "
        f"{fmt(copies[TIER_COPY])} s, {fmt(copies[TIER_COPY] / copies[BARE])}x one bare gloo "
        "send and receive of the same bytes between tensors; the difference is the three "
        "word exchanges (offer, room, stored), the receiver's space allocation and flush, and "
        "page faults on the two mapped files."
    )
    result.notes.append(NVRX_NOTE)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for development")
    parser.add_argument("--size-mib", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/two_tier.json")
    args = parser.parse_args()
    if SHM is None:
        raise SystemExit("this benchmark needs /dev/shm")
    opts = Options(
        size_mib=args.size_mib or (32 if args.quick else 256),
        tensors=8 if args.quick else 32,
        steps=4 if args.quick else 6,
        repeats=args.repeats or (2 if args.quick else 5),
        work_ms=200.0,
        workdir="/tmp/slipstream-bench/two_tier",
        shm=os.path.join(SHM, "slipstream-bench-two-tier"),
    )
    for path in (opts.workdir, opts.shm):
        shutil.rmtree(path, ignore_errors=True)
    result_load_start = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    try:
        got = run(opts)
    finally:
        for path in (opts.workdir, opts.shm):
            shutil.rmtree(path, ignore_errors=True)
    result = report(opts, got)
    result.setup["load average at start"] = result_load_start
    result.note_load("end")
    for table in result.tables:
        print(table.title)
        for row in table.rows:
            print("  ", row)
    for floor in result.floors:
        print(floor)
    result.write(args.out)


if __name__ == "__main__":
    main()
