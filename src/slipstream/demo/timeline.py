"""The demo's timeline picture: a few training steps of one trainer, from the trace file,
with the checkpoint save, the weight publish and the FSDP collectives laid over compute.

Rows, top to bottom: the training thread (forward, backward, optimizer, and the trainer's
generation after a publish; where it waited on slipstream, in a darker colour), FSDP's
all-gathers and reduce-scatters from issue to completion, the saver's staging thread, its
upload thread (write and commit), the publish from the call until every rollout held the
version, and the rollout's receive.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

ROWS = [
    "training thread",
    "all-gathers in flight",
    "reduce-scatters in flight",
    "save: staging copy",
    "save: write + commit",
    "publish until delivered",
    "rollout: receive",
]
COLOURS = {
    "train.forward": "#9ecae1",
    "train.backward": "#a1d99b",
    "train.optimizer": "#dadaeb",
    "train.generate": "#fee391",
    "slipstream.fsdp.all_gather.wait": "#de2d26",
    "slipstream.fsdp.reduce_scatter.wait": "#fb6a4a",
    "train.save_call": "#e6550d",
    "train.wait_staging": "#a63603",
    "train.publish_call": "#756bb1",
    "all-gather": "#fd8d3c",
    "reduce-scatter": "#fdae6b",
    "slipstream.save.stage": "#31a354",
    "slipstream.save.write": "#3182bd",
    "slipstream.save.commit": "#08519c",
    "publish": "#756bb1",
    "slipstream.sync.receive": "#54278f",
}
TRAINING_SPANS = {
    "train.forward",
    "train.backward",
    "train.optimizer",
    "train.generate",
    "slipstream.fsdp.all_gather.wait",
    "slipstream.fsdp.reduce_scatter.wait",
    "train.save_call",
    "train.wait_staging",
    "train.publish_call",
}


def _row_and_colour(event: dict[str, Any], thread: str, process: str) -> tuple[str, str] | None:
    name = event["name"]
    if process == "rollout":
        return ("rollout: receive", name) if name == "slipstream.sync.receive" else None
    if thread == "MainThread":
        return ("training thread", name) if name in TRAINING_SPANS else None
    if thread.startswith("fsdp all-gather"):
        return "all-gathers in flight", "all-gather"
    if thread.startswith("fsdp reduce-scatter"):
        return "reduce-scatters in flight", "reduce-scatter"
    if thread.startswith("slipstream-stage") and name == "slipstream.save.stage":
        return "save: staging copy", name
    if thread.startswith("slipstream-upload") and name in (
        "slipstream.save.write",
        "slipstream.save.commit",
    ):
        return "save: write + commit", name
    if thread.startswith("weight sync"):
        return "publish until delivered", "publish"
    return None


def render(trace_path: str | Path, png_path: str | Path, trainer: str, steps: int = 3) -> Path:
    """Draw the last ``steps`` training steps of process ``trainer`` (its process name in the
    trace) that end with a publish, with the rollout's receives, into ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    pid = next(p for p, name in processes.items() if name == trainer)
    step_spans = sorted(
        (e for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"] == "train.step"),
        key=lambda e: e["ts"],
    )
    published = [i for i, e in enumerate(step_spans) if e.get("args", {}).get("publish")]
    if not published:
        raise ValueError(f"{trace_path}: no step of {trainer} published weights")
    last = published[-1]
    window = step_spans[max(0, last - steps + 1) : last + 1]
    begin = window[0]["ts"]
    end = window[-1]["ts"] + window[-1]["dur"]
    end += 0.6 * (end - begin)  # room for the save and the publish that outlive the step

    bars: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e["ph"] != "X" or e["ts"] > end or e["ts"] + e["dur"] < begin:
            continue
        process = processes.get(e["pid"], "")
        if e["pid"] != pid and process != "rollout":
            continue
        placed = _row_and_colour(e, threads.get((e["pid"], e["tid"]), ""), process)
        if placed is not None:
            row, colour = placed
            bars[row].append(((e["ts"] - begin) / 1e3, e["dur"] / 1e3, colour))

    fig, ax = plt.subplots(figsize=(14, 5.5))
    for y, row in enumerate(ROWS):
        # draw longer bars first so the waits nested in them stay visible on top
        for start, width, colour in sorted(bars[row], key=lambda b: -b[1]):
            ax.broken_barh([(start, max(width, 0.05))], (y - 0.4, 0.8), color=COLOURS[colour])
    for e in window:
        x = (e["ts"] - begin) / 1e3
        ax.axvline(x, color="grey", linestyle=":", linewidth=0.8)
        label = f"step {e['args'].get('step', '')}" + (
            " (publish)" if e["args"].get("publish") else ""
        )
        ax.text(x, len(ROWS) - 0.35, label, fontsize=8, color="grey")
    ax.set_yticks(range(len(ROWS)), ROWS)
    ax.set_ylim(len(ROWS) - 0.2, -0.6)
    last_drawn = max((start + width for row in bars.values() for start, width, _ in row), default=0)
    ax.set_xlim(0, min((end - begin) / 1e3, 1.02 * last_drawn) or (end - begin) / 1e3)
    ax.set_xlabel(f"ms ({trainer}; rollout receives on the last row)")
    ax.set_title("slipstream beside compute: checkpoint, weight publish and FSDP collectives")
    legend = [
        Patch(color=COLOURS[k], label=v)
        for k, v in [
            ("train.forward", "forward"),
            ("train.backward", "backward"),
            ("train.optimizer", "optimizer"),
            ("train.generate", "generate (eval)"),
            ("slipstream.fsdp.all_gather.wait", "waiting for an all-gather"),
            ("train.wait_staging", "waiting for staging"),
            ("train.save_call", "save call"),
            ("all-gather", "all-gather"),
            ("reduce-scatter", "reduce-scatter"),
            ("slipstream.save.stage", "staging copy"),
            ("slipstream.save.write", "write"),
            ("slipstream.save.commit", "commit"),
            ("publish", "publish"),
            ("slipstream.sync.receive", "receive"),
        ]
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=7, fontsize=8)
    fig.tight_layout()
    out = Path(png_path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
