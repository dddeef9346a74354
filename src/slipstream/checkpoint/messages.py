"""The checkpoint's own messages: what the ranks of a save tell each other, and the index.

Every message that crosses the job's store during a save is one of the dataclasses below,
posted under a topic :class:`Topics` builds (relative to the saver's channel, see
:mod:`.channel`); slipstream's index (``.slipstream.json``) is :class:`CheckpointIndex`. A
save, round by round (``seq`` counts saves identically on every rank):

1. planning, on a layout's first save: each rank posts its :class:`LayoutReport` at
   ``{seq}/layout`` and every rank gathers them all;
2. each rank writes its file and posts its :class:`WriteReport` at ``{seq}/done``;
3. rank 0 gathers them, commits, and posts the :class:`CommitOutcome` at ``{seq}/commit``;
4. a ``Checkpointer`` that skips saves while one is running posts rank 0's
   :class:`SkipDecision` for step ``s`` at ``skip/{s}`` first.

A rank that fails before its turn posts the same message with ``error`` set, so no rank
waits for it until the timeout.

The local tier's messages (topics ``tier/...``, also built here) are in
:mod:`.tier_messages`.

Invariant: each message is written by ``to_json`` and read by ``from_json`` of its own
class, nowhere else; a malformed one raises an error naming the message and the field
(``CheckpointError`` for the ranks' messages, ``CorruptCheckpointError`` for the index,
whose records are each checked when a load first reads them). The index keeps the on-disk
shape of its version 1: checkpoints written before this module read the same, a field it
adds must be optional, and fields a newer writer adds are kept, unread, in ``extra``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ..core.checksum import ALGORITHM, BLOCK_BYTES
from ..core.control_plane import store_key
from ..core.flatten import ContainerRecord, Containers, KeyTypes, Path
from ..errors import CheckpointError, CorruptCheckpointError
from .layout import ChunkSpec, LocalLayout

INDEX_FORMAT = "slipstream-index"
INDEX_VERSION = 1

_T = TypeVar("_T")


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

    # the local tier's (their messages: :mod:`.tier_messages`)

    @staticmethod
    def tier_host() -> str:
        return store_key("tier", "host")

    @staticmethod
    def tier_address() -> str:
        return store_key("tier", "address")

    @staticmethod
    def tier_clear(step: int) -> str:
        return store_key("tier", "clear", step)

    @staticmethod
    def tier_replicated(step: int) -> str:
        return store_key("tier", "replicated", step)

    @staticmethod
    def tier_commit(step: int) -> str:
        return store_key("tier", "commit", step)

    @staticmethod
    def tier_inventory(round_: int) -> str:
        return store_key("tier", "inventory", round_)

    @staticmethod
    def tier_loaded(round_: int) -> str:
        return store_key("tier", "loaded", round_)


class _Fields:
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


def _int_list(raw: object, what: str, error: type[CheckpointError]) -> list[int]:
    if not isinstance(raw, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in raw
    ):
        raise error(f"{what}: expected a list of integers, got {raw!r:.80}")
    return raw


def _key_types(raw: dict[str, Any], what: str, error: type[CheckpointError]) -> KeyTypes:
    """A :data:`KeyTypes` table read back: each key's list of type names (or nulls)."""
    for key, types in raw.items():
        if not isinstance(types, list) or not all(t is None or isinstance(t, str) for t in types):
            raise error(f"{what}: field 'key_types': entry {key!r} is not a list of type names")
    return raw


def _containers_to_dict(containers: Containers) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name, rec in containers.items():
        entry: dict[str, Any] = {"path": list(rec.path), "type": rec.type}
        if rec.key_types:
            entry["key_types"] = list(rec.key_types)
        if rec.after is not None:
            entry["after"] = rec.after
        body[name] = entry
    return body


def _containers(raw: dict[str, Any], what: str, error: type[CheckpointError]) -> Containers:
    """A :data:`Containers` table read back, each entry checked."""
    found: Containers = {}
    for name, entry in raw.items():
        where = f"{what}: field 'containers': entry {name!r}"
        f = _Fields(entry, where, error)
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


