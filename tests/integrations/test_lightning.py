"""SlipstreamCheckpointIO in real Lightning runs, against Lightning's own TorchCheckpointIO
and an uninterrupted run (see lightning_scenario.py for the runs)."""

from __future__ import annotations

import dataclasses
import enum
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from omegaconf import ListConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_scenario  # noqa: E402

import slipstream as ss  # noqa: E402
from slipstream.errors import CheckpointError, UnsafeCheckpointError  # noqa: E402
from slipstream.integrations.lightning import SlipstreamCheckpointIO  # noqa: E402

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_scenario.py")


def assert_same(a, b, where="checkpoint"):
    """Equal values of equal types all the way down; tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        # Key order is not kept; key types are (optimizer state's int keys stay int).
        assert set(a) == set(b), f"{where}: keys {sorted(map(repr, a))} != {sorted(map(repr, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_scenario(results, root):
    torch_run, ss_run = results["torch"], results["slipstream"]
    # Resumed to epoch 3: exactly the uninterrupted run (weights, Adam, scheduler, loops).
    assert_same(ss_run["state"], results["uninterrupted"], "resumed vs uninterrupted")
    # The same files as Lightning's default CheckpointIO leaves, after 2 epochs and after 3.
    assert ss_run["files_after_two"] == torch_run["files_after_two"]
    assert ss_run["files"] == torch_run["files"]
    assert len(ss_run["files"]) == 3  # top 2 and last
    for key in ("best_k", "best", "last"):
        assert ss_run[key] == torch_run[key], key
    # Every checkpoint left holds what torch.save wrote for it, with the same types.
    for name in ss_run["files"]:
        trusted = [lightning_scenario.Widths, lightning_scenario.Act]
        ours = SlipstreamCheckpointIO(trusted=trusted).load_checkpoint(
            os.path.join(root, "ckpts", name)
        )
        theirs = TorchCheckpointIO().load_checkpoint(
            os.path.join(root, "torch_ckpts", name), weights_only=False
        )
        assert_same(ours, theirs, name)
    hparams = ours["hyper_parameters"]
    assert hparams["widths"] == lightning_scenario.Widths(32, 0.5)
    assert hparams["act"] is lightning_scenario.Act.TANH
    assert isinstance(hparams["layers"], ListConfig) and list(hparams["layers"]) == [16, 32]


def run_script(script: str, root: Path) -> dict:
    """Runs ``script --root root`` in a child process (where it may start processes of its
    own) and returns the results it saved with ``torch.save``."""
    out = root / "results.pt"
    done = subprocess.run(
        [sys.executable, script, "--root", str(root), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    other_ranks = [
        ln
        for ln in done.stderr.splitlines()
        if ln.startswith("[rank") and not ln.startswith("[rank0]")
    ]
    assert done.returncode == 0, "\n".join(other_ranks[-40:]) + "\n" + done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.timeout(120)
def test_single_process_resume_is_exact_and_top_k_matches_torch_io(tmp_path):
    torch.manual_seed(0)
    results = lightning_scenario.scenario(str(tmp_path))
    check_scenario(results, str(tmp_path))


@pytest.mark.timeout(240)
def test_ddp_two_processes_resume_is_exact_and_top_k_matches_torch_io(tmp_path):
    results = run_script(SCENARIO, tmp_path)
    check_scenario(results, str(tmp_path))


def _state(fill: float) -> dict:
    return {
        "state_dict": {"w": torch.full((4096, 1024), fill)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "global_step": int(fill),
    }


def test_overwrite_with_a_save_in_flight_leaves_the_newer_checkpoint(tmp_path):
    io = SlipstreamCheckpointIO(timeout=60)
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_state(1.0), path)
    io.save_checkpoint(_state(2.0), path)  # the first may still be writing
    assert path.is_dir()  # exists as soon as save_checkpoint returns
    loaded = io.load_checkpoint(path)
    assert_same(loaded, _state(2.0))
    io.teardown()
    assert_same(SlipstreamCheckpointIO().load_checkpoint(path), _state(2.0))


def test_remove_with_a_save_in_flight_removes_it_once_written(tmp_path):
    io = SlipstreamCheckpointIO(timeout=60)
    kept, removed = tmp_path / "epoch=1.ckpt", tmp_path / "epoch=0.ckpt"
    io.save_checkpoint(_state(1.0), removed)
    io.save_checkpoint(_state(2.0), kept)
    io.remove_checkpoint(removed)
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt"]
    assert_same(io.load_checkpoint(kept), _state(2.0))


def test_checkpoint_keeps_state_as_it_was_when_save_returned(tmp_path):
    io = SlipstreamCheckpointIO(timeout=60)
    state = _state(1.0)
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    state["state_dict"]["w"].fill_(5.0)  # training goes on once save_checkpoint returns
    io.teardown()
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt"), _state(1.0))


def test_map_location_and_torch_checkpoints(tmp_path):
    TorchCheckpointIO().save_checkpoint(_state(3.0), tmp_path / "old.ckpt")
    io = SlipstreamCheckpointIO()
    # A run that switches to slipstream still resumes from its torch.save checkpoints.
    assert_same(io.load_checkpoint(tmp_path / "old.ckpt"), _state(3.0))
    io.save_checkpoint(_state(4.0), tmp_path / "new.ckpt")
    loaded = io.load_checkpoint(tmp_path / "new.ckpt", map_location=torch.device("meta"))
    assert loaded["state_dict"]["w"].device.type == "meta"
    io.teardown()


def test_errors_name_the_path(tmp_path):
    io = SlipstreamCheckpointIO()
    with pytest.raises(FileNotFoundError, match="nothing.ckpt"):
        io.load_checkpoint(tmp_path / "nothing.ckpt")
    (tmp_path / "file.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="file.ckpt is a file"):
        io.save_checkpoint(_state(1.0), tmp_path / "file.ckpt")
    # A value that cannot be pickled fails the save at once, naming it.
    with pytest.raises(Exception, match="bad"):
        io.save_checkpoint({"bad": lambda: 0}, tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()  # nothing that passes for a checkpoint
    io.teardown()


class _Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class _Opts:
    color: _Color


def test_hyper_parameter_types_round_trip_once_allowed(tmp_path):
    io = SlipstreamCheckpointIO()
    hp = {"opts": _Opts(_Color.RED), "layers": ListConfig([1, 2, 3])}
    io.save_checkpoint({"hyper_parameters": hp}, tmp_path / "h.ckpt")
    io.teardown()
    # A class of the user's own is refused, by name, until it is allowed; omegaconf's
    # containers are allowed as they are.
    with pytest.raises(UnsafeCheckpointError, match="_Opts"):
        io.load_checkpoint(tmp_path / "h.ckpt")
    with ss.allow_types(_Opts, _Color):
        loaded = io.load_checkpoint(tmp_path / "h.ckpt")["hyper_parameters"]
    assert loaded["opts"] == _Opts(_Color.RED) and loaded["opts"].color is _Color.RED
    assert isinstance(loaded["layers"], ListConfig) and list(loaded["layers"]) == [1, 2, 3]


@pytest.mark.timeout(240)
def test_model_parallel_strategy_checkpoints_through_slipstream_dcp(tmp_path):
    # Lightning's FSDPStrategy refuses a CPU accelerator; ModelParallelStrategy (FSDP2)
    # runs on CPU and calls DCP the same way, by name.
    script = os.path.join(os.path.dirname(SCENARIO), "lightning_model_parallel.py")
    results = run_script(script, tmp_path)
    # slipstream wrote the sharded checkpoint (its index beside DCP's metadata; last.ckpt
    # was saved over, so in a later generation), one data file per rank, and Lightning
    # wrote its own meta.pt.
    files = results["last_files"]
    assert any(f.startswith(".slipstream") and f.endswith(".json") for f in files), files
    assert {".metadata", "meta.pt"} <= set(files)
    assert len([f for f in files if f.endswith(".distcp")]) == 2, files
    assert_same(results["resumed"], results["uninterrupted"], "resumed vs uninterrupted")


@pytest.mark.timeout(120)
def test_save_last_link_points_at_the_checkpoint_just_saved_and_resumes(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(epochs, ckpt_path=None):
        trainer = Trainer(
            accelerator="cpu",
            max_epochs=epochs,
            plugins=[
                SlipstreamCheckpointIO(
                    timeout=60, trusted=[lightning_scenario.Widths, lightning_scenario.Act]
                )
            ],
            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=1, save_last="link")],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = lightning_scenario.Regression(**lightning_scenario.hyper_parameters())
        trainer.fit(model, lightning_scenario._loader(0, 32), ckpt_path=ckpt_path)
        return trainer

    fit(2)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=1-step=8.ckpt"
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert fit(3, ckpt_path=str(last)).global_step == 12
