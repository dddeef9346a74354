"""Streamed publishes, side by side with publishes from a mapping: 1 trainer, 1 rollout.

A model of ``--mib`` MiB in ``--tensors`` fp32 tensors, sent with the default transport
(``auto``) in ``direct`` mode. Peers, interleaved, median of ``--repeats`` after one warm-up:

- ``mapping``: ``publish(dict)`` of tensors built beforehand (what ``publish`` did with any
  input: hold every tensor, then send);
- ``stream``: ``publish(generator)`` yielding the same tensors, read as it yields;
- ``mapping, fresh``: a generator that makes a fresh tensor per step (as verl's gathers one
  ``full_tensor()`` per ``next()``), handed over as ``list(generator)``;
- ``stream, fresh``: the same generator, streamed.

Time: from ``publish`` until the rollout acknowledged. Every worker runs with
``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors leave the resident set. Memory, for the
fresh peers: the
yielded tensors alive at once, counted with a weak reference to each (``weakref.finalize``,
nothing kept), and the trainer's resident high-water mark during the publish (``VmHWM``,
reset through ``/proc/self/clear_refs`` just before it) over its resident size before it.
Before each run the trainer adds 1 to the prebuilt tensors (outside the timing) and the
fresh tensors carry the run's number, so every run ships new bytes; the last run of each
peer is checked on the rollout against its own reconstruction of the values.

The verl part drives slipstream's verl checkpoint engine through verl 0.9.1's own registry
and its ``CheckpointEngineManager`` call sequence (``prepare``, the engine class's
``build_topology``, ``init_process_group``, ``send_weights`` from the generator verl's FSDP
engine's ``get_per_tensor_param`` builds, ``receive_weights`` through its async iterator,
``finalize``): 2 FSDP2 trainers (gloo) and 2 rollouts, a tied-embedding Llama built from a
config (``--verl-layers``, ``--verl-hidden``, ``--verl-vocab``), bucket ``--bucket-mib``,
``direct`` mode, rollouts asking for every byte. Each of ``--verl-repeats`` sessions builds
new engines (a new sync group) and runs three updates of the same weights: the first (its
buckets carry the layout) and two later ones. Per update, on each trainer: the time of
``send_weights`` (until every rollout holds the version), the yielded tensors alive at once
(weak references) and the resident high-water mark during it over the size before
(``VmHWM`` reset through ``clear_refs``, and ``VmRSS`` sampled every millisecond by a
thread: the larger of the two), with ``MALLOC_MMAP_THRESHOLD_=65536`` in the workers'
environment so freed tensors leave the resident set. Every rollout's weights are checked
against the trainers' after every update (a digest of every tensor's bytes).

python benchmarks/sync_streaming.py --out benchmarks/results/sync_streaming.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import threading
import time
import traceback

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


# ----------------------------------------------------------------------------- verl part
VERL_TRAINERS = 2
VERL_ROLLOUTS = 2
VERL_UPDATES = 3  # per session: the first version, then two later ones (same weights)
BACKEND = "slipstream"
MODULE = "slipstream.integrations.verl"


def _llama(args: argparse.Namespace, seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=args.verl_vocab,
        hidden_size=args.verl_hidden,
        intermediate_size=3 * args.verl_hidden,
        num_hidden_layers=args.verl_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _engine(bucket: int, **kwargs):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)  # what verl does with custom_backend_module
    return CheckpointEngineRegistry.new(BACKEND, bucket_size=bucket, **kwargs)


def _digest(items) -> str:
    h = hashlib.sha256()
    for name, t in sorted(items):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Sampler:
    """The largest ``VmRSS`` seen by a thread sampling it every millisecond."""

    def __init__(self) -> None:
        self.peak = status_bytes("VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, status_bytes("VmRSS"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return max(self.peak, status_bytes("VmRSS"))


class _VerlTrainer:
    """One FSDP2 trainer rank, as verl's FSDP actor holds it."""

    def __init__(self, rank: int, port: int, args: argparse.Namespace) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=VERL_TRAINERS
        )
        self.rank = rank
        self.args = args
        mesh = init_device_mesh("cpu", (VERL_TRAINERS,))
        self.model = _llama(args, seed=0)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.engine = None

    def new_engine(self) -> None:
        kwargs = {"mode": "direct", "host": "127.0.0.1", "timeout": 600.0}
        bucket = self.args.bucket_mib * MiB
        self.engine = _engine(bucket, is_master=self.rank == 0, **kwargs)

    def get_per_tensor_param(self, live: Live):
        """verl's FSDP engine's ``get_per_tensor_param`` (FSDP2, no LoRA, on CPU): its
        generator expression over ``state_dict()`` (``unfuse_moe_params`` leaves a Llama's
        as it is; importing verl's engine module needs peft, which this setup lacks), each
        tensor counted by ``live``."""
        from torch.distributed.tensor import DTensor

        params = self.model.state_dict()
        per_tensor_param = (
            (name, param.to("cpu").full_tensor() if isinstance(param, DTensor) else param)
            for name, param in params.items()
        )
        return ((name, live.track(t)) for name, t in per_tensor_param)

    def send(self, global_steps) -> dict:
        assert self.engine is not None
        engine = self.engine
        return self._measured(lambda w: asyncio.run(engine.send_weights(w, global_steps)))

    def walk(self) -> dict:
        """The baseline: verl's generator read to its end, each tensor dropped at once (what
        its gathers cost with nothing sent)."""

        def drop(weights) -> dict:
            for _ in weights:
                pass
            return {}

        return self._measured(drop)

    def _measured(self, consume) -> dict:
        """``consume(weights)`` timed, with the yielded tensors alive at once and the
        resident high-water mark's rise during it."""
        live = Live()
        weights = self.get_per_tensor_param(live)
        reset_high_water()
        before = status_bytes("VmRSS")
        sampler = _Sampler()
        start = time.perf_counter()
        metrics = consume(weights)
        seconds = time.perf_counter() - start
        sampled = sampler.stop()
        hwm = status_bytes("VmHWM")
        return {
            "seconds": seconds,
            "hwm_rise": (hwm - before) / MiB,
            "sampled_rise": (sampled - before) / MiB,
            "live_peak": live.peak / MiB,
            "version": metrics.get("slipstream/version"),
        }

    def reference(self) -> dict:
        items = list(self.get_per_tensor_param(Live()))
        return {"digest": _digest(items), "bytes": sum(t.nbytes for _, t in items)}


