"""Hugging Face Trainer checkpoints through slipstream hold the Trainer's own files: the
plain ``transformers.Trainer`` resumes from them (and slipstream from the Trainer's) bit
for bit against an uninterrupted run, in this process or in one where slipstream cannot be
imported; the directories the Trainer's resume and rotation see are only finished ones."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import numpy as np
import pytest
import torch
from datasets import Dataset
from dist_utils import free_port
from hf_models import config
from safetensors.torch import load_file
from same_tree import assert_same_tree
from trainer_runs import (
    TRAINER_FILES,
    StopAt,
    assert_same_state,
    assert_same_training_state,
    assert_same_weights,
    cpu_arguments,
)
from transformers import (
    GPT2LMHeadModel,
    PretrainedConfig,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from slipstream.integrations.transformers import SlipstreamTrainer, SlipstreamTrainerMixin

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


def token_rows(rows: int = 48, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    ids: list[list[int]] = torch.randint(0, VOCAB, (rows, length), generator=g).tolist()
    return ids


def dataset(rows: int = 48, length: int = 12) -> Dataset:
    ids = token_rows(rows, length)
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


def stopped_at(cls: type[Trainer], out: str, step: int, **args: object) -> Trainer:
    trainer = cls(
        model=tiny_model(),
        args=arguments(out, **args),
        train_dataset=dataset(),
        callbacks=[StopAt(step)],
    )
    trainer.train()
    assert trainer.state.global_step == step, (trainer.state.global_step, step)
    return trainer


def resumed_from(cls: type[Trainer], out: str, checkpoint: str) -> Trainer:
    trainer = cls(model=tiny_model(), args=arguments(out), train_dataset=dataset())
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


def test_interrupted_and_resumed_run_is_bit_exact(tmp_path):
    ref = reference(tmp_path)
    out = str(tmp_path / "run")
    stopped_at(SlipstreamTrainer, out, 5)
    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-3")

    resumed = SlipstreamTrainer(model=tiny_model(), args=arguments(out), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=True)
    assert_same_training_state(ref, resumed)

    # Resuming from an earlier checkpoint than the last works too.
    again = resumed_from(SlipstreamTrainer, out, os.path.join(out, "checkpoint-6"))
    assert_same_training_state(ref, again)

    # The Trainer saves the last step too; its weights are the trained ones, tied as saved.
    last = get_last_checkpoint(out)
    assert last == os.path.join(out, "checkpoint-8")
    loaded = GPT2LMHeadModel.from_pretrained(last)
    assert_same_weights(ref.model, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_checkpoints_hold_the_trainers_own_files_and_nothing_else(tmp_path):
    """Each checkpoint-N holds the files the plain Trainer's holds for the same run (model
    through save_pretrained, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json,
    training_args.bin), with the same contents; output_dir holds the same entries: no
    ``slipstream/``, no staging or other hidden directory."""
    runs = {}
    for name, cls in (("plain", Trainer), ("slipstream", SlipstreamTrainer)):
        out = str(tmp_path / name)
        stopped_at(cls, out, 5, save_steps=2)
        runs[name] = out
    plain, ours = runs["plain"], runs["slipstream"]
    assert sorted(os.listdir(ours)) == sorted(os.listdir(plain)) == ["checkpoint-2", "checkpoint-4"]
    for step in ("checkpoint-2", "checkpoint-4"):
        theirs, mine = os.path.join(plain, step), os.path.join(ours, step)
        assert sorted(os.listdir(mine)) == sorted(os.listdir(theirs))
        assert set(TRAINER_FILES) <= set(os.listdir(mine))
        for key, tensor in load_file(os.path.join(theirs, "model.safetensors")).items():
            assert torch.equal(tensor, load_file(os.path.join(mine, "model.safetensors"))[key])
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert_same_tree(
                torch.load(os.path.join(theirs, name), weights_only=False),
                torch.load(os.path.join(mine, name), weights_only=False),
            )
        for name in ("trainer_state.json", "config.json"):
            assert read_json(os.path.join(theirs, name)) == read_json(os.path.join(mine, name))


def read_json(path: str) -> object:
    with open(path) as f:
        return json.load(f)


def test_the_plain_trainer_resumes_slipstreams_checkpoint_and_the_other_way_round(tmp_path):
    """Stopped after step 5 and resumed from checkpoint-3 by the other trainer, each run
    ends bit for bit where the uninterrupted plain Trainer's ends."""
    ref = reference(tmp_path)
    for saver, resumer in ((SlipstreamTrainer, Trainer), (Trainer, SlipstreamTrainer)):
        out = str(tmp_path / f"{saver.__name__}-then-{resumer.__name__}")
        stopped_at(saver, out, 5)
        resumed = resumed_from(resumer, out, os.path.join(out, "checkpoint-3"))
        assert_same_training_state(ref, resumed)


