"""Hugging Face Trainer checkpoints through slipstream: interrupted and resumed runs are
bit-exact against an uninterrupted run of the plain ``transformers.Trainer``; the
directories the Trainer's resume and rotation see are only finished ones."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from dist_utils import free_port
from hf_models import config
from trainer_runs import (
    StopAt,
    assert_same_state,
    assert_same_training_state,
    assert_same_weights,
    cpu_arguments,
)
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from slipstream.integrations.transformers import (
    STAGING_DIR,
    SlipstreamTrainer,
    SlipstreamTrainerMixin,
    state_dir,
)

pytestmark = pytest.mark.timeout(120)

VOCAB = 64
DDP_SCENARIO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_ddp_scenario.py")


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(1234)
    # Dropout draws from the RNG a resume must restore.
    dropout = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(
        config("gpt2", vocab_size=VOCAB, n_positions=16, n_embd=32, n_head=2, **dropout)
    )


def dataset(rows: int = 48, length: int = 12) -> Dataset:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def arguments(out: str, **overrides: object) -> TrainingArguments:
    fields: dict[str, object] = dict(
        max_steps=8,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_steps=3,
        seed=11,
    )
    return cpu_arguments(TrainingArguments, out, **{**fields, **overrides})


def reference(tmp_path) -> Trainer:
    """The plain Trainer, never interrupted, never saving."""
    trainer = Trainer(
        model=tiny_model(),
        args=arguments(str(tmp_path / "ref"), save_strategy="no"),
        train_dataset=dataset(),
    )
    trainer.train()
    return trainer


def test_interrupted_and_resumed_run_is_bit_exact(tmp_path):
    ref = reference(tmp_path)
    out = str(tmp_path / "run")

    first = SlipstreamTrainer(
        model=tiny_model(),
        args=arguments(out),
        train_dataset=dataset(),
        callbacks=[StopAt(5)],
    )
    first.train()
    assert first.state.global_step == 5
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-3")
    for name in ("trainer_state.json", "model.safetensors", "config.json", "training_args.bin"):
        assert os.path.isfile(os.path.join(out, "checkpoint-3", name)), name
    assert state_dir(os.path.join(out, "checkpoint-3")) is not None
    assert not os.path.exists(os.path.join(out, "checkpoint-3", "optimizer.pt"))
    assert os.listdir(os.path.join(out, STAGING_DIR)) == []

    resumed = SlipstreamTrainer(model=tiny_model(), args=arguments(out), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=True)
    assert_same_training_state(ref, resumed)

    # Resuming from an earlier checkpoint than the last works too.
    again = SlipstreamTrainer(model=tiny_model(), args=arguments(out), train_dataset=dataset())
    again.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))
    assert_same_training_state(ref, again)

    # The Trainer saves the last step too; its exported weights are the trained ones.
    last = get_last_checkpoint(out)
    assert last == os.path.join(out, "checkpoint-8")
    loaded = GPT2LMHeadModel.from_pretrained(last)
    assert_same_weights(ref.model, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


class VisibleCheckpointsAreComplete(TrainerCallback):
    """At every step and right after every save (while its write is usually still going
    on), each checkpoint-N the Trainer could resume from is complete."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.looked_at = 0

    def check(self) -> None:
        if not os.path.isdir(self.out):
            return
        for name in os.listdir(self.out):
            if not name.startswith("checkpoint-"):
                continue
            path = os.path.join(self.out, name)
            assert state_dir(path) is not None, path
            assert os.path.isfile(os.path.join(path, "trainer_state.json")), path
            assert os.path.isfile(os.path.join(path, "model.safetensors")), path
            self.looked_at += 1

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.check()

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.check()


def test_rotation_keeps_what_the_trainer_keeps(tmp_path):
    args = dict(max_steps=9, save_steps=2, save_total_limit=2)
    plain = Trainer(
        model=tiny_model(), args=arguments(str(tmp_path / "plain"), **args), train_dataset=dataset()
    )
    plain.train()
    out = str(tmp_path / "run")
    watch = VisibleCheckpointsAreComplete(out)
    trainer = SlipstreamTrainer(
        model=tiny_model(), args=arguments(out, **args), train_dataset=dataset(), callbacks=[watch]
    )
    trainer.train()
    assert watch.looked_at > 0
    kept = sorted(os.listdir(tmp_path / "plain"))
    assert len(kept) == 2
    assert sorted(os.listdir(out)) == [STAGING_DIR, *kept]
    assert os.listdir(os.path.join(out, STAGING_DIR)) == []
    for name in kept:
        path = os.path.join(out, name)
        assert state_dir(path) is not None
        assert os.path.isfile(os.path.join(path, "trainer_state.json"))


