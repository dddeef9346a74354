"""SlipstreamTrainer keeps the Hugging Face Trainer's checkpoint contract: a save never
changes the run it saves (bit for bit against the same run without saves, and against the
plain Trainer saving the same steps), a mid-epoch resume trains on the batches the plain
Trainer's own resume trains on, the next one first, callbacks see what they see with the
Trainer, and a save that fails leaves nothing behind and fails ``train()``."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from test_transformers import arguments, dataset, tiny_model
from trainer_runs import StopAt, assert_same_state, training_state
from transformers import (
    EarlyStoppingCallback,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerState,
)
from transformers.trainer import TRAINER_STATE_NAME

import slipstream.integrations._trainer_checkpoint as trainer_checkpoint
from slipstream.errors import CheckpointError
from slipstream.integrations.transformers import SlipstreamTrainer, SlipstreamTrainerMixin

pytestmark = pytest.mark.timeout(180)


class SaveBeforeTheFirstStep(TrainerCallback):
    """Saves a whole checkpoint (``checkpoint-0``) when training begins: the optimizer
    exists and has never stepped."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        assert self.trainer is not None and self.trainer.optimizer is not None
        assert not self.trainer.optimizer.state  # never stepped
        self.trainer._save_checkpoint(self.trainer.model, trial=None)


def run_saving_every_step(cls: type[Trainer], out: str) -> dict[str, Any]:
    before = SaveBeforeTheFirstStep()
    trainer = cls(
        model=tiny_model(),
        args=arguments(out, max_steps=4, save_steps=1),
        train_dataset=dataset(),
        callbacks=[before],
    )
    before.trainer = trainer
    trainer.train()
    state = training_state(trainer)
    state["rng"] = torch.get_rng_state()
    return state


def test_saves_before_the_first_step_and_after_every_step_change_nothing(tmp_path):
    """4 steps, saved before the first optimizer step and after every one: weights, AdamW
    state, scheduler, step and torch's generator end bit for bit as in the run that never
    saved, as they do when the plain Trainer saves the same steps."""
    plain = Trainer(
        model=tiny_model(),
        args=arguments(str(tmp_path / "unsaved"), max_steps=4, save_strategy="no"),
        train_dataset=dataset(),
    )
    plain.train()
    unsaved = training_state(plain)
    unsaved["rng"] = torch.get_rng_state()

    theirs = run_saving_every_step(Trainer, str(tmp_path / "plain"))
    assert_same_state(theirs, unsaved)
    assert torch.equal(theirs["rng"], unsaved["rng"])

    out = str(tmp_path / "run")
    ours = run_saving_every_step(SlipstreamTrainer, out)
    assert_same_state(ours, unsaved)
    assert torch.equal(ours["rng"], unsaved["rng"])
    saved = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert saved == sorted(os.listdir(tmp_path / "plain"))
    assert saved == [f"checkpoint-{s}" for s in range(5)]


