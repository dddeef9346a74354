"""The demo end to end on a toy model: kill, resume bit for bit, rollout generations match."""

import json
import subprocess
import sys

from trace_format import check_trace_event_format


def test_demo_resumes_bit_for_bit_after_sigkill(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "slipstream.demo", "--tiny", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=480,  # a hang guard, sized for a loaded machine (make check-busy)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SIGKILL at step 7" in done.stdout
    assert "resumed from committed step" in done.stdout
    assert "matches the uninterrupted reference bit for bit: OK" in done.stdout
    assert "rollout generations match the trainers' for versions [13, 15, 17]: OK" in done.stdout

    trace = json.loads((tmp_path / "demo" / "trace.json").read_text())
    events = check_trace_event_format(trace)
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert processes == {"trainer rank 0", "trainer rank 1", "rollout"}
    names = {e["name"] for e in events}
    expected = {
        "train.forward",
        "slipstream.fsdp.all_gather",
        "slipstream.fsdp.reduce_scatter",
        "slipstream.save.stage",
        "slipstream.save.commit",
        "train.publish_call",
        "slipstream.sync.receive",
    }
    assert expected <= names, sorted(expected - names)
    assert any(n.startswith("all-gather of unit") for n in names)  # the async track
    assert any(n.startswith("publish version") for n in names)
    png = (tmp_path / "demo" / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