def pause_each_deletion(monkeypatch: pytest.MonkeyPatch, out: str) -> list[str]:
    """Makes every deletion of a directory in ``out`` stop once the checkpoint's state is
    gone (what a kill mid-deletion leaves) and check that each checkpoint-N still in sight
    is complete; returns the names deleted, filled in as they go."""
    watch = VisibleCheckpointsAreComplete(out)
    real_rmtree = shutil.rmtree
    deleted: list[str] = []

    def rmtree_in_two_halves(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.path.dirname(path) == out:  # not a save's staging directory
            real_rmtree(os.path.join(path, "slipstream"))
            watch.check()
            deleted.append(os.path.basename(path).split(".removing-")[0])
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree_in_two_halves)
    return deleted


def test_a_rotated_out_checkpoint_is_never_visible_half_deleted(tmp_path, monkeypatch):
    """Every checkpoint-N in sight is complete while the rotation deletes old ones."""
    out = str(tmp_path / "run")
    deleted = pause_each_deletion(monkeypatch, out)
    trainer = SlipstreamTrainer(
        model=tiny_model(),
        args=arguments(out, max_steps=7, save_steps=2, save_total_limit=1),
        train_dataset=dataset(),
    )
    trainer.train()
    assert deleted == [
        ".checkpoint-2",
        ".checkpoint-4",
        ".checkpoint-6",
    ]
    assert sorted(os.listdir(out)) == [STAGING_DIR, "checkpoint-7"]


class CountingTrainer(Trainer):
    """A user's existing subclass, with a hook of its own in the checkpoint."""

    def _save_checkpoint(self, model, trial):  # type: ignore[no-untyped-def]
        super()._save_checkpoint(model, trial)
        run_dir = self._get_output_dir(trial)
        marker = os.path.join(run_dir, f"checkpoint-{self.state.global_step}", "mine.txt")
        with open(marker, "w") as f:
            f.write(str(self.state.global_step))


class SlipstreamCountingTrainer(SlipstreamTrainerMixin, CountingTrainer):
    pass


def test_existing_subclass_keeps_its_files_in_the_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    trainer = SlipstreamCountingTrainer(
        model=tiny_model(), args=arguments(out, max_steps=3), train_dataset=dataset()
    )
    trainer.train()
    with open(os.path.join(out, "checkpoint-3", "mine.txt")) as f:
        assert f.read() == "3"


def test_best_model_at_end_is_a_finished_checkpoint_and_is_loaded(tmp_path, monkeypatch):
    """The best checkpoint is found among finished ones, survives rotation, and its
    weights are what the model holds after training; the checkpoints dropped when training
    ends are never seen half deleted."""
    out = str(tmp_path / "run")
    deleted = pause_each_deletion(monkeypatch, out)
    trainer = SlipstreamTrainer(
        model=tiny_model(),
        args=arguments(
            out,
            max_steps=6,
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="loss",
            greater_is_better=True,  # the worst loss: an early checkpoint, not the last
            save_total_limit=1,
        ),
        train_dataset=dataset(),
        eval_dataset=dataset(rows=8),
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and os.path.dirname(best) == out, best
    assert state_dir(best) is not None
    assert os.path.basename(best) != "checkpoint-6"
    kept = [name for name in os.listdir(out) if name.startswith("checkpoint-")]
    assert kept == [os.path.basename(best)]  # the Trainer keeps only the best at the end
    assert deleted[-1] == ".checkpoint-6"  # dropped when training ended
    loaded = GPT2LMHeadModel.from_pretrained(best)
    assert_same_weights(trainer.model, loaded)


@pytest.mark.timeout(300)
def test_ddp_two_processes_resume_is_exact(tmp_path):
    """Under DDP (2 CPU processes, gloo, launched as torchrun launches them): the run
    stopped at step 5 and resumed from checkpoint-3 ends where an uninterrupted plain
    Trainer run ends, tensor for tensor; the checkpoints are the ones the Trainer saves, and
    the last one's exported weights are the trained ones."""
    out = tmp_path / "results.pt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            DDP_SCENARIO,
            "--root",
            str(tmp_path),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-6000:]
    results = torch.load(out, weights_only=False)
    assert results["world_size"] == 2
    assert results["stopped_at"] == 5
    assert results["after_first"] == [STAGING_DIR, "checkpoint-3"]
    assert results["after_resume"] == [STAGING_DIR, "checkpoint-3", "checkpoint-6", "checkpoint-8"]
    ref = results["reference"]
    assert ref["global_step"] == 8
    assert_same_state(ref, results["resumed"])
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-8")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ref["model"][name]), name
