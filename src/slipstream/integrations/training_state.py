"""What the framework integrations share about a training state and its checkpoint:
whether a directory holds a committed checkpoint, one a save started and never committed,
or neither, which keys a checkpoint saved, the optimizer under a framework's wrapper, and
whether a forward pass can change saved tensors.

A resume never picks an incomplete checkpoint: each integration skips one when it picks
the newest itself, and refuses one it is named with :func:`incomplete_error`, which names
the newest complete checkpoint beside it."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from ..checkpoint.format.names import (
    BASE_INDEX_FILE,
    DATA_FILE_SUFFIX,
    METADATA_FILE,
    is_temporary,
)
from ..errors import CheckpointError


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a committed slipstream (or DCP) checkpoint."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def _written_by_a_save(name: str) -> bool:
    """Whether a save writes a file of this name before its ``.metadata``: a data file,
    slipstream's index (of any generation), or a temporary file."""
    index_stem = BASE_INDEX_FILE.removesuffix(".json")
    return (
        name.endswith(DATA_FILE_SUFFIX)
        or (name.startswith(index_stem) and name.endswith(".json"))
        or is_temporary(name)
    )


def is_incomplete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory a slipstream save started and did not commit: it
    has no ``.metadata`` and holds nothing but what a save writes before it (possibly
    nothing at all). A directory a framework wrote with its own code is neither this nor
    a committed checkpoint."""
    if not os.path.isdir(path) or is_checkpoint(path):
        return False
    try:
        names = os.listdir(path)
    except FileNotFoundError:  # deleted meanwhile
        return False
    return all(_written_by_a_save(name) for name in names)


def newest_complete(directory: str | os.PathLike[str], inside: str = "") -> str | None:
    """The checkpoint directly under ``directory`` (committed in its subdirectory
    ``inside``, if given) whose ``.metadata`` was written last (the last save to commit),
    or ``None``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    committed = {}
    for name in names:
        path = os.path.join(directory, name)
        state = os.path.join(path, inside)
        if not name.startswith(".") and is_checkpoint(state):
            committed[path] = os.stat(os.path.join(state, METADATA_FILE)).st_mtime_ns
    return max(committed, key=committed.__getitem__) if committed else None


def incomplete_error(path: str, inside: str = "") -> CheckpointError:
    """The error for loading ``path``, an incomplete checkpoint (its subdirectory
    ``inside`` is, if given): it names the newest complete one beside it."""
    where = os.path.dirname(os.path.abspath(path))
    newest = newest_complete(where, inside)
    found = (
        f"the newest complete checkpoint is {newest}"
        if newest is not None
        else f"there is no complete checkpoint in {where}"
    )
    return CheckpointError(
        f"{path} is an incomplete checkpoint (no {METADATA_FILE}: the save did not commit); {found}"
    )


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