def _decode(text: str | bytes, what: str, error: type[CheckpointError]) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error(f"{what}: not valid JSON ({exc})") from exc


# -- the ranks' messages during a save ---------------------------------------------------


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
            "containers": _containers_to_dict(self.containers),
        }

    @classmethod
    def from_dict(cls, raw: object, what: str) -> LayoutDescription:
        f = _Fields(raw, what, CheckpointError)
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
                    tuple(_int_list(shape, where, CheckpointError)),
                    tuple(_int_list(offsets, where, CheckpointError)),
                    tuple(_int_list(sizes, where, CheckpointError)),
                    bool(replicated),
                )
            )
        values = [str(v) for v in f.get("values", list)]
        paths: dict[str, Path] = {}
        for key, path in f.get("paths", dict).items():
            if not isinstance(path, list) or not all(isinstance(p, (str, int)) for p in path):
                raise f.fail("paths", f"entry {key!r} is not a list of keys and indices")
            paths[key] = tuple(path)
        key_types = _key_types(f.get("key_types", dict, optional=True) or {}, what, CheckpointError)
        containers = _containers(
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
        f = _Fields(_decode(text, what, CheckpointError), what, CheckpointError)
        error = f.get("error", str, optional=True)
        if error is not None:
            return cls(error=error)
        desc = LayoutDescription.from_dict(f.get("desc", dict), f"{what}: desc")
        return cls(f.get("fp", str), desc)


@dataclass(frozen=True, slots=True)
class ValueEntry:
    """Where one plain value's pickled bytes are, and their checksum (index and reports)."""

    file: str
    offset: int
    length: int
    checksum: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "checksum": self.checksum,
        }

    @classmethod
    def from_dict(cls, what: str, raw: object, error: type[CheckpointError]) -> ValueEntry:
        f = _Fields(raw, what, error)
        return cls(
            f.get("file", str), f.get("offset", int), f.get("length", int), f.get("checksum", int)
        )


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
        f = _Fields(_decode(text, what, CheckpointError), what, CheckpointError)
        fingerprint = f.get("fingerprint", str, optional=True)
        error = f.get("error", str, optional=True)
        if error is not None:
            return cls(fingerprint, error=error)
        records = f.each("records", lambda w, v: _int_list(v, w, CheckpointError))
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
        f = _Fields(_decode(text, what, CheckpointError), what, CheckpointError)
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
            _Fields(_decode(text, what, CheckpointError), what, CheckpointError).get("skip", bool)
        )


# -- slipstream's index ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IndexRecord:
    """One tensor record of a data file: where its zip entry and its raw bytes are, and
    the checksums of its ``block_bytes`` blocks."""

    offset: int
    length: int
    data_offset: int
    nbytes: int
    blocks: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "length": self.length,
            "data_offset": self.data_offset,
            "nbytes": self.nbytes,
            "blocks": self.blocks,
        }

    @classmethod
    def from_dict(cls, what: str, raw: object) -> IndexRecord:
        # An index holds a record per saved chunk: the well-formed case is checked inline,
        # and only a record that fails it is read field by field for the error.
        if type(raw) is dict:
            offset, length, blocks = raw.get("offset"), raw.get("length"), raw.get("blocks")
            data_offset, nbytes = raw.get("data_offset"), raw.get("nbytes")
            if (
                type(offset) is int
                and type(length) is int
                and type(data_offset) is int
                and type(nbytes) is int
                and type(blocks) is list
                and all(type(b) is int for b in blocks)
            ):
                return cls(offset, length, data_offset, nbytes, blocks)
        f = _Fields(raw, what, CorruptCheckpointError)
        blocks = _int_list(f.get("blocks", list), f"{what}: blocks", CorruptCheckpointError)
        return cls(
            f.get("offset", int),
            f.get("length", int),
            f.get("data_offset", int),
            f.get("nbytes", int),
            blocks,
        )


