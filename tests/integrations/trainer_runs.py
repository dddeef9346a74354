"""What the Hugging Face Trainer tests (plain ``Trainer`` and TRL's ``SFTTrainer``) share:
CPU-only, seeded arguments that save by steps, the files the Trainer's own checkpoint
holds, a callback that interrupts a run, and the check that two trainers hold the same
training state, tensor for tensor."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

Args = TypeVar("Args", bound=TrainingArguments)

TRAINER_FILES = (
    "config.json",
    "model.safetensors",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.bin",
)
"""What ``Trainer._save_checkpoint`` writes into ``checkpoint-N`` for a ``PreTrainedModel``
trained in one process (with a generation config, a tokenizer or a scaler, more)."""


def cpu_arguments(cls: type[Args], out: str, **fields: object) -> Args:
    """``cls`` (``TrainingArguments`` or a subclass) for a quiet, deterministic run on CPU
    that saves every ``save_steps``; ``fields`` add to or replace the defaults."""
    base: dict[str, object] = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(fields)
    return cls(**base)


class StopAt(TrainerCallback):
    """Stops training after ``step`` (the Trainer still saves that step's checkpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def training_state(trainer: Trainer) -> dict[str, Any]:
    """What a resume must restore, copied out of a finished run (a picklable dict)."""
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "global_step": trainer.state.global_step,
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two :func:`training_state` dicts are equal, tensor for tensor."""
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    sa, sb = a["optimizer"], b["optimizer"]
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for idx, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][idx][key]), (idx, key)
    assert a["scheduler"] == b["scheduler"]
    assert a["global_step"] == b["global_step"]


def assert_same_training_state(a: Trainer, b: Trainer) -> None:
    """Weights, optimizer state and param groups, LR scheduler state and step are all equal."""
    assert_same_state(training_state(a), training_state(b))
