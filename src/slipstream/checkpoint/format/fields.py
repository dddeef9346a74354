"""Typed reads of the JSON slipstream writes: the index on disk and the ranks' messages.

Invariant: every JSON object slipstream reads back is read through :class:`Fields`, so a
missing or mistyped field raises the error the caller names (``CheckpointError`` for a
message between ranks, ``CorruptCheckpointError`` for what is on disk) naming the message
and the field, never a ``KeyError`` or ``TypeError`` from deep inside a load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from ...core.flatten import ContainerRecord, Containers, KeyTypes
from ...errors import CheckpointError

_T = TypeVar("_T")


class Fields:
    """Typed reads of one JSON object's fields; a missing or mistyped field raises
    ``error`` naming the message (``what``) and the field."""

    def __init__(self, raw: object, what: str, error: type[CheckpointError]) -> None:
        self.what, self.error = what, error
        if not isinstance(raw, dict):
            raise error(f"{what}: expected a JSON object, got {type(raw).__name__}")
        self.raw: dict[str, Any] = raw

    def fail(self, name: str, why: str) -> CheckpointError:
        return self.error(f"{self.what}: field {name!r} {why}")

    def get(self, name: str, kind: type[_T] | tuple[type, ...], *, optional: bool = False) -> Any:
        if name not in self.raw:
            if optional:
                return None
            raise self.fail(name, "is missing")
        value = self.raw[name]
        if value is None and optional:
            return None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(name, f"should be {names}, got {type(value).__name__}: {value!r:.80}")
        return value

    def each(self, name: str, read: Callable[[str, Any], _T]) -> dict[str, _T]:
        """The object at ``name`` read entry by entry; ``read``'s own errors name the entry."""
        return {
            key: read(f"{self.what}: {name}[{key!r}]", v) for key, v in self.get(name, dict).items()
        }


def int_list(raw: object, what: str, error: type[CheckpointError]) -> list[int]:
    if not isinstance(raw, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in raw
    ):
        raise error(f"{what}: expected a list of integers, got {raw!r:.80}")
    return raw


def read_key_types(raw: dict[str, Any], what: str, error: type[CheckpointError]) -> KeyTypes:
    """A :data:`KeyTypes` table read back: each key's list of type names (or nulls)."""
    for key, types in raw.items():
        if not isinstance(types, list) or not all(t is None or isinstance(t, str) for t in types):
            raise error(f"{what}: field 'key_types': entry {key!r} is not a list of type names")
    return raw


def containers_to_dict(containers: Containers) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name, rec in containers.items():
        entry: dict[str, Any] = {"path": list(rec.path), "type": rec.type}
        if rec.key_types:
            entry["key_types"] = list(rec.key_types)
        if rec.after is not None:
            entry["after"] = rec.after
        body[name] = entry
    return body


def read_containers(raw: dict[str, Any], what: str, error: type[CheckpointError]) -> Containers:
    """A :data:`Containers` table read back, each entry checked."""
    found: Containers = {}
    for name, entry in raw.items():
        where = f"{what}: field 'containers': entry {name!r}"
        f = Fields(entry, where, error)
        path = f.get("path", list)
        if not path or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
            raise f.fail("path", "is not a non-empty list of keys and indices")
        kinds = f.get("key_types", list, optional=True) or []
        if not all(k is None or isinstance(k, str) for k in kinds):
            raise f.fail("key_types", "is not a list of type names")
        found[name] = ContainerRecord(
            tuple(path), f.get("type", str), tuple(kinds), f.get("after", str, optional=True)
        )
    return found


def decode_json(text: str | bytes, what: str, error: type[CheckpointError]) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from exc
