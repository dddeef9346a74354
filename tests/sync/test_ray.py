"""Weight sync between Ray actors on a local cluster: a rollout actor killed and restarted by
Ray (``max_restarts``) rejoins the group at its old rank and ends exactly at the trainer's
weights, while the trainer and the other rollout go on without being rebuilt."""

import json
import subprocess
import sys
from pathlib import Path

from ray_env import ray_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_weight_sync.py"


def test_a_restarted_rollout_actor_rejoins_and_holds_the_latest_version_exactly():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "5", "--kill-after", "2"],
        capture_output=True,
        text=True,
        env=ray_env(),
        timeout=480,  # a hang guard, sized for a loaded machine (make check-busy)
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    kills = [e for e in summary["events"] if "killed" in e]
    assert len(kills) == 1 and kills[0]["killed"] == 2
    assert kills[0]["new_pid"] != kills[0]["old_pid"]
    steps = [e for e in summary["events"] if "step" in e]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5]
    for event in steps:
        # every rollout, the restarted one included, holds the version just published
        assert event["received"] == {"1": event["step"], "2": event["step"]}, event
    assert summary["exact"] == {"1": True, "2": True}
