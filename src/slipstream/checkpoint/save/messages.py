"""What the ranks of a save tell each other through the job's store.

Every message that crosses the job's store during a save is one of the dataclasses below,
posted under a topic :class:`Topics` builds (relative to the saver's channel, see
:mod:`.channel`). A save, round by round (``seq`` counts saves identically on every rank):

1. planning, on a layout's first save: each rank posts its :class:`LayoutReport` at
   ``{seq}/layout`` and every rank gathers them all;
2. each rank writes its file and posts its :class:`WriteReport` at ``{seq}/done``;
3. rank 0 gathers them, commits, and posts the :class:`CommitOutcome` at ``{seq}/commit``;
4. a ``Checkpointer`` that skips saves while one is running posts rank 0's
   :class:`SkipDecision` for step ``s`` at ``skip/{s}`` first.

A rank that fails before its turn posts the same message with ``error`` set, so no rank
waits for it until the timeout. The local tier's messages are in :mod:`..tier.messages`,
slipstream's index in :mod:`..format.index`.

Invariant: each message is written by ``to_json`` and read by ``from_json`` of its own
class, nowhere else; a malformed one raises ``CheckpointError`` naming the message and the
field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ...core.control_plane import store_key
from ...core.flatten import Containers, KeyTypes, Path
from ...errors import CheckpointError
from ..format.fields import (
    Fields,
    containers_to_dict,
    decode_json,
    int_list,
    read_containers,
    read_key_types,
)
from ..format.index import ValueEntry
from .layout import ChunkSpec, LocalLayout


class Topics:
    """Every topic a save's ranks post under (relative to their channel's namespace)."""

    @staticmethod
    def layout(seq: int) -> str:
        return store_key(seq, "layout")

    @staticmethod
    def written(seq: int) -> str:
        return store_key(seq, "done")

    @staticmethod
    def commit(seq: int) -> str:
        return store_key(seq, "commit")

    @staticmethod
    def skip(step: int) -> str:
        return store_key("skip", step)


@dataclass(frozen=True)
class LayoutDescription:
    """What a rank saves, as planning needs it from every rank: its tensor chunks, the keys
    of its plain values, and the nested path of every key (DCP's ``planner_data``)."""

    chunks: list[ChunkSpec]
    values: list[str]
    paths: dict[str, Path]
    key_types: KeyTypes = field(default_factory=dict)
    containers: Containers = field(default_factory=dict)

    @classmethod
    def of(cls, layout: LocalLayout) -> LayoutDescription:
        return cls(
            list(layout.chunks),
            list(layout.values),
            dict(layout.paths),
            dict(layout.key_types),
            dict(layout.containers),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunks": [
                [c.fqn, c.dtype, list(c.global_shape), list(c.offsets), list(c.sizes), c.replicated]
                for c in self.chunks
            ],
            "values": list(self.values),
            "paths": {k: list(v) for k, v in self.paths.items()},
            "key_types": self.key_types,
            "containers": containers_to_dict(self.containers),
        }

    @classmethod
    def from_dict(cls, raw: object, what: str) -> LayoutDescription:
        f = Fields(raw, what, CheckpointError)
        chunks = []
        for i, c in enumerate(f.get("chunks", list)):
            if not (isinstance(c, list) and len(c) == 6):
                raise f.fail(
                    "chunks", f"entry {i} is not [fqn, dtype, shape, offsets, sizes, replicated]"
                )
            fqn, dtype, shape, offsets, sizes, replicated = c
            where = f"{what}: chunks[{i}]"
            chunks.append(
                ChunkSpec(
                    str(fqn),
                    str(dtype),
                    tuple(int_list(shape, where, CheckpointError)),
                    tuple(int_list(offsets, where, CheckpointError)),
                    tuple(int_list(sizes, where, CheckpointError)),
                    bool(replicated),
                )
            )
        values = [str(v) for v in f.get("values", list)]
        paths: dict[str, Path] = {}
        for key, path in f.get("paths", dict).items():
            if not isinstance(path, list) or not all(isinstance(p, (str, int)) for p in path):
                raise f.fail("paths", f"entry {key!r} is not a list of keys and indices")
            paths[key] = tuple(path)
        key_types = read_key_types(
            f.get("key_types", dict, optional=True) or {}, what, CheckpointError
        )
        containers = read_containers(
            f.get("containers", dict, optional=True) or {}, what, CheckpointError
        )
        return cls(chunks, values, paths, key_types, containers)


