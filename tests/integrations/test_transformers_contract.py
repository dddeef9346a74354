"""SlipstreamTrainer keeps the Hugging Face Trainer's checkpoint contract: a save never
changes the run it saves (bit for bit against the same run without saves, and against the
plain Trainer saving the same steps), and a mid-epoch resume trains on the batches the
plain Trainer's own resume trains on, the next one first."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from test_transformers import arguments, dataset, tiny_model
from trainer_runs import StopAt, assert_same_state, training_state
from transformers import Trainer, TrainerCallback

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
        args=arguments(out, max_steps=6, save_steps=1),
        train_dataset=dataset(),
        callbacks=[before],
    )
    before.trainer = trainer
    trainer.train()
    state = training_state(trainer)
    state["rng"] = torch.get_rng_state()
    return state


def test_saves_before_the_first_step_and_after_every_step_change_nothing(tmp_path):
    """6 steps, saved before the first optimizer step and after every one: weights, AdamW
    state, scheduler, step and torch's generator end bit for bit as in the run that never
    saved, as they do when the plain Trainer saves the same steps."""
    plain = Trainer(
        model=tiny_model(),
        args=arguments(str(tmp_path / "unsaved"), max_steps=6, save_strategy="no"),
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
    assert saved == [f"checkpoint-{s}" for s in range(7)]


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