def _entry_dict(entry: object) -> dict[str, Any]:
    if isinstance(entry, (IndexRecord, ValueEntry)):
        return entry.to_dict()
    raise TypeError(f"{type(entry).__name__} is not part of a slipstream index")


class RecordTable(Mapping[str, IndexRecord]):
    """One data file's records as an index read from disk holds them: each is read, and
    checked, when first asked for. An index has a record per saved chunk and a load reads
    only the ones it needs; building every record up front would churn the garbage
    collector for nothing."""

    def __init__(self, raw: dict[str, Any], what: str) -> None:
        self._raw, self._what = raw, what
        self._read: dict[str, IndexRecord] = {}

    def __getitem__(self, key: str) -> IndexRecord:
        rec = self._read.get(key)
        if rec is None:
            rec = IndexRecord.from_dict(f"{self._what}[{key!r}]", self._raw[key])
            self._read[key] = rec
        return rec

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)


@dataclass
class CheckpointIndex:
    """``.slipstream.json``: every record's raw data offset and block checksums by data
    file and record key, every plain value's place and checksum, and the ``save_id`` of
    the ``.metadata`` it was written with (a reader trusts it for that one only)."""

    records: Mapping[str, Mapping[str, IndexRecord]]
    values: dict[str, ValueEntry]
    block_bytes: int = BLOCK_BYTES
    checksum: str = ALGORITHM
    version: int = INDEX_VERSION
    save_id: str | None = None
    key_types: KeyTypes | None = None
    """The types of non-string keys (see :data:`~slipstream.core.flatten.KeyTypes`), for
    ``load_all``; absent in checkpoints written before it was recorded."""
    containers: Containers | None = None
    """The empty and non-``dict`` mappings (see :data:`~slipstream.core.flatten.Containers`),
    for ``load_all``; absent in checkpoints written before they were recorded."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know (a newer writer's), kept as they were."""

    def to_json(self) -> bytes:
        body: dict[str, Any] = {
            "format": INDEX_FORMAT,
            "version": self.version,
            "checksum": self.checksum,
            "block_bytes": self.block_bytes,
            "records": {file: dict(recs) for file, recs in self.records.items()},
            "values": self.values,
        }
        if self.save_id is not None:
            body["save_id"] = self.save_id
        if self.key_types:
            body["key_types"] = self.key_types
        if self.containers:
            body["containers"] = _containers_to_dict(self.containers)
        # Records become dicts one at a time as the encoder reaches them, each freed at
        # once: a commit on a background thread must not leave a burst of live objects.
        return json.dumps({**self.extra, **body}, default=_entry_dict).encode()

    @classmethod
    def from_json(cls, data: str | bytes, what: str) -> CheckpointIndex:
        raw = _decode(data, what, CorruptCheckpointError)
        f = _Fields(raw, what, CorruptCheckpointError)
        if f.get("format", str, optional=True) != INDEX_FORMAT:
            raise CorruptCheckpointError(f"{what} is not a slipstream index")

        def file_records(where: str, recs: object) -> RecordTable:
            if not isinstance(recs, dict):
                raise CorruptCheckpointError(f"{where}: expected a JSON object")
            return RecordTable(recs, where)

        known = {
            "format",
            "version",
            "checksum",
            "block_bytes",
            "records",
            "values",
            "save_id",
            "key_types",
            "containers",
        }
        key_types = f.get("key_types", dict, optional=True)
        containers = f.get("containers", dict, optional=True)
        return cls(
            records=f.each("records", file_records),
            values=f.each(
                "values", lambda w, v: ValueEntry.from_dict(w, v, CorruptCheckpointError)
            ),
            block_bytes=f.get("block_bytes", int),
            checksum=f.get("checksum", str, optional=True) or ALGORITHM,
            version=f.get("version", int, optional=True) or INDEX_VERSION,
            save_id=f.get("save_id", str, optional=True),
            key_types=_key_types(key_types, what, CorruptCheckpointError) if key_types else None,
            containers=(
                _containers(containers, what, CorruptCheckpointError) if containers else None
            ),
            extra={k: v for k, v in f.raw.items() if k not in known},
        )
