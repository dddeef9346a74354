"""Small transformers models built from configs (never downloaded), for the Hugging Face tests.

Each is trained one optimizer step so its weights differ from any fresh initialisation:
a weight ``from_pretrained`` failed to load would then show in the logits.
"""

from __future__ import annotations

import logging

import torch
import transformers

logging.getLogger("transformers").setLevel(logging.ERROR)
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2)


def config(name: str) -> transformers.PretrainedConfig:
    """``gpt2`` (tied), ``llama``/``qwen2`` untied, ``llama-tied``/``qwen2-tied``."""
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=96,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.architectures = ["GPT2LMHeadModel"]
        return cfg
    family, _, tied = name.partition("-")
    if family == "llama":
        cfg = transformers.LlamaConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=bool(tied)
        )
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = transformers.Qwen2Config(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=bool(tied)
        )
        cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.pad_token_id = cfg.bos_token_id = cfg.eos_token_id = 0
    return cfg


def trained(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``config(name)`` after one AdamW step, in eval mode, and its optimizer."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(name))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.arange(12).reshape(1, 12) % 96
    model(tokens, labels=tokens).loss.backward()
    optim.step()
    model.eval()
    return model, optim


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])).logits