class Recording(Trainer):
    """The plain Trainer, noting the rows of each batch it trains on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[list[int]]] = []

    def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        self.batches.append(inputs["input_ids"].tolist())
        return super().training_step(model, inputs, num_items_in_batch)


class SlipstreamRecording(SlipstreamTrainerMixin, Recording):
    pass


def test_mid_epoch_resume_trains_on_the_next_batch_as_the_trainer_does(tmp_path):
    """16 rows in batches of 4, shuffled each epoch: stopped after step 6 (the middle of
    the second epoch) and resumed from checkpoint-6, the run trains on the uninterrupted
    run's batches 7 and 8, as the plain Trainer's own resume does, and ends bit for bit
    where the uninterrupted run ends."""
    args = dict(max_steps=8, save_steps=3)
    uninterrupted = Recording(
        model=tiny_model(),
        args=arguments(str(tmp_path / "ref"), **{**args, "save_strategy": "no"}),
        train_dataset=dataset(rows=16),
    )
    uninterrupted.train()
    assert len(uninterrupted.batches) == 8

    resumed = {}
    for name, cls in (("plain", Recording), ("slipstream", SlipstreamRecording)):
        out = str(tmp_path / name)
        first = cls(
            model=tiny_model(),
            args=arguments(out, **args),
            train_dataset=dataset(rows=16),
            callbacks=[StopAt(6)],
        )
        first.train()
        assert first.batches == uninterrupted.batches[:6]
        trainer = cls(
            model=tiny_model(), args=arguments(out, **args), train_dataset=dataset(rows=16)
        )
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))
        resumed[name] = trainer

    assert resumed["plain"].batches == uninterrupted.batches[6:]
    assert resumed["slipstream"].batches == uninterrupted.batches[6:]
    assert_same_state(training_state(resumed["slipstream"]), training_state(uninterrupted))


def frozen_model() -> GPT2LMHeadModel:
    """The tiny model with its position embeddings frozen: the optimizer holds fewer
    parameters than the model saves."""
    model = tiny_model()
    model.transformer.wpe.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    "case",
    [
        dict(model=frozen_model),  # test_resume_training_with_frozen_params
        dict(model=tiny_model, gradient_accumulation_steps=2),  # ..._with_gradient_accumulation
    ],
    ids=["frozen-params", "gradient-accumulation"],
)
def test_resume_is_exact_as_in_the_trainers_own_tests(tmp_path, case):
    """Stopped after step 4 and resumed from checkpoint-3: the run ends bit for bit where
    the plain Trainer's uninterrupted run ends, frozen parameters and accumulated gradients
    included."""
    make_model = case["model"]
    fields = {k: v for k, v in case.items() if k != "model"}
    args = dict(max_steps=6, save_steps=3, **fields)
    ref = Trainer(
        model=make_model(),
        args=arguments(str(tmp_path / "ref"), **{**args, "save_strategy": "no"}),
        train_dataset=dataset(),
    )
    ref.train()
    out = str(tmp_path / "run")
    first = SlipstreamTrainer(
        model=make_model(),
        args=arguments(out, **args),
        train_dataset=dataset(),
        callbacks=[StopAt(4)],
    )
    first.train()
    resumed = SlipstreamTrainer(
        model=make_model(), args=arguments(out, **args), train_dataset=dataset()
    )
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    assert_same_state(training_state(resumed), training_state(ref))


def test_callback_states_are_saved_and_restored_as_the_trainer_does(tmp_path):
    """``trainer_state.json`` holds the callbacks' and ``TrainerControl``'s state as the
    plain Trainer's does, and a resume (``restore_callback_states_from_checkpoint``) gives
    ``EarlyStoppingCallback`` back its patience counter: it ends as the uninterrupted run's."""
    args = dict(
        max_steps=6,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=False,
        restore_callback_states_from_checkpoint=True,
        # EarlyStoppingCallback(early_stopping_threshold=100.0): no evaluation counts as an
        # improvement, so its counter grows at every one
    )
    states = {}
    for name, cls in (("plain", Trainer), ("slipstream", SlipstreamTrainer)):
        out = str(tmp_path / name / "out")
        trainer = cls(
            model=tiny_model(),
            args=arguments(out, **args),
            train_dataset=dataset(),
            eval_dataset=dataset(rows=8),
            callbacks=[
                EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=100.0)
            ],
        )
        trainer.train()
        saved = TrainerState.load_from_json(os.path.join(out, "checkpoint-4", TRAINER_STATE_NAME))
        states[name] = (saved.stateful_callbacks, saved.best_global_step, saved.global_step)
        resumed = cls(
            model=tiny_model(),
            args=arguments(out, **args),
            train_dataset=dataset(),
            eval_dataset=dataset(rows=8),
            callbacks=[
                EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=100.0)
            ],
        )
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
        states[name] += (patience(resumed), patience(trainer))
    assert states["slipstream"] == states["plain"]
    saved = states["plain"][0]["EarlyStoppingCallback"]["attributes"]
    assert saved["early_stopping_patience_counter"] > 0
    assert states["plain"][3] == states["plain"][4]  # resumed ends as the uninterrupted run


