"""What the framework integrations share about a training state and its checkpoint:
whether a directory holds a committed checkpoint and which keys it saved, the optimizer
under a framework's wrapper, and whether a forward pass can change saved tensors."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from ..checkpoint.format.names import METADATA_FILE


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a committed slipstream (or DCP) checkpoint."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def saved_keys(path: str) -> set[str]:
    """The flat keys a committed checkpoint holds."""
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer under accelerate's ``AcceleratedOptimizer`` wrapper, if any."""
    inner = getattr(optimizer, "optimizer", None)
    found = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    assert isinstance(found, torch.optim.Optimizer), type(optimizer)
    return found


def has_saved_buffers(model: torch.nn.Module, saved: dict[str, Any]) -> bool:
    """Whether the model's saved state holds buffers (BatchNorm's running statistics...):
    a forward pass may change those, where only the optimizer step changes parameters."""
    return any(name in saved for name, _ in model.named_buffers())
