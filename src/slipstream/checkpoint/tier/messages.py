"""The local tier's messages: what its ranks tell each other through the job's store, and
the marker each node writes once a local step is committed.

Every message is posted under a topic :class:`TierTopics` builds (``tier/...``). A
local save of step ``s``, round by round:

1. each node's lowest rank clears what the step would collide with and posts
   :class:`NodeCleared` at ``tier/clear/{s}``; its node's other ranks wait for it;
2. each rank sends its replicas and posts its :class:`ReplicationReport` at
   ``tier/replicated/{s}``;
3. rank 0 gathers them and posts the :class:`TierCommitOutcome` at ``tier/commit/{s}``;
4. each node's lowest rank writes the :class:`LocalCommitMarker` (``.local_commit``) and
   posts :class:`NodeMarked` at ``tier/marked/{s}``; its node's other ranks wait for it.

Once per tier: :class:`HostAnnouncement` at ``tier/host`` (nodes by host name) and
:class:`TierRoot` at ``tier/root`` (where its node keeps the tier, for errors). Recovery:
:class:`StepInventory` at ``tier/inventory/{n}`` (a load's outcome is agreed by the
checkpoint's one load agreement, :mod:`..agreement`).

Invariant: each message is written by ``to_json`` and read by ``from_json`` of its own
class, nowhere else; a malformed one raises ``CheckpointError`` naming the message and
the field (``CorruptCheckpointError`` for the marker, which is read from storage).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ...core.control_plane import store_key
from ...errors import CheckpointError, CorruptCheckpointError
from ..format.fields import Fields, decode_json, int_list
from .sealing import digest_kind


class TierTopics:
    """Every topic the local tier's ranks post under (relative to their channel's namespace)."""

    @staticmethod
    def host() -> str:
        return store_key("tier", "host")

    @staticmethod
    def clear(step: int) -> str:
        return store_key("tier", "clear", step)

    @staticmethod
    def replicated(step: int) -> str:
        return store_key("tier", "replicated", step)

    @staticmethod
    def commit(step: int) -> str:
        return store_key("tier", "commit", step)

    @staticmethod
    def marked(step: int) -> str:
        return store_key("tier", "marked", step)

    @staticmethod
    def root() -> str:
        return store_key("tier", "root")

    @staticmethod
    def inventory(round_: int) -> str:
        return store_key("tier", "inventory", round_)


def _sizes(f: Fields, name: str) -> dict[str, int]:
    """The object at ``name`` as a manifest: file name -> size in bytes."""
    raw = f.get(name, dict)
    for file, size in raw.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise f.fail(name, f"entry {file!r} is not a size in bytes: {size!r:.80}")
    return dict(raw)


def _digests(f: Fields, name: str, files: dict[str, int], every: bool = True) -> dict[str, str]:
    """The object at ``name`` as file digests (:mod:`.sealing`), one per file of ``files``
    (``every``) or for some of them."""
    raw = f.get(name, dict)
    for file, digest in raw.items():
        if not isinstance(digest, str) or not digest_kind(digest):
            raise f.fail(name, f"entry {file!r:.80} is not a digest of a kind it knows")
    if set(raw) - set(files) or (every and set(raw) != set(files)):
        raise f.fail(name, "does not name the same files as the manifest")
    return dict(raw)


def _message(text: str | bytes, what: str) -> Fields:
    return Fields(decode_json(text, what, CheckpointError), what, CheckpointError)


@dataclass(frozen=True)
class HostAnnouncement:
    """A rank's host name: ranks on one host are one node (unless ``ranks_per_node``)."""

    host: str

    def to_json(self) -> str:
        return json.dumps({"host": self.host})

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> HostAnnouncement:
        return cls(_message(text, what).get("host", str))


@dataclass(frozen=True)
class NodeCleared:
    """A node's lowest rank has cleared what a save of ``step`` would collide with."""

    step: int

    def to_json(self) -> str:
        return json.dumps({"step": self.step})

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> NodeCleared:
        return cls(_message(text, what).get("step", int))


