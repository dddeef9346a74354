"""What a transformers model built from a config expects to find in its safetensors files.

The model is built on the meta device (no memory, no initialisation) from the config; its
state dict's names and shapes are what ``from_pretrained`` fills. Tied weights (one
parameter under several names, e.g. ``lm_head.weight`` and the input embedding) are
written once: of each group of names that share a parameter, the names matching the
model's ``_tied_weights_keys`` are dropped and one name is always kept, as
``save_pretrained`` does.

transformers is optional: without it there is no architecture to check against.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError


@dataclass(frozen=True)
class Architecture:
    """The tensors a model class expects, in its state dict's order."""

    name: str
    shapes: dict[str, tuple[int, ...]]
    """Name -> shape of every tensor the files must hold (tied copies excluded)."""
    tied: dict[str, str]
    """Name of a tied copy -> the name it is written under."""


def _transformers() -> Any | None:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        return None


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object of a ``config.json``, or an error naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the model config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"the model config {path} is not a JSON object")
    return data


def _tied_patterns(model: Any) -> list[str]:
    patterns: list[str] = []
    for module_name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or []
        patterns += [f"{module_name}.{k}" if module_name else k for k in tied]
    return patterns


def _tied_copies(model: Any) -> dict[str, str]:
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    patterns = _tied_patterns(model)
    tied: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        matching = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        dropped = matching[: len(names) - 1]
        kept = next(n for n in sorted(names) if n not in dropped)
        tied.update({n: kept for n in dropped})
    return tied


def architecture(config_path: str | os.PathLike[str]) -> Architecture | None:
    """The architecture ``config_path`` describes (its ``architectures[0]``, else a causal
    LM of its ``model_type``), or ``None`` when transformers is not installed."""
    transformers = _transformers()
    if transformers is None:
        return None
    data = read_config(config_path)
    model_type = data.get("model_type")
    if not model_type:
        raise CheckpointError(f"the model config {config_path} has no model_type")
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        names = data.get("architectures") or []
        with torch.device("meta"):
            if names:
                model = getattr(transformers, names[0])(config)
            else:
                model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, AttributeError, KeyError, TypeError, ImportError, OSError) as exc:
        raise CheckpointError(
            f"cannot build the model the config {config_path} describes "
            f"(model_type {model_type!r}): {exc}"
        ) from exc
    tied = _tied_copies(model)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    shapes = {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if name not in tied and name not in ignored
    }
    return Architecture(type(model).__name__, shapes, tied)