def patience(trainer: Trainer) -> int:
    """The patience counter of the trainer's ``EarlyStoppingCallback`` (a resume replaces
    the instance passed in with one built from the checkpoint)."""
    (early,) = [
        c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)
    ]
    return early.early_stopping_patience_counter


def test_a_relative_output_dir_saves_rotates_and_resumes_as_the_trainer_does(tmp_path, monkeypatch):
    """``output_dir="out"`` (relative): the checkpoints kept by ``save_total_limit=2``, the
    best one recorded, and a ``resume_from_checkpoint=True`` run's end are the plain
    Trainer's."""
    args = dict(
        max_steps=6,
        save_steps=2,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best_model="loss",
    )
    seen = {}
    for name, cls in (("plain", Trainer), ("slipstream", SlipstreamTrainer)):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        first = cls(
            model=tiny_model(),
            args=arguments("out", **args),
            train_dataset=dataset(),
            eval_dataset=dataset(rows=8),
            callbacks=[StopAt(4)],
        )
        first.train()
        kept = sorted(n for n in os.listdir("out") if n.startswith("checkpoint-"))
        resumed = cls(
            model=tiny_model(),
            args=arguments("out", **args),
            train_dataset=dataset(),
            eval_dataset=dataset(rows=8),
        )
        resumed.train(resume_from_checkpoint=True)
        seen[name] = (kept, first.state.best_model_checkpoint, training_state(resumed))
    ours, theirs = seen["slipstream"], seen["plain"]
    assert ours[:2] == theirs[:2]
    assert theirs[0] == ["checkpoint-2", "checkpoint-4"]
    assert_same_state(ours[2], theirs[2])


class ReadsTheCheckpointOnSave(TrainerCallback):
    """What the Trainer's reporting integrations do in ``on_save`` (``WandbCallback`` with
    ``log_model="checkpoint"``, ``MLflowCallback`` with artifacts): read
    ``output_dir/checkpoint-<step>``, which the plain Trainer has written by then."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str]]] = []

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        names = sorted(os.listdir(path)) if os.path.isdir(path) else []
        self.seen.append((state.global_step, [n for n in names if n in ON_SAVE_FILES]))


ON_SAVE_FILES = ("config.json", "model.safetensors", "trainer_state.json", "training_args.bin")


def test_on_save_callbacks_see_the_checkpoint_just_saved_as_with_the_trainer(tmp_path, caplog):
    """Every ``on_save`` finds ``checkpoint-<step>`` complete, as with the plain Trainer;
    the SlipstreamTrainer says once that such a callback makes each save wait for it."""
    seen = {}
    for name, cls in (("plain", Trainer), ("slipstream", SlipstreamTrainer)):
        reader = ReadsTheCheckpointOnSave()
        trainer = cls(
            model=tiny_model(),
            args=arguments(str(tmp_path / name), max_steps=4, save_steps=2),
            train_dataset=dataset(),
            callbacks=[reader],
        )
        with caplog.at_level("INFO", logger="slipstream.integrations.transformers"):
            trainer.train()
        seen[name] = reader.seen
    assert seen["plain"] == [(2, list(ON_SAVE_FILES)), (4, list(ON_SAVE_FILES))]
    assert seen["slipstream"] == seen["plain"]
    said = [r for r in caplog.records if "ReadsTheCheckpointOnSave" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_a_save_that_fails_leaves_nothing_behind_and_fails_train(tmp_path, monkeypatch):
    """The write of checkpoint-2 fails after its files are written, before the rename:
    ``train()`` raises it, and ``output_dir`` holds neither a checkpoint-2 nor anything
    hidden (the staged directory, the training thread's files)."""

    def fail(source: str, target: str) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(trainer_checkpoint, "_move_entries", fail)
    out = tmp_path / "run"
    trainer = SlipstreamTrainer(
        model=tiny_model(),
        args=arguments(str(out), max_steps=3, save_steps=2),
        train_dataset=dataset(),
    )
    with pytest.raises(CheckpointError, match="disk full"):
        trainer.train()
    assert os.listdir(out) == []
