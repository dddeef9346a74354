import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_checkpoint_loop_example_resumes(tmp_path):
    root = str(tmp_path / "run")
    first = _run("checkpoint_loop.py", "--root", root, "--steps", "4")
    assert "trained to step 3; committed steps: [2, 3]" in first
    second = _run("checkpoint_loop.py", "--root", root, "--steps", "6")
    assert "resumed from step 3" in second
    assert "trained to step 5; committed steps: [4, 5]" in second


def test_huggingface_example_round_trips(tmp_path):
    out = _run("huggingface.py", "--out", str(tmp_path / "hf"))
    assert "exported 20 tensors under prefix 'model.'" in out
    assert "tied weights written once: ['lm_head.weight']" in out
    assert "from_pretrained: missing [], unexpected []" in out
    gap = float(out.split("bf16 round trip: ")[1].split()[0])
    assert 0 < gap < 0.05


def test_verl_backend_example_syncs_ray_actors_and_a_restarted_rollout_rejoins():
    import json

    out = _run("verl_backend.py", "--updates", "4", "--kill-after", "2")
    summary = json.loads(out.strip().splitlines()[-1])
    updates = [e for e in summary["events"] if "channel" in e]
    assert [e["versions"] for e in updates] == [[u, u] for u in range(4)]
    # the restarted rollout's new engine took its old rank: same channel, rejoined in place
    assert all(e["ranks"] == [1, 2] and e["channel"] == "verl-0" for e in updates)
    kills = [e for e in summary["events"] if "killed" in e]
    assert len(kills) == 1 and kills[0]["new_pid"] != kills[0]["old_pid"]
    assert summary["exact"] == [True, True]
