"""Names a checkpoint's metadata may give its files: relative paths that stay inside it.

A checkpoint's ``.metadata`` (DCP's ``storage_data``) and slipstream's index name the files
its bytes are read from, relative to the checkpoint's directory or prefix. A load reads only
what those names resolve to, so a name that leaves the checkpoint (``..``, an absolute
path, a URL or another bucket, a drive letter) would make the load read whatever the
process can read, into the caller's tensors. Such a name is never a file the checkpoint
wrote: it is refused, on every backend, before any byte is read.
"""

from __future__ import annotations

import re

from ..errors import CorruptCheckpointError

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
"""``s3:``, ``file:``, ``https:``, or a drive letter ``C:``."""


def outside_reason(name: object) -> str | None:
    """Why ``name`` does not name a file inside the checkpoint, or ``None`` if it does."""
    if not isinstance(name, str) or not name:
        return "not a non-empty file name"
    if "\x00" in name:
        return "it holds a NUL character"
    if name.startswith(("/", "\\")):
        return "it is an absolute path"
    if _SCHEME.match(name):
        return "it is a URL or names another volume"
    parts = re.split(r"[/\\]", name)
    if ".." in parts:
        return "it climbs out of the checkpoint with '..'"
    if any(part in ("", ".") for part in parts):
        return "it has an empty or '.' path component"
    return None


def check_inside(name: object, checkpoint: str, source: str) -> str:
    """``name`` if it names a file inside ``checkpoint``; else a
    :class:`CorruptCheckpointError` naming it and where it came from (``source``)."""
    reason = outside_reason(name)
    if reason is not None:
        raise CorruptCheckpointError(
            f"{checkpoint}: {source} names the file {name!r}, which is not inside the "
            f"checkpoint ({reason}); refused: the checkpoint's metadata is corrupt or was "
            "tampered with"
        )
    assert isinstance(name, str)
    return name
