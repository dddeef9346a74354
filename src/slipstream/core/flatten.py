"""Flattening of nested state dicts, with the same rules and names as PyTorch DCP.

Mappings are always descended into (keys become strings); a list is descended into only
when it holds a tensor or a non-leaf container; tuples and everything else are leaves. A
leaf's flat name is its path joined with dots, e.g. ``("optim", "state", 0, "exp_avg")``
becomes ``"optim.state.0.exp_avg"``. Keeping DCP's rules is what lets ``dcp.load`` read
what slipstream writes and the other way round.

DCP's names and paths keep no key types (an ``int`` key becomes ``"0"``, as a ``"0"`` key
does), no mapping types and no empty mappings (only leaves have names). :func:`flatten` can
report both on the side (:data:`KeyTypes`, :data:`Containers`), for a reader that wants the
original state back (``load_all``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

Path = tuple[str | int, ...]

KEY_TYPES: dict[type, str] = {int: "int", bool: "bool", float: "float"}
"""The non-string mapping keys whose type is recorded, by the name recorded."""
KeyTypes = dict[str, list[str | None]]
"""Flat name -> per element of its path, the recorded type of a mapping key that was not a
string (``None`` for a string key or a list index); only names with such a key appear."""


@dataclass(frozen=True)
class ContainerRecord:
    """A mapping that flattening would lose: one that is empty (it has no leaf) or whose
    type is not ``dict`` (it would come back as one)."""

    path: Path
    type: str
    """Its class as ``"module.qualname"``: a name to look up, never to import."""
    key_types: tuple[str | None, ...] = ()
    """The recorded types of its path's keys, as a :data:`KeyTypes` entry; empty if none."""
    after: str | None = None
    """The flat name of the last leaf before it, depth first (``None``: it comes first), so
    that a reader puts an empty mapping back in its place among its siblings."""


Containers = dict[str, ContainerRecord]
"""Flat name -> the mapping at that name (see :class:`ContainerRecord`); only mappings
that are empty or not a plain ``dict`` appear."""


def type_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, answered at once for the common ``dict`` (the ABC
    check is several times slower, and it is paid per tensor per save)."""
    return type(value) is dict or (
        not isinstance(value, torch.Tensor) and isinstance(value, Mapping)
    )


def _is_leaf(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if _is_mapping(value):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, torch.Tensor):
            return False
        if (isinstance(entry, list) or _is_mapping(entry)) and not _is_leaf(entry):
            return False
    return True


def flatten(
    state_dict: Mapping[str, Any],
    key_types: KeyTypes | None = None,
    containers: Containers | None = None,
) -> tuple[dict[str, Any], dict[str, Path]]:
    """Return ``(flat, paths)``: flat name -> leaf value, flat name -> original path.

    Given ``key_types``, fill it with the types of the non-string keys (see :data:`KeyTypes`);
    given ``containers``, with the mappings below the top level that are empty or not a
    plain ``dict`` (see :data:`Containers`).
    """
    flat: dict[str, Any] = {}
    paths: dict[str, Path] = {}
    typed: dict[int, str] = {}  # depth -> recorded type of the key at that depth, on the way
    last_leaf: list[str | None] = [None]

    def visit(path: Path, name: str, value: Any) -> None:
        if _is_mapping(value):
            if containers is not None and (type(value) is not dict or not value):
                own = tuple(typed.get(depth) or None for depth in range(len(path)))
                containers[name] = ContainerRecord(
                    path, type_name(value), own if any(own) else (), last_leaf[0]
                )
            for k, v in value.items():
                if type(k) is str:
                    visit(path + (k,), f"{name}.{k}", v)
                else:
                    key = str(k)
                    typed[len(path)] = KEY_TYPES.get(type(k), "")
                    visit(path + (key,), f"{name}.{key}", v)
                    del typed[len(path)]
        elif _is_leaf(value):
            if name in flat:
                raise ValueError(f"two entries of the state dict flatten to the same key {name!r}")
            flat[name] = value
            paths[name] = path
            last_leaf[0] = name
            if typed and key_types is not None:
                kinds = [typed.get(depth) or None for depth in range(len(path))]
                if any(kinds):
                    key_types[name] = kinds
        else:
            for i, v in enumerate(value):
                visit(path + (i,), f"{name}.{i}", v)

    for key, value in state_dict.items():
        if type(key) is str:
            visit((key,), key, value)
        else:
            typed[0] = KEY_TYPES.get(type(key), "")
            visit((str(key),), str(key), value)
            del typed[0]
    return flat, paths


def _existing_key(node: Any, key: str | int) -> Any:
    """The key of mapping ``node`` that ``key`` (a path element: keys as strings) names:
    ``key`` itself, or an existing non-string key whose string it is (``0`` for ``"0"``)."""
    if key in node or not isinstance(key, str):
        return key
    return next((k for k in node if type(k) is not str and str(k) == key), key)


def _same_key(node: Any, key: str | int) -> Any:
    return key


def set_path(
    root: dict[str, Any], path: Path, value: Any, *, match_typed_keys: bool = False
) -> None:
    """Set ``value`` at ``path`` in nested containers, creating dicts and lists as needed.
    With ``match_typed_keys``, an existing non-string mapping key is found by its string (a
    path holds keys as strings): for filling a caller's state dict, not for building a new
    tree (the lookup scans the mapping's keys)."""
    find = _existing_key if match_typed_keys else _same_key
    node: Any = root
    for here, nxt in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            assert isinstance(here, int), f"list index {here!r} in path {path}"
            while len(node) <= here:
                node.append(None)
            if node[here] is None:
                node[here] = [] if isinstance(nxt, int) else {}
            node = node[here]
        else:
            key = find(node, here)
            if key not in node:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
    last = path[-1]
    if isinstance(node, list):
        assert isinstance(last, int), f"list index {last!r} in path {path}"
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[find(node, last)] = value


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, Path]) -> dict[str, Any]:
    """Inverse of :func:`flatten`."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        set_path(root, paths[name], value)
    return root


_PLAIN_TYPES = frozenset({dict, list, tuple, int, float, bool, str, bytes, type(None)})


def is_stateful(value: Any) -> bool:
    """``isinstance(value, Stateful)``, answered at once for tensors and containers.

    ``Stateful`` is a runtime-checkable protocol whose check walks the class with
    ``inspect.getattr_static``, slow enough per value to dominate the time ``async_save``
    blocks its caller on a flat state dict of many tensors.
    """
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_TYPES:
        return False
    return isinstance(value, Stateful)


def resolve_stateful(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Replace top-level Stateful objects by their ``state_dict()`` (as DCP does)."""
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}
