"""Deleting rotated-out checkpoints off the training thread.

Deleting a checkpoint of a few hundred MB makes the filesystem free all its blocks, which
takes a noticeable fraction of a second, and a training loop that keeps only its last k
checkpoints pays it on every save. :class:`Remover` first renames the checkpoint to a
hidden sibling (``.<name>.removing-<id>``): on one filesystem an instant, atomic step after
which the name is free and nothing that looks for checkpoints by name sees it. A thread of
its own then deletes the hidden copy.

Invariants: a path :meth:`Remover.remove` was given no longer exists under its name when
the call returns; :meth:`Remover.wait` returns once every deletion started has ended and
joins the thread (a later ``remove`` starts a new one), or raises naming what is still being
deleted; a deletion that fails is logged with the hidden path, which stays where it is.

A process killed mid-deletion leaves its hidden copy behind, and one killed mid-save its
uncommitted checkpoint and temporary files: :func:`sweep`, which each integration runs when
it starts in a run's checkpoint directory, deletes those, and only what slipstream itself
named that way.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

from ..checkpoint.files.atomic import SAVING_MARK
from ..checkpoint.format.names import is_temporary
from ..errors import CheckpointError

log = logging.getLogger(__name__)

HIDDEN_MARK = ".removing-"
"""Part of the name a checkpoint is renamed to while it is deleted."""


def is_being_removed(name: str) -> bool:
    """Whether a directory entry is a checkpoint :class:`Remover` is deleting."""
    return name.startswith(".") and HIDDEN_MARK in name


def _is_hidden_leftover(name: str) -> bool:
    return name.startswith(".") and (HIDDEN_MARK in name or SAVING_MARK in name)


def hide(path: str) -> str:
    """Rename ``path`` to a hidden sibling that marks it as being deleted; return that."""
    parent, name = os.path.split(os.path.abspath(path))
    hidden = os.path.join(parent, f".{name}{HIDDEN_MARK}{uuid.uuid4().hex[:8]}")
    os.rename(path, hidden)
    return hidden


def delete_now(path: str) -> None:
    """Delete ``path`` (a file or a directory) on this thread, through a hidden name:
    a deletion cut short never leaves a partial checkpoint under the original name."""
    _delete(hide(path))


class Remover:
    """Renames local checkpoints out of the way and deletes them on its own thread."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[Future[None], str] = {}

    def remove(self, path: str) -> None:
        """Make ``path`` (a file or a directory) disappear now; delete it in the background."""
        hidden = hide(path)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="slipstream-remove")
        self._pending[self._executor.submit(_delete, hidden)] = hidden

    def wait(self, timeout: float | None) -> None:
        """Wait for every deletion started; then join the thread."""
        if self._executor is None:
            return
        _, running = wait_all(list(self._pending), timeout)
        if running:
            left = sorted(self._pending[f] for f in running)
            raise CheckpointError(
                f"deleting old checkpoints did not finish within {timeout} s: {left}"
            )
        self._pending.clear()
        self._executor.shutdown(wait=True)
        self._executor = None


def sweep(directory: str) -> list[str]:
    """Delete what a process killed mid-way left in ``directory`` (where a run keeps its
    checkpoints) and return it, logged in one line: hidden ``.<name>.removing-<id>``
    entries (a deletion cut short) and ``.<name>.saving-<id>`` ones (a save cut short
    before its rename into place), and slipstream's temporary files in it and in its
    checkpoints. Call it only while this run has no save in flight there."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = os.path.join(directory, name)
        if _is_hidden_leftover(name) or is_temporary(name):
            removed.append(path)
        elif os.path.isdir(path) and not os.path.islink(path):
            removed += [os.path.join(path, f) for f in _listing(path) if is_temporary(f)]
    for path in removed:
        _delete(path)
    if removed:
        log.warning(
            "removed what an earlier run left when it stopped mid-save or mid-deletion: %s",
            ", ".join(sorted(removed)),
        )
    return removed


def _listing(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _delete(hidden: str) -> None:
    try:
        if os.path.isdir(hidden) and not os.path.islink(hidden):
            shutil.rmtree(hidden)
        else:
            os.remove(hidden)
    except OSError as exc:
        log.error("could not delete the removed checkpoint %s: %s", hidden, exc)
