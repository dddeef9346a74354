"""A save larger than its staging budget streams through it (issue 56): a 2 GiB save with
``staging_budget_bytes`` = 256 MiB against the same save unbudgeted, side by side in one run.

Each repetition, for each peer: a fresh saver saves the state twice to the local disk (the
first save allocates the staging memory, the second reuses it, as every later save of a
training run does). Measured: the peak resident memory the saves add over the process's
size before them (``VmHWM``, reset to the resident size before the first save, so it is
the exact high-water mark, not a sample), the pool's own peak, and the second save's
times. The state holds tensors larger than a part (192 MiB against 64 MiB parts) and many
smaller ones; both checkpoints are read back by ``ss.load`` and compared with the state.

    python benchmarks/staging_budget.py --out benchmarks/results/staging_budget.json
    python benchmarks/staging_budget.py --quick --out /tmp/staging_budget_quick.json
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from common import Result, Table, median, reset_high_water, scratch, status_bytes

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.save.part_ring import part_bytes

MiB = 1 << 20


def _state(total: int) -> dict[str, torch.Tensor]:
    """``total`` bytes of float32: three quarters in tensors of 192 MiB (split across
    parts), the rest in tensors of 1 MiB."""
    g = torch.Generator().manual_seed(0)
    big, small = 192 * MiB, 1 * MiB
    n_big = max(1, total * 3 // 4 // big)
    n_small = max(1, (total - n_big * big) // small)
    state = {f"big.{i}": torch.randn(big // 4, generator=g) for i in range(n_big)}
    state.update({f"small.{i}": torch.randn(small // 4, generator=g) for i in range(n_small)})
    return state


def _exact(path: Path, state: dict[str, torch.Tensor]) -> bool:
    got = {k: torch.empty_like(v) for k, v in state.items()}
    ss.load(got, str(path))
    return all(torch.equal(got[k], v) for k, v in state.items())


def _run(peer: str, budget: int | None, state: dict, root: Path, rep: int) -> dict[str, float]:
    reset_high_water()
    before = status_bytes("VmRSS")
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=budget))
    try:
        first = saver.save(state, str(root / f"{peer}-{rep}-a"))
        first.upload_completion.result(600)
        response = saver.save(state, str(root / f"{peer}-{rep}-b"))
        response.upload_completion.result(600)
        rise = status_bytes("VmHWM") - before
        pool_peak = saver.staging_peak_bytes
    finally:
        saver.close()
    t = response.timings
    assert t.blocked is not None and t.staged is not None and t.durable is not None
    return {
        "rise_mib": rise / MiB,
        "pool_peak_mib": pool_peak / MiB,
        "blocked_s": t.blocked,
        "staged_s": t.staged,
        "durable_s": t.durable,
        "first_durable_s": first.timings.durable or 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gib", type=float, default=2.0, help="size of the save")
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/slipstream-bench/staging_budget")
    p.add_argument("--quick", action="store_true", help="a 512 MiB save, one repetition")
    opts = p.parse_args()
    if opts.quick:
        opts.gib, opts.repeats = 0.5, 1
    budget = opts.budget_mib * MiB
    part = part_bytes(budget)
    result = Result(
        "staging_budget",
        f"a {opts.gib:g} GiB save streamed through a {opts.budget_mib} MiB staging budget "
        "vs the same save unbudgeted",
    )
    result.note_load("start")
    state = _state(int(opts.gib * 2**30))
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    result.setup.update(
        {
            "save": f"{nbytes / 2**30:.2f} GiB in {len(state)} float32 tensors "
            f"({sum(1 for k in state if k.startswith('big'))} of 192 MiB, the rest 1 MiB)",
            "staging_budget_bytes": f"{opts.budget_mib} MiB, parts of {part // MiB} MiB",
            "storage": f"local disk ({opts.workdir}, O_DIRECT), io_threads 4",
            "repetitions": f"{opts.repeats}, interleaved; medians",
        }
    )
    peers: dict[str, int | None] = {"unbudgeted": None, f"budget {opts.budget_mib} MiB": budget}
    kept: dict[str, dict[str, list[float]]] = {name: {} for name in peers}
    exact: dict[str, bool] = {}
    with scratch(opts.workdir) as root:
        for rep in range(opts.repeats):
            for name, peer_budget in peers.items():
                tag = "whole" if peer_budget is None else "budget"
                metrics = _run(tag, peer_budget, state, root, rep)
                for metric, value in metrics.items():
                    kept[name].setdefault(metric, []).append(value)
                if rep == 0:
                    exact[name] = _exact(root / f"{tag}-0-b", state)
                for path in root.glob(f"{tag}-{rep}-*"):
                    for f in path.iterdir():
                        os.remove(f)
                    path.rmdir()
    result.note_load("end")
    med = {name: {m: median(v) for m, v in metrics.items()} for name, metrics in kept.items()}
    columns = [
        "peer",
        "peak RSS rise MiB",
        "pool peak MiB",
        "blocked s",
        "staged s",
        "durable s",
        "first save durable s",
        "exact on load",
    ]
    rows = [
        [
            name,
            m["rise_mib"],
            m["pool_peak_mib"],
            m["blocked_s"],
            m["staged_s"],
            m["durable_s"],
            m["first_durable_s"],
            "yes" if exact[name] else "**no**",
        ]
        for name, m in med.items()
    ]
    result.tables.append(Table("Second save of a fresh saver (medians)", columns, rows))
    whole, streamed = med["unbudgeted"], med[f"budget {opts.budget_mib} MiB"]
    limit = (budget + part) * 1.1 / MiB
    result.floor(
        "peak RSS rise of the budgeted saves (MiB)",
        streamed["rise_mib"],
        f"<= {limit:.0f} (budget + one part + 10%)",
        streamed["rise_mib"] <= limit,
    )
    ratio = streamed["durable_s"] / whole["durable_s"]
    result.floor("durable time, budgeted / unbudgeted", ratio, "<= 1.3", ratio <= 1.3)
    result.floor(
        "both checkpoints exact on load (1 = yes)",
        float(all(exact.values())),
        "= 1",
        all(exact.values()),
    )
    result.notes.append(
        "The budget trades memory for the time the caller must hold its state unchanged: "
        "unbudgeted, `staging_completion` resolves once the state is copied (staged s); "
        "under the budget it resolves only when the last part is staged, which waits for "
        "the writes of all the parts before the last few, so staged s is close to durable s."
    )
    for name, metrics in kept.items():
        print(name, {m: [round(x, 3) for x in v] for m, v in metrics.items()})
    result.write(opts.out)


if __name__ == "__main__":
    main()
