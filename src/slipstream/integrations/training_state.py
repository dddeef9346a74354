"""What the framework integrations share about a training state and its checkpoint:
whether a directory holds a committed checkpoint, one a save started and never committed,
or neither, which keys a checkpoint saved, the optimizer under a framework's wrapper, and
whether a forward pass can change saved tensors; an optimizer's state under parameter
names, read and restored without changing the optimizer otherwise (:func:`optimizer_state`,
:func:`restore_optimizer_state`, :func:`saved_subtree`).

A resume never picks an incomplete checkpoint: each integration skips one when it picks
the newest itself, and refuses one it is named with :func:`incomplete_error`, which names
the newest complete checkpoint beside it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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


# -- optimizer state under parameter names -------------------------------------------------
#
# torch's ``get_optimizer_state_dict`` (and ``set_optimizer_state_dict``) first make an
# optimizer that has not stepped yet take a zero-lr step (``_init_optim_state``), so that
# its state has every tensor: a save through it changed the training run (Adam's step
# counts one more; optimizers whose update does not scale with lr move the weights). The
# functions below never do: a save reads ``optimizer.state_dict()`` as it is (an optimizer
# that has not stepped saves no state, as ``torch.save(optimizer.state_dict())`` does), and
# a load builds its target from the checkpoint's own metadata, not from the live state.
# The format is the one ``get_optimizer_state_dict`` gives a model that is not FSDP-sharded
# (``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``), so
# checkpoints written through it load, and it through it.

_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")
"""Module names activation checkpointing and ``torch.compile`` put in parameter names, and
that torch's FQNs leave out (as they leave out DDP's ``module``)."""


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its FQN as ``get_optimizer_state_dict`` names it: the first
    name ``named_parameters`` gives it, without DDP's, ``torch.compile``'s and activation
    checkpointing's wrapper names."""
    ddp = torch.nn.parallel.DistributedDataParallel
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        parts: list[str] = []
        node: Any = model
        for part in name.split("."):
            skip = part in _WRAPPER_NAMES or (isinstance(node, ddp) and part == "module")
            node = getattr(node, part)
            if not skip:
                parts.append(part)
        names.setdefault(id(param), ".".join(parts))
    return names


def optimizer_parameter_names(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
) -> list[str]:
    """The name of each parameter the optimizer updates, in its ``param_groups`` order:
    its FQN in ``model``, or (``model`` ``None``) its index, as ``optimizer.state_dict()``
    numbers it. Raises naming the first parameter ``model`` does not hold."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if model is None:
        return [str(i) for i in range(len(params))]
    by_id = parameter_names(model)
    missing = next((i for i, p in enumerate(params) if id(p) not in by_id), None)
    if missing is not None:
        raise CheckpointError(
            f"optimizer parameter {missing} (of {len(params)}) is not a parameter of "
            f"{type(model).__name__}"
        )
    return [by_id[id(p)] for p in params]


def optimizer_state(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each parameter's index replaced by ``names[index]``
    (see :func:`optimizer_parameter_names`). Reads only: the optimizer, its state and the
    parameters are left exactly as they were; the tensors are the live ones (not copies)."""
    saved = optimizer.state_dict()
    return {
        "state": {names[index]: value for index, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in saved["param_groups"]
        ],
    }


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Sequence[str], state: dict[str, Any], where: str
) -> None:
    """Load ``state`` (an :func:`optimizer_state` of the same parameter names, possibly read
    back: no ``"state"`` when none was saved) with ``optimizer.load_state_dict``; nothing
    steps. ``where`` names the checkpoint in errors."""
    index = {name: i for i, name in enumerate(names)}
    groups = state.get("param_groups", [])
    try:
        loaded = {
            "state": {index[name]: value for name, value in state.get("state", {}).items()},
            "param_groups": [
                {**group, "params": [index[name] for name in group["params"]]} for group in groups
            ],
        }
    except KeyError as error:
        raise CheckpointError(
            f"{where}: the saved optimizer state names parameter {error.args[0]!r}, which "
            "the optimizer does not update"
        ) from None
    try:
        optimizer.load_state_dict(loaded)
    except ValueError as error:
        raise CheckpointError(f"{where}: {error}") from error


def saved_subtree(path: str, key: str) -> Any:
    """A load target for everything saved under the top-level ``key`` of the committed
    checkpoint ``path``, built from its metadata alone: an empty CPU tensor of the saved
    shape and dtype for each tensor, ``None`` for each plain value (the load fills them),
    lists where the saved path has a list index. ``{}`` if nothing was saved under it."""
    metadata = FileSystemReader(path).read_metadata()
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    root: dict[Any, Any] = {}
    for name, md in metadata.state_dict_metadata.items():
        where = tuple(paths.get(name, (name,)))
        if where[0] != key:
            continue
        value = (
            torch.empty(tuple(md.size), dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata)
            else None
        )
        _place(root, where, value)
    return root.get(key, {})


def _place(root: dict[Any, Any], where: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at the nested path ``where``, making a list where the next element is
    a list index and a dict otherwise."""
    node: Any = root
    for i, part in enumerate(where):
        last = i == len(where) - 1
        child: Any = value if last else ([] if isinstance(where[i + 1], int) else {})
        if isinstance(node, list):
            while len(node) <= part:
                node.append(None)
            if last or node[part] is None:
                node[part] = child
        elif last or part not in node:
            node[part] = child
        node = node[part]
