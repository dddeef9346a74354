"""A whole checkpoint as the nested dict it was saved from, without a template.

Invariant: every entry of the checkpoint is read (tensors whole, on the CPU, their checksums
verified where the checkpoint has them) and placed at the path it was saved at. Mapping
keys come back with the type slipstream recorded at save (``int`` keys of an optimizer's
``state``; a ``"0"`` key stays a string), and the mappings it recorded (empty ones, and
those not a plain ``dict``) come back in their place, in their saved order, as their type
if :mod:`..format.containers` allows it, as a ``dict`` otherwise. A checkpoint without those
records (one DCP wrote, or slipstream before it recorded them) comes back as DCP's
``dcp_to_torch_save`` gives it: mapping keys as strings, every mapping a ``dict``, empty
ones gone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...core.flatten import KEY_TYPES, ContainerRecord, Containers, KeyTypes, Path
from ...errors import CorruptCheckpointError
from ..format import containers as container_types
from ..format.safe_types import Trust, Trusted
from ..storage import Location
from .loader import load_from
from .reader import CheckpointReader

_KEY_TYPES: dict[str, type] = {name: kind for kind, name in KEY_TYPES.items() if kind is not bool}
"""The recorded key types parsed by calling the type (a bool's key is parsed apart)."""


def _typed_key(key: str | int, kind: str | None, name: str) -> Any:
    """``key`` as it was saved: a list index, a string, or the recorded type's value."""
    if isinstance(key, int) or kind is None:
        return key
    if kind == "bool":
        if key not in ("True", "False"):
            raise CorruptCheckpointError(f"{name!r}: key {key!r} recorded as a bool")
        return key == "True"
    convert = _KEY_TYPES.get(kind)
    if convert is None:
        raise CorruptCheckpointError(f"{name!r}: unknown recorded key type {kind!r}")
    try:
        return convert(key)
    except ValueError:
        raise CorruptCheckpointError(f"{name!r}: key {key!r} recorded as {kind}") from None


def _typed_keys(path: Path, kinds: Sequence[str | None], name: str) -> list[Any]:
    return [_typed_key(k, kinds[i] if i < len(kinds) else None, name) for i, k in enumerate(path)]


def _place(
    root: dict[Any, Any],
    path: Path,
    kinds: Sequence[str | None],
    value: Any,
    name: str,
    *,
    keep: bool = False,
) -> None:
    """Put ``value`` at ``path`` (list indices as ``int``), making the containers on the
    way: a list where the next element is a list index, a dict otherwise. ``keep``: leave
    a value already there."""
    node: Any = root
    keys = _typed_keys(path, kinds, name)
    for i, key in enumerate(keys[:-1]):
        empty: Any = [] if isinstance(path[i + 1], int) else {}
        if not isinstance(node, (list, dict)):
            raise CorruptCheckpointError(f"{name!r}: its path {list(path)} runs through a value")
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = empty
        elif key not in node:
            node[key] = empty
        node = node[key]
    last = keys[-1]
    if not isinstance(node, (list, dict)):
        raise CorruptCheckpointError(f"{name!r}: its path {list(path)} runs through a value")
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
        if keep and node[last] is not None:
            return
    elif keep and last in node:
        return
    node[last] = value


def _misplaced(name: str, rec: ContainerRecord) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"recorded mapping {name!r}: its path {list(rec.path)} does not lead to a mapping"
    )


def _place_all(
    nested: dict[Any, Any],
    flat: dict[str, Any],
    paths: dict[str, Path],
    key_types: KeyTypes,
    containers: Containers,
) -> None:
    """Place the leaves and the recorded mappings in their saved (depth-first) order: each
    mapping right after the leaf it was recorded after, before its own entries."""
    following: dict[str | None, list[tuple[str, ContainerRecord]]] = {}
    unanchored: list[tuple[str, ContainerRecord]] = []  # after a leaf not in the checkpoint: last
    for name, rec in containers.items():
        if rec.after is None or rec.after in flat:
            following.setdefault(rec.after, []).append((name, rec))
        else:
            unanchored.append((name, rec))

    def place_mappings(records: list[tuple[str, ContainerRecord]]) -> None:
        for name, rec in records:
            try:
                _place(nested, rec.path, rec.key_types, {}, name, keep=True)
            except (TypeError, KeyError, IndexError, AttributeError):
                raise _misplaced(name, rec) from None

    place_mappings(following.pop(None, []))
    for key in [*(k for k in paths if k in flat), *(k for k in flat if k not in paths)]:
        _place(nested, tuple(paths.get(key, (key,))), key_types.get(key, []), flat[key], key)
        place_mappings(following.pop(key, []))
    place_mappings(unanchored)


def _rebuild(nested: dict[Any, Any], containers: Containers) -> None:
    """Turn each recorded mapping into its type, children before their parents (so that a
    rebuilt mapping holds its rebuilt children)."""
    for name, rec in sorted(containers.items(), key=lambda item: -len(item[1].path)):
        *parents, last = _typed_keys(rec.path, rec.key_types, name)
        node: Any = nested
        try:
            for key in parents:
                node = node[key] if isinstance(node, (list, dict)) else None
            if not isinstance(node, (list, dict)):
                raise _misplaced(name, rec)
            content = node[last]
        except (TypeError, KeyError, IndexError):
            raise _misplaced(name, rec) from None
        if type(content) is dict:
            node[last] = container_types.rebuild(rec.type, content)
        elif not isinstance(content, Mapping):
            raise _misplaced(name, rec)


def load_all(
    checkpoint_id: Location,
    *,
    trusted: Trusted = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[Any, Any]:
    """Every entry of a committed checkpoint (slipstream- or DCP-written, local or on
    object storage) in the nested dict it was saved from: tensors whole on the CPU, plain
    values unpickled through the allow-list (``trusted`` as for :func:`~slipstream.load`).
    """
    reader = CheckpointReader(checkpoint_id, storage_options, Trust.of(trusted))
    metadata = reader.metadata
    key_types: KeyTypes = (reader.index.key_types if reader.index else None) or {}
    containers: Containers = (reader.index.containers if reader.index else None) or {}
    paths: dict[str, Path] = (
        metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    )
    flat: dict[str, Any] = {}
    try:
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                flat[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            else:
                flat[key] = None
    except BaseException:
        reader.close()
        raise
    load_from(reader, flat)  # closes the reader
    nested: dict[Any, Any] = {}
    _place_all(nested, flat, paths, key_types, containers)
    _rebuild(nested, containers)
    return nested
