"""A tiny Llama that vLLM serves on CPU, built from a config (never downloaded), with a
tokenizer trained here with ``tokenizers``, and the trainer's versions of its weights.

vLLM's CPU attention needs a head size of 32, 64, 80...: heads are 32 wide. Weights are drawn
with a large spread (``initializer_range``) so the logits of greedy decoding are far apart:
vLLM's oneDNN matmuls and transformers' differ in their last bits, which must never flip
an argmax. Every version is a fresh draw (its own seed), so its generations differ from the
last one's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

logging.getLogger("transformers").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

PROMPTS = [
    "the quick brown fox",
    "weights move beside compute",
    "a rollout engine serves",
    "one two three four",
]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "weights move beside compute instead of in front of it",
    "a rollout engine serves the trainer's newest weights",
    "one two three four five six seven eight nine ten",
    "versions strictly increase and every byte is checked",
] * 20
TOKENS = 24
ENGINE = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "block_size": 32,
    "max_num_seqs": 4,
    "weight_transfer_config": {"backend": "slipstream"},
}
"""The ``vllm.LLM`` options of every engine the tests build on these models (fp32, small,
the slipstream backend)."""
TOKEN = "slipstream-tests-token"
"""The trainer's token, which every engine the tests build holds (``SLIPSTREAM_VLLM_TOKEN``
in its workers' environment): a worker without one refuses every trainer."""


def config(hidden: int = 128, layers: int = 2, vocab: int = 320) -> transformers.LlamaConfig:
    """The model's config: heads 32 wide, tied embeddings (sent once)."""
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`, at most ``vocab`` tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def model(seed: int, **sizes: int) -> transformers.LlamaForCausalLM:
    """Version ``seed``'s model: a fresh draw of :func:`config`'s weights, in eval mode."""
    torch.manual_seed(seed)
    net = transformers.LlamaForCausalLM(config(**sizes)).eval()
    return net


def save(directory: Path, seed: int = 0, **sizes: int) -> Path:
    """Write version ``seed``'s model and the tokenizer to ``directory``, as vLLM loads it."""
    net = model(seed, **sizes)
    net.save_pretrained(directory)
    tokenizer(net.config.vocab_size).save_pretrained(directory)
    return directory


def reference(net: transformers.PreTrainedModel, directory: Path) -> list[list[int]]:
    """transformers' greedy generation of :data:`TOKENS` tokens for every prompt."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = net.generate(
                ids,
                max_new_tokens=TOKENS,
                min_new_tokens=TOKENS,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
            out.append(gen[0, ids.shape[1] :].tolist())
    return out
