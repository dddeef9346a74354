"""Hugging Face Trainer (or any subclass, TRL's included) checkpointing through slipstream.

Trains a tiny GPT-2 built from a config on made-up data, stops after step 3, resumes from
the checkpoint, loads the last checkpoint's weights with ``from_pretrained``, and resumes
the plain ``Trainer`` from the same checkpoint: it holds the Trainer's own files::

    python examples/hf_trainer.py --out /tmp/hf_trainer
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from slipstream.integrations.transformers import SlipstreamTrainer


class StopAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        control.should_training_stop = state.global_step >= self.step
        return control


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=out,
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=4,
        save_total_limit=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=100,
    )

    # The one change: SlipstreamTrainer for Trainer (or SlipstreamTrainerMixin as a base).
    SlipstreamTrainer(
        model=model(), args=args, train_dataset=data, callbacks=[StopAfter(3)]
    ).train()
    first = get_last_checkpoint(out)
    print(f"interrupted; last checkpoint: {os.path.basename(first)}")
    print(f"it holds the Trainer's own files: {sorted(os.listdir(first))}")

    trainer = SlipstreamTrainer(model=model(), args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True)
    print(f"resumed and trained to step {trainer.state.global_step}")

    last = get_last_checkpoint(out)
    loaded = GPT2LMHeadModel.from_pretrained(last)
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            trainer.model.state_dict().values(), loaded.state_dict().values(), strict=True
        )
    )
    print(f"from_pretrained({os.path.basename(last)}) equals the trained model: {same}")

    # The plain Trainer resumes from the checkpoint slipstream wrote, to the same end.
    plain = Trainer(model=model(), args=args, train_dataset=data)
    plain.train(resume_from_checkpoint=first)
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            trainer.model.state_dict().values(), plain.model.state_dict().values(), strict=True
        )
    )
    print(f"the plain Trainer resumed from {os.path.basename(first)} ends the same: {same}")


if __name__ == "__main__":
    main()
