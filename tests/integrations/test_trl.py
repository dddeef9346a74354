"""TRL's SFTTrainer, a Trainer subclass with a ``_save_checkpoint`` of its own, checkpoints
through slipstream with one added base class: interrupted and resumed, it ends bit-exact
against an uninterrupted run of TRL's own trainer."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

from slipstream.integrations.transformers import SlipstreamTrainerMixin, state_dir

pytestmark = pytest.mark.timeout(120)

WORDS = 60


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built here: nothing is downloaded."""
    vocab = {f"w{i}": i for i in range(WORDS)}
    vocab.update({"<unk>": WORDS, "<pad>": WORDS + 1, "<eos>": WORDS + 2})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(99)
    config = GPT2Config(
        vocab_size=WORDS + 3,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=WORDS + 2,
        eos_token_id=WORDS + 2,
        pad_token_id=WORDS + 1,
    )
    return GPT2LMHeadModel(config)


def texts() -> Dataset:
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(40):
        n = int(torch.randint(4, 12, (1,), generator=g))
        rows.append(" ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=g)))
    return Dataset.from_dict({"text": rows})


def config(out: str, **overrides: object) -> SFTConfig:
    base: dict[str, object] = dict(
        output_dir=out,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        logging_steps=100,
        report_to=[],
        use_cpu=True,
        seed=5,
        disable_tqdm=True,
        max_length=16,
        dataloader_num_workers=0,
    )
    base.update(overrides)
    return SFTConfig(**base)  # type: ignore[arg-type]


class SlipstreamSFTTrainer(SlipstreamTrainerMixin, SFTTrainer):
    pass


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_sft_trainer_resumes_bit_exact(tmp_path):
    ref = SFTTrainer(
        model=tiny_model(),
        args=config(str(tmp_path / "ref"), save_strategy="no"),
        train_dataset=texts(),
        processing_class=tokenizer(),
    )
    ref.train()

    out = str(tmp_path / "run")
    first = SlipstreamSFTTrainer(
        model=tiny_model(),
        args=config(out),
        train_dataset=texts(),
        processing_class=tokenizer(),
        callbacks=[StopAt(3)],
    )
    first.train()
    checkpoint = os.path.join(out, "checkpoint-2")
    assert state_dir(checkpoint) is not None
    assert os.path.isfile(os.path.join(checkpoint, "tokenizer.json"))
    assert os.path.isfile(os.path.join(out, "README.md"))  # SFTTrainer's own model card

    resumed = SlipstreamSFTTrainer(
        model=tiny_model(), args=config(out), train_dataset=texts(), processing_class=tokenizer()
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    for (name, x), y in zip(
        ref.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
    ref_opt, opt = ref.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for idx, state in ref_opt.items():
        for key, value in state.items():
            assert torch.equal(value, opt[idx][key]), (idx, key)

    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "checkpoint-6"))
    for (name, x), y in zip(
        ref.model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
