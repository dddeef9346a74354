"""slipstream's index, ``.slipstream.json``: checksums and places beside DCP's ``.metadata``.

Invariant: the index is written by :meth:`CheckpointIndex.to_json` and read by
:meth:`CheckpointIndex.from_json` only; a malformed one raises ``CorruptCheckpointError``
naming the field (each record is checked when a load first reads it). The index keeps the
on-disk shape of its version 1: checkpoints written before this module read the same, a
field it adds must be optional, and fields a newer writer adds are kept, unread, in
``extra``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...core.checksum import ALGORITHM, BLOCK_BYTES
from ...core.flatten import Containers, KeyTypes
from ...errors import CheckpointError, CorruptCheckpointError
from .fields import (
    Fields,
    containers_to_dict,
    decode_json,
    int_list,
    read_containers,
    read_key_types,
)

INDEX_FORMAT = "slipstream-index"
INDEX_VERSION = 1


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
        f = Fields(raw, what, error)
        return cls(
            f.get("file", str), f.get("offset", int), f.get("length", int), f.get("checksum", int)
        )


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
        f = Fields(raw, what, CorruptCheckpointError)
        blocks = int_list(f.get("blocks", list), f"{what}: blocks", CorruptCheckpointError)
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
            body["containers"] = containers_to_dict(self.containers)
        # Records become dicts one at a time as the encoder reaches them, each freed at
        # once: a commit on a background thread must not leave a burst of live objects.
        return json.dumps({**self.extra, **body}, default=_entry_dict).encode()

    @classmethod
    def from_json(cls, data: str | bytes, what: str) -> CheckpointIndex:
        raw = decode_json(data, what, CorruptCheckpointError)
        f = Fields(raw, what, CorruptCheckpointError)
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
            key_types=read_key_types(key_types, what, CorruptCheckpointError)
            if key_types
            else None,
            containers=(
                read_containers(containers, what, CorruptCheckpointError) if containers else None
            ),
            extra={k: v for k, v in f.raw.items() if k not in known},
        )
