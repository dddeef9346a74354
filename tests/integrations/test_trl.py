"""TRL's SFTTrainer, a Trainer subclass with a ``_save_checkpoint`` of its own, checkpoints
through slipstream with one added base class: interrupted and resumed, it ends bit-exact
against an uninterrupted run of TRL's own trainer."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from hf_models import config as model_config
from tokenizers import Tokenizer, models, pre_tokenizers
from trainer_runs import (
    TRAINER_FILES,
    StopAt,
    assert_same_training_state,
    assert_same_weights,
    cpu_arguments,
)
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from slipstream.integrations.transformers import SlipstreamTrainerMixin

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
    eos, pad = WORDS + 2, WORDS + 1
    return GPT2LMHeadModel(
        model_config(
            "gpt2",
            vocab_size=WORDS + 3,
            n_embd=32,
            n_head=2,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    )


def texts() -> Dataset:
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(40):
        n = int(torch.randint(4, 12, (1,), generator=g))
        rows.append(" ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=g)))
    return Dataset.from_dict({"text": rows})


def config(out: str, **overrides: object) -> SFTConfig:
    fields: dict[str, object] = dict(max_steps=6, save_steps=2, seed=5, max_length=16)
    return cpu_arguments(SFTConfig, out, **{**fields, **overrides})


class SlipstreamSFTTrainer(SlipstreamTrainerMixin, SFTTrainer):
    pass


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
    assert set(TRAINER_FILES) <= set(os.listdir(checkpoint))
    assert os.path.isfile(os.path.join(checkpoint, "tokenizer.json"))
    assert os.path.isfile(os.path.join(out, "README.md"))  # SFTTrainer's own model card

    resumed = SlipstreamSFTTrainer(
        model=tiny_model(), args=config(out), train_dataset=texts(), processing_class=tokenizer()
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_same_training_state(ref, resumed)

    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "checkpoint-6"))
    assert_same_weights(ref.model, loaded)
