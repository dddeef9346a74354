"""Files written together that land in a directory each whole, the directory whole if new.

:func:`files_into` yields a hidden sibling of ``path`` to write files into. Once every file
in it is durable: where ``path`` does not exist or is an empty directory, the hidden
directory is renamed to it (:func:`.atomic.atomic_directory`: the directory appears
whole); where ``path`` already holds entries, each file is renamed over its own name in it
and ``path``'s other entries are left as they were (each file appears whole, as the set
written by a framework that writes into an existing directory would, minus partial files).

Invariant: nothing under ``path`` is ever partial; on failure the hidden sibling is removed
and ``path`` is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

from ..storage.files import fsync_dir
from .atomic import _fsync_tree, atomic_directory, saving_name


@contextlib.contextmanager
def files_into(path: str | os.PathLike[str]) -> Iterator[str]:
    """A hidden directory to fill (its path is yielded) whose files then land in ``path``."""
    target = os.path.abspath(os.fspath(path))
    if not _holds_entries(target):
        with atomic_directory(target) as hidden:
            yield hidden
        return
    hidden = saving_name(target)
    os.makedirs(hidden)
    try:
        yield hidden
        _fsync_tree(hidden)
        _move_into(hidden, target)
    finally:
        shutil.rmtree(hidden, ignore_errors=True)


def _holds_entries(path: str) -> bool:
    if not os.path.lexists(path):
        return False
    return not os.path.isdir(path) or os.path.islink(path) or bool(os.listdir(path))


def _move_into(source: str, target: str) -> None:
    """Rename each file of ``source`` over its name in ``target`` (merging subdirectories)."""
    for name in os.listdir(source):
        moved, over = os.path.join(source, name), os.path.join(target, name)
        if os.path.isdir(moved) and os.path.isdir(over) and not os.path.islink(over):
            _move_into(moved, over)
        else:
            os.replace(moved, over)
    fsync_dir(target)
