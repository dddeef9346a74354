"""SlipstreamCheckpointIO in real Lightning runs, against Lightning's own TorchCheckpointIO
and an uninterrupted run (see lightning_scenario.py for the runs): it writes Lightning's
file, one torch.save archive per checkpoint, in both of its modes."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import ListConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning_scenario  # noqa: E402

import slipstream as ss  # noqa: E402
from slipstream.errors import CheckpointError  # noqa: E402
from slipstream.integrations.lightning import SlipstreamCheckpointIO  # noqa: E402

SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_scenario.py")
SRC = str(Path(ss.__file__).resolve().parents[1])


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
    # Every checkpoint is a file that torch.load reads as what torch.save wrote for it.
    for name in ss_run["files"]:
        ours = os.path.join(root, "ckpts", name)
        assert os.path.isfile(ours), name
        theirs = os.path.join(root, "torch_ckpts", name)
        assert_same(torch.load(ours, weights_only=False), torch.load(theirs, weights_only=False))
    hparams = torch.load(ours, weights_only=False)["hyper_parameters"]
    assert hparams["widths"] == lightning_scenario.Widths(32, 0.5)
    assert hparams["act"] is lightning_scenario.Act.TANH
    assert isinstance(hparams["layers"], ListConfig) and list(hparams["layers"]) == [16, 32]


def run_script(script: str, root: Path, *args: str) -> dict:
    """Runs ``script --root root`` in a child process (where it may start processes of its
    own) and returns the results it saved with ``torch.save``."""
    out = root / "results.pt"
    done = subprocess.run(
        [sys.executable, script, "--root", str(root), "--out", str(out), *args],
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
@pytest.mark.parametrize("background_write", [False, True])
def test_single_process_resume_is_exact_and_files_match_torch_io(tmp_path, background_write):
    torch.manual_seed(0)
    results = lightning_scenario.scenario(str(tmp_path), background_write=background_write)
    check_scenario(results, str(tmp_path))


@pytest.mark.timeout(240)
def test_ddp_two_processes_resume_is_exact_and_files_match_torch_io(tmp_path):
    results = run_script(SCENARIO, tmp_path, "--background-write")
    check_scenario(results, str(tmp_path))


def _state(fill: float) -> dict:
    return {
        "state_dict": {"w": torch.full((256, 64), fill)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "global_step": int(fill),
    }


def _slipstream_threads() -> list[str]:
    """The plugin's writer threads alive now (``ss.save``'s shared saver, which another test
    may have started, lives for the process and is not the plugin's)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("slipstream-write")]