@dataclass(frozen=True)
class NodeMarked:
    """A node's lowest rank has written the marker of ``step`` (``error``: or why it could
    not, and the step is not committed on that node)."""

    step: int
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "error": self.error})

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> NodeMarked:
        f = _message(text, what)
        return cls(f.get("step", int), f.get("error", str, optional=True))


@dataclass(frozen=True)
class TierRoot:
    """Where a rank's node keeps its local tier (a path or URL)."""

    url: str

    def to_json(self) -> str:
        return json.dumps({"url": self.url})

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> TierRoot:
        return cls(_message(text, what).get("url", str))


@dataclass(frozen=True)
class _FilesOrError:
    """Files, their sizes (``files``) and digests (``digests``, :mod:`.sealing`; for each
    file where :attr:`every_digest`), or why there are none (``error``, and the ranks
    found ``dead``): a message reads back as one or the other, never both."""

    every_digest: ClassVar[bool] = True

    files: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    dead: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        body = {"files": self.files, "digests": self.digests, "error": self.error}
        return json.dumps({**body, "dead": self.dead})

    @classmethod
    def from_json(cls: type[_F], text: str | bytes, what: str) -> _F:
        f = _message(text, what)
        error = f.get("error", str, optional=True)
        if error is not None:
            dead = int_list(f.get("dead", list), f"{what}: field 'dead'", CheckpointError)
            return cls(error=error, dead=dead)
        files = _sizes(f, "files")
        return cls(files, _digests(f, "digests", files, cls.every_digest))


_F = TypeVar("_F", bound=_FilesOrError)


@dataclass(frozen=True)
class ReplicationReport(_FilesOrError):
    """A rank's files of a local step are on their replica ranks (``files``: each one's
    size; ``digests``: the contents digests of the small ones), or why not (``error``, and
    the ranks found ``dead``). Rank 0 adds the data files' digests when it decides."""

    every_digest: ClassVar[bool] = False


@dataclass(frozen=True)
class TierCommitOutcome(_FilesOrError):
    """Rank 0's decision on a local step: committed, with its manifest (``files``: every
    file of the step and its size), or failed (``error``, and the ranks found ``dead``)."""


@dataclass(frozen=True)
class LocalCommitMarker:
    """``.local_commit``: a local step is committed; its manifest (every file, its size and
    its digest), the world size that wrote it, and the manifest's MAC under the node's key
    (:mod:`.sealing`)."""

    step: int
    world_size: int
    files: dict[str, int]
    digests: dict[str, str]
    mac: str

    def to_json(self) -> bytes:
        body = {"step": self.step, "world_size": self.world_size, "files": self.files}
        return json.dumps({**body, "digests": self.digests, "mac": self.mac}).encode()

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> LocalCommitMarker:
        f = Fields(decode_json(text, what, CorruptCheckpointError), what, CorruptCheckpointError)
        files = _sizes(f, "files")
        step, world_size = f.get("step", int), f.get("world_size", int)
        return cls(step, world_size, files, _digests(f, "digests", files), f.get("mac", str))


@dataclass(frozen=True)
class HeldStep:
    """One committed local step on a node: its manifest (sizes and digests) and the files
    the node holds whole."""

    files: dict[str, int]
    digests: dict[str, str]
    held: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "digests": self.digests, "held": self.held}

    @classmethod
    def from_dict(cls, raw: object, what: str) -> HeldStep:
        f = Fields(raw, what, CheckpointError)
        files = _sizes(f, "files")
        held = f.get("held", list)
        for file in held:
            if file not in files:
                raise f.fail("held", f"names {file!r:.80}, which the manifest does not list")
        return cls(files, _digests(f, "digests", files), [str(x) for x in held])


@dataclass(frozen=True)
class StepInventory:
    """A rank's node's committed local steps, by step."""

    steps: dict[int, HeldStep]

    def to_json(self) -> str:
        return json.dumps({"steps": {str(s): h.to_dict() for s, h in self.steps.items()}})

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> StepInventory:
        f = _message(text, what)
        steps: dict[int, HeldStep] = {}
        for key, raw in f.get("steps", dict).items():
            if not key.isdecimal():
                raise f.fail("steps", f"key {key!r:.80} is not a step number")
            steps[int(key)] = HeldStep.from_dict(raw, f"{what}: steps[{key!r}]")
        return cls(steps)
