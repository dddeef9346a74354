"""Files and directories that appear whole or not at all.

A local file is written to a hidden sibling (``.<name>.saving-<id>``), flushed, fsynced and
renamed over its name, then its directory is fsynced: a reader sees the old file or the
complete new one, and after a crash the name holds one of the two. A directory is assembled
under a hidden sibling the same way and renamed into place once every file in it is durable.
An object store's file (``s3://...``) is written through fsspec, whose upload replaces the
object only when it completes.

Invariant: nothing under the final name is ever partial; on failure the hidden sibling is
removed and the final name is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import IO, Any

from ..storage.files import fsync_dir, fsync_file

SAVING_MARK = ".saving-"
"""Part of the hidden name a file or directory is written under before its rename."""


def is_remote(path: str) -> bool:
    """Whether ``path`` names an object store or other fsspec filesystem (``scheme://``)."""
    return "://" in path


def saving_name(path: str) -> str:
    """A hidden sibling of ``path`` to write into before renaming it to ``path``."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{SAVING_MARK}{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Iterator[IO[bytes]]:
    """A binary file to write that replaces ``path`` only once complete and durable."""
    target = os.fspath(path)
    if is_remote(target):
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]

        fs, _ = url_to_fs(target, **(storage_options or {}))
        with fs.open(target, "wb") as remote:
            yield remote
        return
    hidden = saving_name(target)
    try:
        with open(hidden, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(hidden, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(hidden)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(target)))


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[str]:
    """A directory to fill (its path is yielded) that becomes ``path`` once complete.

    Every file written into it is fsynced before the rename; an existing ``path`` is
    replaced only then (renamed aside, then deleted).
    """
    target = os.path.abspath(os.fspath(path))
    hidden = saving_name(target)
    os.makedirs(hidden)
    try:
        yield hidden
        _fsync_tree(hidden)
        if os.path.lexists(target):
            aside = saving_name(target)
            os.rename(target, aside)
            os.rename(hidden, target)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(hidden, target)
    except BaseException:
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(target))


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(folder, name))
        fsync_dir(folder)
