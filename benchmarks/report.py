"""Render benchmark result files (see ``common.py`` for the schema) into BENCHMARKS.md.

python benchmarks/report.py bench_out/checkpoint.json bench_out/sync.json --out BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HEADER = """# Benchmarks

Every number here was printed by the command shown above its table, on the machine described
there, with slipstream and the peers run side by side in one invocation (interleaved, medians
of the repetitions after a warm-up). Regenerate everything with `make bench`. These machines
are shared and noisy: read the ratios, not the absolute times.
"""


def _cell(value) -> str:
    if isinstance(value, float):
        from common import fmt

        return fmt(value)
    return str(value)


def _table(title: str, columns: list[str], rows: list[list]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + "|".join(" --- " for _ in columns) + "|")
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_one(result: dict) -> str:
    m = result["machine"]
    out = [f"## {result['benchmark']}: {result['title']}", ""]
    out.append(f"Command: `{result['command']}`  ")
    out.append(
        f"Date: {result['date']}; machine: {m.get('cores')} cores, {m.get('memory_gib')} GiB, "
        f"{m.get('device')}, torch {m.get('torch')}, Python {m.get('python')}"
    )
    if result.get("setup"):
        out.append("")
        out.append("Setup: " + "; ".join(f"{k} = {v}" for k, v in result["setup"].items()))
    out.append("")
    if result.get("floors"):
        rows = [
            [f["claim"], _cell(f["measured"]), f["floor"], "yes" if f["passed"] else "**no**"]
            for f in result["floors"]
        ]
        out.append(_table("Targets this run checks", ["claim", "measured", "floor", "met"], rows))
    for table in result.get("tables", []):
        out.append(_table(table["title"], table["columns"], table["rows"]))
    for note in result.get("notes", []):
        out.append(note + "\n")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", help="JSON result files")
    parser.add_argument("--out", default="BENCHMARKS.md")
    args = parser.parse_args()
    sections = [HEADER]
    for path in args.results:
        if not Path(path).is_file():
            sections.append(f"## {Path(path).stem}\n\nNo result file at `{path}`.\n")
            continue
        sections.append(render_one(json.loads(Path(path).read_text())))
    Path(args.out).write_text("\n".join(sections))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
