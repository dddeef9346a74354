"""``torch.save`` to a file, atomically and durably, now or in the background.

:func:`async_torch_save` copies the object's tensors into reused host memory
(:class:`.HostCopy`) and returns; one ``torch.save`` of that copy then runs on a thread of
its own into a hidden sibling that is fsynced and renamed over the path. The file is the
archive ``torch.save(obj, path)`` writes: ``torch.load`` reads it with slipstream not
installed.

Invariant: the object may change as soon as :func:`async_torch_save` returns; the path
holds the previous file until the new one is complete and durable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..save.job import AsyncSaveResponse
from ..save.options import SaveOptions
from .atomic import atomic_file
from .background import BackgroundWrites
from .host_copy import HostCopy

_default_copy = HostCopy()
_default_writes = BackgroundWrites(nice=SaveOptions.thread_nice)


def torch_save(
    obj: Any,
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    serialized: Callable[[], None] | None = None,
) -> None:
    """``torch.save(obj, path)`` through a hidden sibling renamed into place once durable.

    ``serialized`` is called once ``obj`` has been read whole (before the fsync), or when
    the save fails before that: a staged copy may be reused from then on.
    """
    told = False
    try:
        with atomic_file(path, storage_options) as f:
            torch.save(obj, f)
            told = True
            if serialized is not None:
                serialized()
    finally:
        if not told and serialized is not None:
            serialized()


def async_torch_save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    host_copy: HostCopy | None = None,
    writes: BackgroundWrites | None = None,
    storage_options: dict[str, Any] | None = None,
) -> AsyncSaveResponse:
    """Stage ``obj`` and ``torch.save`` it to ``path`` in the background.

    Returns once the tensors are copied (``staging_completion`` is done); the
    ``upload_completion`` future resolves once the file is in place and durable, or raises
    the write's error. ``host_copy`` keeps the host memory reused from one save of this
    state to the next (the process shares one by default, so a save waits for the write of
    the one before has been serialized); ``writes`` owns the write's thread.
    """
    copier = host_copy or _default_copy
    staged_obj = copier.copy(obj)
    copier.hold()

    def write() -> None:
        torch_save(staged_obj, path, storage_options, serialized=copier.release)

    try:
        done = (writes or _default_writes).start([path], write, copier.timeout)
    except BaseException:
        copier.release()
        raise
    staged: Future[None] = Future()
    staged.set_result(None)
    return AsyncSaveResponse(staging_completion=staged, upload_completion=done)
