"""The documented trainer + rollout example runs and the rollout ends with the trainer's weights."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "weight_sync.py"


def test_weight_sync_example_rollout_ends_with_the_trainers_weights():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "4", "--every", "2"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "rollout: now at version 2" in out and "rollout: now at version 4" in out
    # the refetch serves whatever the cache holds then: version 2, or 4 if already snapshotted
    assert re.search(r"rollout: refetched version [24] from the trainer's cache", out), out
    sums = re.findall(r"checksum (-?[0-9.]+)", out)
    assert len(sums) == 2 and sums[0] == sums[1], out
    assert "rollouts hold {1: 4}" in out
