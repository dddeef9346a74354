import subprocess
import sys
from pathlib import Path

from ray_env import ray_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=480,  # a hang guard, sized for a loaded machine (make check-busy)
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


def test_switch_from_dcp_example_saves_resumes_and_loads_all(tmp_path):
    out = _run("switch_from_dcp.py", "--root", str(tmp_path / "run"))
    assert "saved 21 entries at step 4" in out
    assert "resumed step 4, model equal: True" in out
    assert "load_all: optimizer state keys [0, 1]" in out
    assert "optimizer restored: step 4" in out


def test_lightning_example_resumes(tmp_path):
    root = str(tmp_path / "run")
    first = _run("lightning_checkpoint.py", "--root", root, "--epochs", "2")
    files = "['epoch=0-step=8.ckpt', 'epoch=1-step=16.ckpt', 'last.ckpt']"
    assert f"trained to epoch 2; checkpoints: {files}" in first
    second = _run("lightning_checkpoint.py", "--root", root, "--epochs", "3")
    assert "resumed from last.ckpt" in second
    assert "trained to epoch 3" in second


def test_hf_trainer_example_resumes_and_exports(tmp_path):
    out = _run("hf_trainer.py", "--out", str(tmp_path / "run"))
    assert "interrupted; last checkpoint: checkpoint-3" in out
    assert "resumed and trained to step 6" in out
    assert "from_pretrained(checkpoint-6) equals the trained model: True" in out


def test_accelerate_example_restores(tmp_path):
    out = _run("accelerate_state.py", "--out", str(tmp_path / "state"))
    assert "restored after 5 batches" in out
    assert "training after the restore matches: True" in out


def test_torchtitan_config_switches_its_checkpointer_to_slipstream():
    out = _run("torchtitan_slipstream.py")
    assert "torchtitan checkpoints through slipstream.dcp: True" in out
    assert "checkpoint: enable=True async_mode=async interval=10" in out


def test_verl_backend_example_syncs_ray_actors_and_a_restarted_rollout_rejoins():
    import json

    out = _run("verl_backend.py", "--updates", "4", "--kill-after", "2", env=ray_env())
    summary = json.loads(out.strip().splitlines()[-1])
    updates = [e for e in summary["events"] if "channel" in e]
    assert [e["versions"] for e in updates] == [[u, u] for u in range(4)]
    # the restarted rollout's new engine took its old rank: same channel, rejoined in place
    assert all(e["ranks"] == [1, 2] and e["channel"] == "verl-0" for e in updates)
    kills = [e for e in summary["events"] if "killed" in e]
    assert len(kills) == 1 and kills[0]["new_pid"] != kills[0]["old_pid"]
    assert summary["exact"] == [True, True]
