"""The device check (benchmarks/gpu_check.sh) dry-runs on CPU: every step runs with tiny
sizes and writes its results into the one folder it is given, so a GPU session only has to
run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["Saves", "Warm loads", "Training loop", "FSDP at world size 1", "Colocated weight"]


@pytest.mark.timeout(400)  # seconds on an idle host; a loaded one spawns processes slowly
def test_the_device_check_dry_runs_on_cpu_into_one_folder(tmp_path):
    out = tmp_path / "check"
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    logs = {p.name: p.read_text()[-3000:] for p in out.glob("*.log")}
    assert proc.returncode == 0, (proc.stdout, proc.stderr, logs)
    summary = (out / "summary.txt").read_text()
    assert "cuda tests: exit 0" in summary and "gpu.py: exit 0" in summary, summary
    assert "memory limit: exit 0" in summary, summary
    memory = json.loads((out / "memory_limit.json").read_text())
    assert memory["snapshot_allocations"] == memory["steps"] > 0  # one per save, given back
    assert not any(memory["snapshot_bytes_between_saves"]), memory
    assert (out / "cuda_tests.xml").read_text().count("<testcase") >= 2  # collected, skipped
    result = json.loads((out / "gpu.json").read_text())
    titles = [t["title"] for t in result["tables"]]
    for section in SECTIONS:
        assert any(t.startswith(section) for t in titles), (section, titles)
    loop = next(t for t in result["tables"] if t["title"].startswith("Training loop"))
    assert {row[0] for row in loop["rows"]} == {1, 2}  # a checkpoint every step, every 2
    sync = next(t for t in result["tables"] if t["title"].startswith("Colocated weight"))
    assert {row[0] for row in sync["rows"]} == {"one device copy", "direct (ipc)", "cached (ipc)"}
    trace = json.loads((out / "train_loop_trace.json").read_text())
    assert any("slipstream" in e.get("name", "") for e in trace["traceEvents"])
