"""The demo end to end on a toy model: kill, resume bit for bit, rollout generations match."""

import subprocess
import sys


def test_demo_resumes_bit_for_bit_after_sigkill(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "slipstream.demo", "--tiny", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SIGKILL at step 7" in done.stdout
    assert "resumed from committed step" in done.stdout
    assert "matches the uninterrupted reference bit for bit: OK" in done.stdout
    assert "rollout generations match the trainers' for versions [13, 15, 17]: OK" in done.stdout