class _VerlRollout:
    """One rollout worker: its engine and the model the server adapter loads into."""

    def __init__(self, rank: int, port: int, args: argparse.Namespace) -> None:
        self.args = args
        self.model = _llama(args, seed=1)  # other weights than the trainers'
        self.engine = None

    def new_engine(self) -> None:
        kwargs = {"mode": "direct", "host": "127.0.0.1", "timeout": 600.0, "full": True}
        self.engine = _engine(self.args.bucket_mib * MiB, **kwargs)

    def receive(self, global_steps) -> dict:
        assert self.engine is not None
        params = dict(self.model.named_parameters(remove_duplicate=False))

        async def consume() -> None:
            async for name, tensor in self.engine.receive_weights(global_steps):
                with torch.no_grad():
                    params[name].copy_(tensor)

        asyncio.run(consume())
        return {"version": self.engine.version}

    def reference(self) -> dict:
        return {"digest": _digest(self.model.state_dict().items())}


def _verl_serve(role: str, rank: int, conn, port: int, args: argparse.Namespace) -> None:
    """A worker process: build the trainer or rollout, then run the driver's calls."""
    try:
        torch.set_num_threads(1)
        import verl.checkpoint_engine  # noqa: F401

        import slipstream.integrations.verl  # noqa: F401

        worker = (_VerlTrainer if role == "trainer" else _VerlRollout)(rank, port, args)
        conn.send(("ok", None))
        while True:
            method, call_args = conn.recv()
            if method == "exit":
                break
            try:
                target = worker if hasattr(worker, method) else worker.engine
                conn.send(("ok", getattr(target, method)(*call_args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()


class _VerlCluster:
    """The worker processes and the driver's ends of their pipes; every reply is awaited
    with a timeout naming the worker that did not answer."""

    def __init__(self, args: argparse.Namespace) -> None:
        ctx = mp.get_context("spawn")
        self.trainers = [f"trainer{i}" for i in range(VERL_TRAINERS)]
        self.rollouts = [f"rollout{i}" for i in range(VERL_ROLLOUTS)]
        self.conns, self.procs = {}, []
        port = _free_port()
        env = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the workers': freed tensors leave RSS
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for name in self.trainers + self.rollouts:
                here, there = ctx.Pipe()
                role = "trainer" if name.startswith("trainer") else "rollout"
                proc = ctx.Process(
                    target=_verl_serve, args=(role, int(name[-1]), there, port, args)
                )
                proc.start()
                self.conns[name], self.procs = here, [*self.procs, proc]
        finally:
            if env is None:
                del os.environ["MALLOC_MMAP_THRESHOLD_"]
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = env
        self.gather(list(self.conns), 600)

    def call(self, calls: dict[str, tuple[str, tuple]], timeout: float = 600) -> dict:
        for name, call in calls.items():
            self.conns[name].send(call)
        return self.gather(list(calls), timeout)

    def gather(self, names: list[str], timeout: float) -> dict:
        out = {}
        deadline = time.monotonic() + timeout
        for name in names:
            while not self.conns[name].poll(0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not answer within {timeout} s")
            status, value = self.conns[name].recv()
            if status != "ok":
                raise RuntimeError(f"{name} failed:\n{value}")
            out[name] = value
        return out

    def update(self, global_steps) -> dict:
        """One ``CheckpointEngineManager.update_weights``, as verl's manager runs it."""
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        workers = self.trainers + self.rollouts
        import_external_libs(MODULE)
        cls = CheckpointEngineRegistry.get(BACKEND)
        prepared = self.call({w: ("prepare", ()) for w in workers})
        actor, rollout = cls.build_topology(
            len(self.trainers), len(self.rollouts), [prepared[w] for w in workers]
        )
        calls = {
            w: ("init_process_group", (actor["topology"][i],)) for i, w in enumerate(self.trainers)
        }
        calls.update(
            {
                w: ("init_process_group", (rollout["topology"][i],))
                for i, w in enumerate(self.rollouts)
            }
        )
        self.call(calls)
        calls = {w: ("send", (global_steps,)) for w in self.trainers}
        calls.update({w: ("receive", (global_steps,)) for w in self.rollouts})
        results = self.call(calls)
        self.call({w: ("finalize", ()) for w in workers})
        return results

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(("exit", ()))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _free_port() -> int:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_verl(args: argparse.Namespace) -> dict:
    """The verl part: sessions of three updates of the same weights on new engines."""
    cluster = _VerlCluster(args)
    try:
        workers = cluster.trainers + cluster.rollouts
        reference = cluster.call({t: ("reference", ()) for t in cluster.trainers})
        digests = {r["digest"] for r in reference.values()}
        assert len(digests) == 1, "the trainers gather different weights"
        sessions = []
        for _ in range(args.verl_repeats):
            walked = cluster.call({t: ("walk", ()) for t in cluster.trainers})
            cluster.call({w: ("new_engine", ()) for w in workers})
            updates = [{"trainers": [walked[t] for t in cluster.trainers], "exact": True}]
            for u in range(VERL_UPDATES):
                got = cluster.update(global_steps=u)
                held = cluster.call({r: ("reference", ()) for r in cluster.rollouts})
                updates.append(
                    {
                        "trainers": [got[t] for t in cluster.trainers],
                        "exact": all(h["digest"] in digests for h in held.values()),
                        "versions": sorted({got[r]["version"] for r in cluster.rollouts}),
                    }
                )  # updates[0] is the baseline walk, updates[1 + u] update u
            cluster.call({w: ("close", ()) for w in workers})
            sessions.append(updates)
        return {"sessions": sessions, "model_bytes": next(iter(reference.values()))["bytes"]}
    finally:
        cluster.close()


def verl_report(result: Result, args: argparse.Namespace, got: dict) -> None:
    sessions, model = got["sessions"], got["model_bytes"]
    bucket = args.bucket_mib * MiB
    bound = (4 * bucket + model / 10) / MiB

    def rise(t: dict) -> float:
        return max(t["hwm_rise"], t["sampled_rise"])

    rows = []
    for u in range(VERL_UPDATES + 1):
        ts = [s[u]["trainers"] for s in sessions]
        rows.append(
            [
                "verl's generator alone" if u == 0 else "first" if u == 1 else f"later ({u - 1})",
                round(median([t[0]["seconds"] for t in ts]), 3),
                round(max(t[0]["live_peak"] for t in ts), 1),
                round(max(t[1]["live_peak"] for t in ts), 1),
                round(max(rise(t[0]) for t in ts), 1),
                round(max(rise(t[1]) for t in ts), 1),
                all(s[u]["exact"] for s in sessions),
            ]
        )
    result.tables.append(
        Table(
            f"verl call sequence, 2 FSDP2 trainers -> 2 rollouts, {model / MiB:.0f} MiB fp32 "
            f"(tied Llama, {args.verl_layers} layers), bucket {args.bucket_mib} MiB, "
            f"{args.verl_repeats} sessions of three updates of the same weights, each after "
            "verl's generator read alone (the baseline): time = trainer 0's send_weights "
            "(median); live = yielded tensors alive at once; RSS rise "
            "= resident high-water mark during send_weights over the size before (VmHWM after "
            "clear_refs, or 1 ms VmRSS samples: the larger), worst session, MiB",
            [
                "update",
                "send_weights s",
                "live MiB t0",
                "live MiB t1",
                "RSS rise MiB t0",
                "RSS rise MiB t1",
                "rollouts exact",
            ],
            rows,
        )
    )
    first = max(rise(t) for s in sessions for t in s[1]["trainers"])
    later = max(rise(t) for s in sessions for u in s[2:] for t in u["trainers"])
    result.floor(
        f"verl: trainer RSS rise during the FIRST update's send_weights, MiB (worst trainer and "
        f"session; bound = 4 buckets + 10% of the model = {bound:.1f})",
        first,
        f"<= {bound:.1f}",
        first <= bound,
    )
    result.floor(
        "verl: trainer RSS rise during a later update's send_weights, MiB (worst)",
        later,
        f"<= {bound:.1f}",
        later <= bound,
    )
    # what the engine adds: each update's rise over the same trainer's generator alone
    over = [
        max(rise(t) - rise(w) for t, w in zip(u["trainers"], s[0]["trainers"], strict=True))
        for s in sessions
        for u in s[1:]
    ]
    first_over = max(over[0::VERL_UPDATES])
    result.floor(
        "verl: trainer RSS rise during the first update's send_weights over the rise of "
        "verl's generator read alone in the same session, MiB (worst trainer and session: "
        "what the engine adds to the gathers)",
        first_over,
        f"<= {4 * bucket / MiB:.0f} (4 buckets)",
        first_over <= 4 * bucket / MiB,
    )
    ratios = [
        s[1]["trainers"][0]["seconds"] / median([u["trainers"][0]["seconds"] for u in s[2:]])
        for s in sessions
    ]
    ratio = median(ratios)
    result.floor(
        "verl: first update's send_weights time / a later update's of the same weights (median "
        "over sessions of the first over the median of that session's later ones)",
        ratio,
        "<= 1.1",
        ratio <= 1.1,
    )
    exact = all(u["exact"] and u["versions"] == [i] for s in sessions for i, u in enumerate(s[1:]))
    walked = max(rise(t) for s in sessions for t in s[0]["trainers"])
    result.notes.append(
        f"verl's generator alone (read to its end, each tensor dropped at once, nothing sent) "
        f"raised a trainer's resident high-water mark by up to {walked:.0f} MiB: what its "
        "gathers (FSDP2 full_tensor over gloo) cost by themselves, against which the "
        "updates' rise is to be read. Its largest tensors, the tied embedding and lm_head, "
        f"are {args.verl_vocab * args.verl_hidden * 4 / MiB:.0f} MiB each."
    )
    result.floor(
        "verl: every rollout holds the trainers' weights after every update", 1.0, "== 1", exact
    )
    result.setup["verl"] = {
        "model_bytes": model,
        "trainers": VERL_TRAINERS,
        "rollouts": VERL_ROLLOUTS,
        "sessions": args.verl_repeats,
        "first_over_later_per_session": [round(r, 3) for r in ratios],
        "rise_over_generator_alone_mib_per_session_update": [round(x, 1) for x in over],
        "raw": [
            [
                [
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}
                    for t in u["trainers"]
                ]
                for u in s
            ]
            for s in sessions
        ],
        "worker_env": "MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1, 1 torch thread",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=384)
    parser.add_argument("--tensors", type=int, default=768)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="128 MiB in 256 tensors, 3 repeats")
    parser.add_argument("--out", default="benchmarks/results/sync_streaming.json")
    parser.add_argument("--verl-layers", type=int, default=12)
    parser.add_argument("--verl-hidden", type=int, default=512)
    parser.add_argument("--verl-vocab", type=int, default=40000)
    parser.add_argument("--verl-repeats", type=int, default=3)
    parser.add_argument("--no-verl", action="store_true", help="skip the verl part")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.tensors, args.repeats, args.bucket_mib = 128, 256, 3, 8
        args.verl_layers, args.verl_vocab, args.verl_repeats = 4, 16000, 2

    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    load_before = os.getloadavg()[0]
    # the workers' allocator hands freed tensors back to the kernel at once (no dynamic
    # mmap threshold keeping them in the heap): their resident size counts live memory
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
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
            "processes": "2 (1 trainer, 1 rollout), 1 torch thread each, "
            "MALLOC_MMAP_THRESHOLD_=65536",
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
    if not args.no_verl:
        verl_report(result, args, run_verl(args))
    for floor in result.floors:
        print(f"{'PASS' if floor.passed else 'MISS'} {floor.claim}: {floor.measured}")
    for row in rows:
        print(row)
    result.write(args.out)


if __name__ == "__main__":
    main()
