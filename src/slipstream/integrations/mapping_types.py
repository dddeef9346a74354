"""What DCP's flattening drops from a nested state dict, recorded beside it and put back.

A DCP checkpoint keeps leaves at their paths, so a loaded state dict has plain ``dict``
mappings and no empty ones. :func:`record` lists, by path, every mapping of the state that
is empty or not a plain ``dict`` (a module's ``OrderedDict`` state dict, omegaconf's
``DictConfig``, Lightning's ``AttributeDict``); :func:`restore` rebuilds them in a loaded
state. Invariant: only the types in :data:`REBUILDERS` are rebuilt (each from the loaded
``dict``, in its order); any other mapping stays a ``dict``, so a record never names code
that loading would run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

import torch

RECORD_KEY = "slipstream_mapping_types"
"""The key of the record in a saved state dict (a tuple of ``(path, type name)``)."""


def _omegaconf_dict(content: dict[Any, Any]) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(content)


def _attribute_dict(content: dict[Any, Any]) -> Any:
    from lightning.fabric.utilities.data import AttributeDict

    return AttributeDict(content)


REBUILDERS: dict[str, Callable[[dict[Any, Any]], Any]] = {
    "builtins.dict": dict,
    "collections.OrderedDict": collections.OrderedDict,
    "omegaconf.dictconfig.DictConfig": _omegaconf_dict,
    "lightning.fabric.utilities.data.AttributeDict": _attribute_dict,
}

Path = tuple[Any, ...]


def _name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def record(state: Mapping[Any, Any]) -> tuple[tuple[Path, str], ...]:
    """``(path, type name)`` of each mapping below ``state`` that is empty or not a ``dict``."""
    found: list[tuple[Path, str]] = []

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            return
        if isinstance(value, Mapping):
            if path and (type(value) is not dict or not value):
                found.append((path, _name(value)))
            for k, v in value.items():
                visit(path + (k,), v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                visit(path + (i,), v)

    visit((), state)
    return tuple(found)


def restore(state: dict[Any, Any], recorded: tuple[tuple[Path, str], ...]) -> None:
    """Rebuild, in ``state``, the mappings :func:`record` listed; children first, so that a
    rebuilt mapping holds its rebuilt children."""
    for path, name in reversed(recorded):
        rebuild = REBUILDERS.get(name)
        parent: Any = state
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        present = (last < len(parent)) if isinstance(parent, list) else (last in parent)
        content = parent[last] if present and parent[last] is not None else {}
        if rebuild is None or not isinstance(content, Mapping):
            if not present:
                parent[last] = {}
            continue
        parent[last] = rebuild(dict(content))