def test_a_checkpoint_loads_with_slipstream_not_importable_bit_for_bit(tmp_path):
    io = SlipstreamCheckpointIO(background_write=True)
    state = _state(1.5)
    state["state_dict"]["w"] = torch.randn(256, 64)
    io.save_checkpoint(state, tmp_path / "epoch=0.ckpt")
    expected = {"w": state["state_dict"]["w"].clone()}
    state["state_dict"]["w"].zero_()  # training went on after the save returned
    io.teardown()
    torch.save(expected, tmp_path / "expected.pt")
    check = f"""
import sys
sys.path = [p for p in sys.path if p != {SRC!r}]
sys.modules["slipstream"] = None
try:
    import slipstream
except ImportError:
    pass
else:
    raise SystemExit("slipstream is importable")
import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
ckpt = pl_load({str(tmp_path / "epoch=0.ckpt")!r})
expected = torch.load({str(tmp_path / "expected.pt")!r})
w = ckpt["state_dict"]["w"]
assert w.dtype == expected["w"].dtype and torch.equal(w, expected["w"]), "weights differ"
assert list(ckpt["optimizer_states"][0]["state"]) == [0] and ckpt["global_step"] == 1
print("loaded")
"""
    done = subprocess.run(
        [sys.executable, "-I", "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "loaded"


@pytest.mark.parametrize("background_write", [False, True])
def test_each_checkpoint_is_one_torch_save_of_the_whole_dict(tmp_path, background_write):
    saves = mock.Mock(wraps=torch.save)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=3,
        plugins=[SlipstreamCheckpointIO(background_write=background_write)],
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = lightning_scenario.Regression(**lightning_scenario.hyper_parameters())
    with mock.patch("torch.save", saves):
        trainer.fit(model, lightning_scenario._loader(0, 16))
    # Three epochs, each saving its top-k file and last.ckpt: one torch.save each, of the
    # whole checkpoint dict.
    assert saves.call_count == 6
    assert all(set(c.args[0]) >= {"state_dict", "optimizer_states"} for c in saves.call_args_list)
    assert sorted(os.listdir(tmp_path)) == [
        "epoch=0-step=2.ckpt",
        "epoch=1-step=4.ckpt",
        "epoch=2-step=6.ckpt",
        "last.ckpt",
    ]
    loaded = type(model).load_from_checkpoint(tmp_path / "last.ckpt", weights_only=False)
    assert_same(loaded.state_dict(), model.state_dict())
    assert _slipstream_threads() == []


def test_a_load_in_another_plugin_waits_for_the_write_in_flight(tmp_path):
    path = tmp_path / "model.ckpt"
    TorchCheckpointIO().save_checkpoint(_state(1.0), path)
    release = threading.Event()
    real_save = torch.save

    def held_save(obj, f, *args, **kwargs):
        assert release.wait(30)
        real_save(obj, f, *args, **kwargs)

    writer = SlipstreamCheckpointIO(background_write=True)
    with mock.patch("torch.save", held_save):
        writer.save_checkpoint(_state(2.0), path)
        # Another process reading the path meanwhile finds the previous file, whole.
        assert_same(torch.load(path), _state(1.0))
        threading.Timer(0.2, release.set).start()
        # A new plugin (a new Trainer's) in this process waits for the new one.
        assert_same(SlipstreamCheckpointIO().load_checkpoint(path), _state(2.0))
    writer.teardown()
    assert _slipstream_threads() == []


def test_overwrite_and_remove_with_a_save_in_flight(tmp_path):
    io = SlipstreamCheckpointIO(timeout=60, background_write=True)
    path, removed = tmp_path / "last.ckpt", tmp_path / "epoch=0.ckpt"
    io.save_checkpoint(_state(1.0), removed)
    io.save_checkpoint(_state(1.0), path)
    io.save_checkpoint(_state(2.0), path)  # the first may still be writing
    io.remove_checkpoint(removed)
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert_same(torch.load(path), _state(2.0))


def test_checkpoint_keeps_state_as_it_was_when_save_returned(tmp_path):
    io = SlipstreamCheckpointIO(timeout=60, background_write=True)
    state = _state(1.0)
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    state["state_dict"]["w"].fill_(5.0)  # training goes on once save_checkpoint returns
    io.teardown()
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt"), _state(1.0))


def test_the_plugin_pickles_with_a_write_in_flight_and_keeps_its_options(tmp_path):
    io = SlipstreamCheckpointIO(timeout=12, background_write=True)
    io.save_checkpoint(_state(1.0), tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(io))
    assert (copy.timeout, copy.background_write) == (12, True)
    io.teardown()
    copy.teardown()


def test_errors_and_messages_are_lightnings_and_a_failed_write_names_its_path(tmp_path):
    io = SlipstreamCheckpointIO(background_write=True)
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*nothing.ckpt"):
        io.load_checkpoint(tmp_path / "nothing.ckpt")
    with pytest.raises(TypeError, match="`storage_options` arg is not supported"):
        io.save_checkpoint(_state(1.0), tmp_path / "a.ckpt", storage_options={"k": 1})
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileExistsError):  # its parent is a file: raised at once, as Lightning's
        io.save_checkpoint(_state(1.0), tmp_path / "file" / "b.ckpt")
    with mock.patch("torch.save", side_effect=OSError("disk full")):
        io.save_checkpoint(_state(1.0), tmp_path / "b.ckpt")  # fails on the writer's thread
        with pytest.raises(CheckpointError, match=r"b\.ckpt failed: disk full"):
            io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing under the name, nothing hidden


def test_a_checkpoint_directory_of_an_earlier_release_still_loads(tmp_path):
    ss.save(_state(3.0), checkpoint_id=str(tmp_path / "old.ckpt"), no_dist=True)
    io = SlipstreamCheckpointIO()
    assert_same(io.load_checkpoint(tmp_path / "old.ckpt"), _state(3.0))
    loaded = io.load_checkpoint(tmp_path / "old.ckpt", map_location=torch.device("meta"))
    assert loaded["state_dict"]["w"].device.type == "meta"


@pytest.mark.timeout(240)
def test_ddp_spawn_hands_the_trained_weights_to_the_main_process(tmp_path):
    script = os.path.join(os.path.dirname(SCENARIO), "lightning_spawn.py")
    results = run_script(script, tmp_path)
    assert_same(results["main"], results["worker"], "main process vs rank 0's weights")
    assert results["leftovers"] == []  # the launcher removed its .temp.ckpt


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
    def fit(epochs, ckpt_path=None):
        trainer = Trainer(
            accelerator="cpu",
            max_epochs=epochs,
            plugins=[SlipstreamCheckpointIO(timeout=60, background_write=True)],
            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_top_k=1, save_last="link")],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = lightning_scenario.Regression(**lightning_scenario.hyper_parameters())
        trainer.fit(
            model, lightning_scenario._loader(0, 32), ckpt_path=ckpt_path, weights_only=False
        )
        return trainer

    fit(2)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=1-step=8.ckpt"
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert fit(3, ckpt_path=str(last)).global_step == 12
