"""Train near the device's memory limit with a checkpoint every step: it must not run out
of memory (issue 47).

The device snapshot gives its buffer back to the caching allocator once each save's drain
ends (``SaveOptions.keep_device_snapshot=False``, the default), so the memory a save takes
is free again for the next step's activations. This run sizes a ballast so that, between
steps, only the step's activation peak plus half the saved state's size is free: a
snapshot kept between saves would leave less than the peak and the next step would run out
of memory. Every step checks that the saver holds no snapshot memory between saves.

    python benchmarks/memory_limit.py --out /tmp/memory_limit.json   # on a CUDA device
    python benchmarks/memory_limit.py --dry-run --out /tmp/m.json     # CPU, tiny sizes

On CPU (``--dry-run``) the device path runs with host memory as the device
(``device_snapshot=True``) and there is no ballast: the check is the saver's own accounting.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from slipstream.checkpoint import CheckpointSaver, SaveOptions


def _model(hidden: int, layers: int, device: torch.device) -> torch.nn.Module:
    return torch.nn.Sequential(
        *[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]
    ).to(device)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(batch).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def run(opts: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and not opts.dry_run
    if not cuda and not opts.dry_run:
        raise SystemExit("benchmarks/memory_limit.py needs a CUDA device (or --dry-run on CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    hidden, layers, batch_rows = (4096, 8, 32768) if cuda else (64, 2, 32)
    model = _model(hidden, layers, device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    batch = torch.randn(batch_rows, hidden, device=device)
    _step(model, optim, batch)  # the optimizer's state exists from here
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = 3 * param_bytes  # the weights, and AdamW's two moments
    ballast = None
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, optim, batch)
        peak = torch.cuda.max_memory_allocated() - base
        free, _ = torch.cuda.mem_get_info()
        headroom = peak + state_bytes // 2  # a kept snapshot (state_bytes) would not fit
        ballast = torch.empty(max(free - headroom, 0), dtype=torch.uint8, device=device)
    options = SaveOptions(device_snapshot=None if cuda else True)
    saver = CheckpointSaver(options=options)
    held_between_saves = []
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for _ in range(opts.steps):
                _step(model, optim, batch)
                saver.save(_state(model, optim), Path(workdir) / "ck").result(opts.timeout)
                held_between_saves.append(saver.snapshot_bytes)
    finally:
        saver.close()
    seconds = time.perf_counter() - started
    if any(held_between_saves):
        raise SystemExit(f"the device snapshot held memory between saves: {held_between_saves}")
    if saver.snapshot_allocations == 0:
        raise SystemExit("no save went through the device snapshot: the check checked nothing")
    del ballast
    return {
        "device": str(device) + (" (dry run)" if opts.dry_run else ""),
        "steps": opts.steps,
        "state_bytes": state_bytes,
        "step_peak_bytes": peak,
        "snapshot_bytes_between_saves": held_between_saves,
        "snapshot_allocations": saver.snapshot_allocations,
        "seconds": round(seconds, 3),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    result = run(opts)
    opts.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
