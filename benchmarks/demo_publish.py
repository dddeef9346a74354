"""The demo's RL phase as a user sees it: what it prints per publish ("blocked", "every
rollout held it ... after the publish"), this tree against an earlier revision, in one run.

    python benchmarks/demo_publish.py --baseline ab3776b --out benchmarks/results/demo_publish.json

The baseline's source is checked out into a temporary git worktree and put first on
``PYTHONPATH``, so both run with this venv's packages; the runs alternate (baseline, this
tree, baseline, ...) so a busy host weighs on both alike. Each run is the whole demo
(``python -m slipstream.demo``), its RL phase publishing every ``--publish-every`` steps;
the figures are the medians over every publish of every run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Result, Table, fmt, median

ROOT = Path(__file__).resolve().parent.parent
PRINTED = re.compile(r"blocked (\d+) ms, every rollout held it (\d+) ms after the publish")
RUN_TIMEOUT_S = 1200


def _demo(src: Path, out: Path, args: argparse.Namespace) -> list[tuple[float, float]]:
    """One demo run from the source tree ``src``: (blocked, delivered) seconds per publish."""
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [
        sys.executable,
        "-m",
        "slipstream.demo",
        "--out",
        str(out),
        "--rl-steps",
        str(args.rl_steps),
        "--publish-every",
        str(args.publish_every),
    ]
    done = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    if done.returncode:
        raise RuntimeError(f"the demo from {src} exited {done.returncode}:\n{done.stderr[-3000:]}")
    found = [(int(b) / 1e3, int(d) / 1e3) for b, d in PRINTED.findall(done.stdout)]
    if not found:
        raise RuntimeError(f"the demo from {src} printed no publish:\n{done.stdout[-3000:]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare with")
    parser.add_argument("--runs", type=int, default=2, help="demo runs of each")
    parser.add_argument("--rl-steps", type=int, default=24)
    parser.add_argument("--publish-every", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    result = Result(
        "demo_publish",
        f"The demo's printed publish times: this tree vs {rev}",
        setup={"baseline": rev, "runs of each": args.runs, "rl steps": args.rl_steps},
    )
    result.note_load("start")
    printed: dict[str, list[tuple[float, float]]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory(prefix="slipstream-demo-") as tmp:
        worktree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), rev],
            check=True,
        )
        try:
            for _ in range(args.runs):
                printed["baseline"] += _demo(worktree / "src", Path(tmp) / "out", args)
                printed["this tree"] += _demo(ROOT / "src", Path(tmp) / "out", args)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                check=False,
            )
    result.note_load("end")
    table = Table("median s over every publish", ["tree", "publishes", "blocked", "delivered"])
    med = {}
    for tree, values in printed.items():
        med[tree] = {
            m: median([v[i] for v in values]) for i, m in enumerate(("blocked", "delivered"))
        }
        table.rows.append(
            [tree, len(values), fmt(med[tree]["blocked"]), fmt(med[tree]["delivered"])]
        )
    result.tables.append(table)
    for metric, floor in (("blocked", 0.3), ("delivered", 0.5)):
        ratio = med["this tree"][metric] / med["baseline"][metric]
        result.floor(f"{metric}: this tree / {rev}", ratio, f"<= {floor}", ratio <= floor)
    result.write(args.out)


if __name__ == "__main__":
    main()