class NoModelTypeConfig(PretrainedConfig):
    """A user's own config: no ``model_type`` (no Auto class knows it)."""

    def __init__(self, width: int = 8, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.width = width


class NoModelTypeModel(PreTrainedModel):
    config_class = NoModelTypeConfig

    def __init__(self, config: NoModelTypeConfig) -> None:
        super().__init__(config)
        self.inner = torch.nn.Linear(config.width, config.width)
        self.head = torch.nn.Linear(config.width, 1)
        self.drop = torch.nn.Dropout(0.2)
        self.post_init()

    def forward(self, x, labels=None):  # type: ignore[no-untyped-def]
        y = self.head(self.drop(torch.relu(self.inner(x)))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


def regression_rows(rows: int = 32, width: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, width, generator=g)
    y = x.sum(-1) + 0.1 * torch.randn(rows, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(rows)]


def no_model_type_model() -> NoModelTypeModel:
    torch.manual_seed(3)
    return NoModelTypeModel(NoModelTypeConfig())


def test_a_model_whose_config_has_no_model_type_saves_and_resumes(tmp_path):
    args = dict(max_steps=6, save_steps=3, seed=2)
    ref = Trainer(
        model=no_model_type_model(),
        args=arguments(str(tmp_path / "ref"), **{**args, "save_strategy": "no"}),
        train_dataset=regression_rows(),
    )
    ref.train()
    out = str(tmp_path / "run")
    first = SlipstreamTrainer(
        model=no_model_type_model(),
        args=arguments(out, **args),
        train_dataset=regression_rows(),
        callbacks=[StopAt(4)],
    )
    first.train()
    checkpoint = os.path.join(out, "checkpoint-3")
    resumed = SlipstreamTrainer(
        model=no_model_type_model(), args=arguments(out, **args), train_dataset=regression_rows()
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_same_training_state(ref, resumed)
    loaded = NoModelTypeModel.from_pretrained(os.path.join(out, "checkpoint-6"))
    assert_same_weights(ref.model, loaded)


class GrowingBufferModel(torch.nn.Module):
    """transformers' test_resume_batch_order model: a buffer that grows every forward (the
    rows seen), which only the model's own ``load_state_dict`` knows how to restore."""

    loads = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(10, 10, bias=False)
        self.register_buffer("seen", torch.empty(0, dtype=torch.long))

    def load_state_dict(self, state_dict, strict=True, assign=False):  # type: ignore[no-untyped-def]
        GrowingBufferModel.loads += 1
        if "seen" in state_dict and state_dict["seen"].shape != self.seen.shape:
            self.seen = state_dict["seen"].clone()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, input_ids, labels=None):  # type: ignore[no-untyped-def]
        logits = self.fc(input_ids)
        self.seen = torch.cat([self.seen, input_ids[:, 0].long()])
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def numbered_rows(rows: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = torch.randn(rows, 10, generator=g)
    data[:, 0] = torch.arange(rows)
    labels = torch.randint(0, 10, (rows,), generator=g)
    return [{"input_ids": data[i], "labels": labels[i]} for i in range(rows)]


def test_a_model_overriding_load_state_dict_is_resumed_through_it(tmp_path):
    args = dict(max_steps=8, save_steps=3, seed=4, per_device_train_batch_size=2)
    trainers = {}
    for name, cls, stop in (("ref", Trainer, None), ("run", SlipstreamTrainer, StopAt(5))):
        torch.manual_seed(0)
        trainers[name] = cls(
            model=GrowingBufferModel(),
            args=arguments(str(tmp_path / name), **args),
            train_dataset=numbered_rows(),
            callbacks=[stop] if stop else [],
        )
        trainers[name].train()
    torch.manual_seed(0)
    resumed = SlipstreamTrainer(
        model=GrowingBufferModel(),
        args=arguments(str(tmp_path / "run"), **args),
        train_dataset=numbered_rows(),
    )
    before = GrowingBufferModel.loads
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert GrowingBufferModel.loads == before + 1
    ref = trainers["ref"].model
    assert ref.seen.numel() == 16  # 8 steps of 2 rows
    assert torch.equal(resumed.model.seen, ref.seen)
    assert torch.equal(resumed.model.fc.weight, ref.fc.weight)


class SnapshotAtSave(SlipstreamTrainer):
    """Keeps, at each save, what the Trainer's own save would write: the model's, the
    optimizer's and the scheduler's state and the generators', copied in memory."""

    snapshots: dict[int, dict[str, object]]

    def _save_checkpoint(self, model, trial):  # type: ignore[no-untyped-def]
        assert self.optimizer is not None and self.lr_scheduler is not None
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cpu": torch.get_rng_state(),
            },
        }
        self.snapshots[self.state.global_step] = copy.deepcopy(state)
        super()._save_checkpoint(model, trial)


CHILD = textwrap.dedent(
    """
    import sys

    sys.path.append(sys.argv[1])  # the venv's packages, without their .pth files
    try:
        import slipstream  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("slipstream is importable here: " + slipstream.__file__)

    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    checkpoint, snapshot_file, out = sys.argv[2:5]
    snapshot = torch.load(snapshot_file, weights_only=False)
    step = snapshot["step"]

    def same(a, b, where):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), where
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b), where
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), (where, a.keys(), b.keys())
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, (where, a, b)

    loaded = GPT2LMHeadModel.from_pretrained(checkpoint)
    same(loaded.state_dict(), snapshot["model"], "from_pretrained")

    class Loaded(Exception):
        pass

    class CheckBeforeTheFirstStep(TrainerCallback):
        # The Trainer has loaded the checkpoint; no step has changed the state yet.
        def on_step_begin(self, args, state, control, **kwargs):
            assert state.global_step == step, (state.global_step, step)
            same(trainer.model.state_dict(), snapshot["model"], "Trainer model")
            same(trainer.optimizer.state_dict(), snapshot["optimizer"], "Trainer optimizer")
            same(trainer.lr_scheduler.state_dict(), snapshot["scheduler"], "Trainer scheduler")
            raise Loaded

    ids = snapshot["rows"]
    trainer = Trainer(
        model=GPT2LMHeadModel(loaded.config),
        args=TrainingArguments(
            output_dir=out, max_steps=step + 1, per_device_train_batch_size=4,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        ),
        train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
        callbacks=[CheckBeforeTheFirstStep()],
    )
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except Loaded:
        pass
    else:
        raise SystemExit("the resumed run never reached a step")
    rng = torch.load(checkpoint + "/rng_state.pth", weights_only=False)
    same({k: rng[k] for k in snapshot["rng"]}, snapshot["rng"], "rng_state.pth")
    print("loaded without slipstream")
    """
)


@pytest.mark.timeout(180)
def test_a_checkpoint_loads_where_slipstream_is_not_installed(tmp_path):
    """In a process that cannot import slipstream, ``from_pretrained`` and the plain
    Trainer's resume load checkpoint-3 equal, bit for bit, to the state in memory at that
    save: weights, optimizer, scheduler, random generators."""
    out = str(tmp_path / "run")
    trainer = SnapshotAtSave(
        model=tiny_model(), args=arguments(out, max_steps=5), train_dataset=dataset()
    )
    trainer.snapshots = {}
    trainer.train()
    snapshot_file = str(tmp_path / "snapshot.pt")
    torch.save({**trainer.snapshots[3], "step": 3, "rows": token_rows()}, snapshot_file)
    done = subprocess.run(
        [
            sys.executable,
            "-I",  # no PYTHONPATH, no user site, not the test's directory
            "-S",  # no site-packages .pth files: not slipstream's editable install
            "-c",
            CHILD,
            sysconfig.get_paths()["purelib"],
            os.path.join(out, "checkpoint-3"),
            snapshot_file,
            str(tmp_path / "child"),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "loaded without slipstream" in done.stdout


def checkpoint_is_complete(path: str) -> bool:
    return set(TRAINER_FILES) <= set(os.listdir(path))


class VisibleCheckpointsAreComplete(TrainerCallback):
    """At every step and right after every save (while its write is usually still going
    on), each checkpoint-N the Trainer could resume from is complete, and nothing but
    checkpoints is in sight."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.looked_at = 0

    def check(self) -> None:
        if not os.path.isdir(self.out):
            return
        for name in os.listdir(self.out):
            if not name.startswith("checkpoint-"):
                continue
            assert checkpoint_is_complete(os.path.join(self.out, name)), name
            self.looked_at += 1

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
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
    assert kept == ["checkpoint-8", "checkpoint-9"]
    assert sorted(os.listdir(out)) == kept
    for name in kept:
        assert sorted(os.listdir(os.path.join(out, name))) == sorted(
            os.listdir(tmp_path / "plain" / name)
        )


def pause_each_deletion(monkeypatch: pytest.MonkeyPatch, out: str) -> list[str]:
    """Makes every deletion of a directory in ``out`` stop once part of the checkpoint is
    gone (what a kill mid-deletion leaves) and check that each checkpoint-N still in sight
    is complete; returns the names deleted, filled in as they go."""
    watch = VisibleCheckpointsAreComplete(out)
    real_rmtree = shutil.rmtree
    deleted: list[str] = []

    def rmtree_in_two_halves(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        path = str(path)
        if os.path.dirname(path) == out and ".removing-" in path:
            os.remove(os.path.join(path, "optimizer.pt"))
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
    assert deleted == [".checkpoint-2", ".checkpoint-4", ".checkpoint-6"]
    assert sorted(os.listdir(out)) == ["checkpoint-7"]


class CountingTrainer(Trainer):
    """A user's existing subclass, with a file of its own in the checkpoint."""

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
    assert sorted(os.listdir(out)) == ["checkpoint-3"]
    with open(os.path.join(out, "checkpoint-3", "mine.txt")) as f:
        assert f.read() == "3"
    assert checkpoint_is_complete(os.path.join(out, "checkpoint-3"))


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
    assert os.path.basename(best) != "checkpoint-6"
    assert os.listdir(out) == [os.path.basename(best)]  # the Trainer keeps only the best
    assert deleted[-1] == ".checkpoint-6"  # dropped when training ended
    loaded = GPT2LMHeadModel.from_pretrained(best)
    assert_same_weights(trainer.model, loaded)


@pytest.mark.timeout(300)
def test_ddp_two_processes_resume_is_exact(tmp_path):
    """Under DDP (2 CPU processes, gloo, launched as torchrun launches them): the run
    stopped at step 5 and resumed from checkpoint-3 ends where an uninterrupted plain
    Trainer run ends, tensor for tensor; the checkpoints are the ones the Trainer saves,
    each with both processes' rng_state_<i>.pth, and the last one's weights are the
    trained ones."""
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
    assert results["after_first"] == ["checkpoint-3"]
    assert results["after_resume"] == ["checkpoint-3", "checkpoint-6", "checkpoint-8"]
    files = set(os.listdir(tmp_path / "run" / "checkpoint-3"))
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= files and "rng_state.pth" not in files
    assert set(TRAINER_FILES) - {"rng_state.pth"} <= files
    ref = results["reference"]
    assert ref["global_step"] == 8
    assert_same_state(ref, results["resumed"])
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "run" / "checkpoint-8")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ref["model"][name]), name