@dataclass(frozen=True)
class LayoutReport:
    """A rank's layout for planning (or why it could not take part in this save)."""

    fingerprint: str | None = None
    description: LayoutDescription | None = None
    error: str | None = None

    def to_json(self) -> str:
        desc = None if self.description is None else self.description.to_dict()
        return json.dumps({"fp": self.fingerprint, "desc": desc, "error": self.error})

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> LayoutReport:
        f = Fields(decode_json(text, what, CheckpointError), what, CheckpointError)
        error = f.get("error", str, optional=True)
        if error is not None:
            return cls(error=error)
        desc = LayoutDescription.from_dict(f.get("desc", dict), f"{what}: desc")
        return cls(f.get("fp", str), desc)


@dataclass(frozen=True)
class WriteReport:
    """A rank's file is written (or why not): the block checksums of each record it wrote
    (by record key), and where its plain values are."""

    fingerprint: str | None
    records: dict[str, list[int]] = field(default_factory=dict)
    values: dict[str, ValueEntry] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "fingerprint": self.fingerprint,
                "records": self.records,
                "values": {fqn: v.to_dict() for fqn, v in self.values.items()},
                "error": self.error,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> WriteReport:
        f = Fields(decode_json(text, what, CheckpointError), what, CheckpointError)
        fingerprint = f.get("fingerprint", str, optional=True)
        error = f.get("error", str, optional=True)
        if error is not None:
            return cls(fingerprint, error=error)
        records = f.each("records", lambda w, v: int_list(v, w, CheckpointError))
        values = f.each("values", lambda w, v: ValueEntry.from_dict(w, v, CheckpointError))
        return cls(fingerprint, records, values)


@dataclass(frozen=True)
class CommitOutcome:
    """Rank 0's decision: committed (with the ``save_id`` of the ``.metadata`` it put), or
    failed, and whether because a rank timed out or died."""

    error: str | None = None
    save_id: str | None = None
    timeout: bool = False
    dead: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> CommitOutcome:
        f = Fields(decode_json(text, what, CheckpointError), what, CheckpointError)
        error = f.get("error", str, optional=True)
        if error is not None:
            timeout = bool(f.get("timeout", bool, optional=True))
            return cls(error, timeout=timeout, dead=bool(f.get("dead", bool, optional=True)))
        return cls(save_id=f.get("save_id", str))


@dataclass(frozen=True)
class SkipDecision:
    """Rank 0's decision whether every rank skips a ``Checkpointer``'s save of a step."""

    skip: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> SkipDecision:
        return cls(
            Fields(decode_json(text, what, CheckpointError), what, CheckpointError).get(
                "skip", bool
            )
        )


@dataclass(frozen=True)
class PlanView:
    """Rank 0's answer to one rank's layout on a layout's first save: what that rank writes
    (its records, its file's size, the plain values it owns) and its layout's fingerprint;
    the rest of the plan (every rank's records, the tensors' metadata) stays on rank 0,
    which alone commits."""

    world_size: int
    fingerprint: str
    image_bytes: int
    records: list[list[Any]]
    """Each record as ``[fqn, dtype, shape, offsets, sizes, replicated, offset, length,
    data_offset, nbytes]``."""
    values: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> PlanView:
        f = Fields(decode_json(text, what, CheckpointError), what, CheckpointError)
        records = f.get("records", list)
        for i, rec in enumerate(records):
            if not (isinstance(rec, list) and len(rec) == 10):
                raise f.fail("records", f"entry {i} is not a record of 10 fields")
        return cls(
            f.get("world_size", int),
            f.get("fingerprint", str),
            f.get("image_bytes", int),
            records,
            [str(v) for v in f.get("values", list)],
        )
