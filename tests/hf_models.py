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


def config(name: str, **overrides: object) -> transformers.PretrainedConfig:
    """``gpt2`` (tied), ``llama``/``qwen2`` untied, ``llama-tied``/``qwen2-tied``;
    ``overrides`` replace any of the config's constructor arguments (sizes, token ids)."""
    if name == "gpt2":
        fields: dict[str, object] = dict(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=96,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg = transformers.GPT2Config(**{**fields, **overrides})
        cfg.architectures = ["GPT2LMHeadModel"]
        return cfg
    family, _, tied = name.partition("-")
    fields = dict(
        **SMALL,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=bool(tied),
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**{**fields, **overrides})
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        cfg = transformers.Qwen2Config(**{**fields, **overrides})
        cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def model(name: str, seed: int, **overrides: object) -> transformers.PreTrainedModel:
    """A freshly initialised model of ``config(name, **overrides)``, the same for each ``seed``."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(name, **overrides))


def trained(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of ``config(name)`` after one AdamW step, in eval mode, and its optimizer."""
    net = model(name, seed)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    tokens = torch.arange(12).reshape(1, 12) % 96
    net(tokens, labels=tokens).loss.backward()
    optim.step()
    net.eval()
    return net, optim


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])).logits
