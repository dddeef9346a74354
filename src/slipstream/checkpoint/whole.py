"""A whole checkpoint as the nested dict it was saved from, without a template.

Invariant: every entry of the checkpoint is read (tensors whole, on the CPU, their checksums
verified where the checkpoint has them) and placed at the path it was saved at. Mapping
keys come back with the type slipstream recorded at save (``int`` keys of an optimizer's
``state``; a ``"0"`` key stays a string); a checkpoint without that record (one DCP wrote,
or slipstream before it recorded key types) comes back as DCP's ``dcp_to_torch_save``
gives it: mapping keys as strings, lists as lists.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.flatten import KeyTypes, Path
from ..errors import CorruptCheckpointError
from .loader import load_from
from .reader import CheckpointReader
from .safe_types import Trust, Trusted
from .storage import Location

_KEY_TYPES: dict[str, type] = {"int": int, "float": float}


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


def _place(
    root: dict[Any, Any], path: Path, kinds: list[str | None], value: Any, name: str
) -> None:
    """Put ``value`` at ``path`` (list indices as ``int``), making the containers on the
    way: a list where the next element is a list index, a dict otherwise."""
    node: Any = root
    keys = [_typed_key(k, kinds[i] if i < len(kinds) else None, name) for i, k in enumerate(path)]
    for i, key in enumerate(keys[:-1]):
        empty: Any = [] if isinstance(path[i + 1], int) else {}
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = empty
        elif key not in node:
            node[key] = empty
        node = node[key]
    last = keys[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


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
    for key, value in flat.items():
        _place(nested, tuple(paths.get(key, (key,))), key_types.get(key, []), value, key)
    return nested
