"""Drop-in functions with ``torch.distributed.checkpoint``'s argument names.

``async_save`` keeps one :class:`CheckpointSaver` per process group so that staging
buffers and plans are reused across calls; they are closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import torch.distributed as dist

from . import loader
from .options import SaveOptions
from .save_job import AsyncSaveResponse
from .saver import CheckpointSaver
from .storage import Location

_savers: dict[tuple[Any, ...], CheckpointSaver] = {}
_savers_lock = threading.Lock()


def _group_key(process_group: dist.ProcessGroup | None) -> tuple[Any, ...]:
    if not (dist.is_available() and dist.is_initialized()):
        return ("local",)
    group = process_group or dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def _current_store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _saver(process_group: dist.ProcessGroup | None, timeout: float | None) -> CheckpointSaver:
    key = _group_key(process_group)
    with _savers_lock:
        saver = _savers.get(key)
        if saver is not None and key != ("local",) and saver.channel.store is not _current_store():
            saver.close()  # the process group it coordinated through was destroyed
            saver = None
        if saver is None:
            saver = CheckpointSaver(process_group, SaveOptions())
            _savers[key] = saver
        saver.options.timeout = SaveOptions.timeout if timeout is None else timeout
        return saver


@atexit.register
def _close_savers() -> None:
    with _savers_lock:
        for saver in _savers.values():
            saver.close()
        _savers.clear()


def async_save(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    process_group: dist.ProcessGroup | None = None,
    *,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> AsyncSaveResponse:
    """Save asynchronously; returns at once with ``staging_completion``/``upload_completion``.

    Mutate the state only after ``staging_completion`` resolves. Every rank of the group
    must call it with the same ``checkpoint_id``: a local path, ``file://``, ``s3://``,
    ``gs://``, ``az://`` or ``memory://`` URL, or a :class:`~slipstream.Storage`.
    ``storage_options`` override an object store's configuration (see docs/storage.md).
    ``timeout`` bounds every wait on another rank; ``None`` means ``SaveOptions.timeout``.
    """
    return _saver(process_group, timeout).save(
        state_dict, checkpoint_id, storage_options=storage_options
    )


def save(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    process_group: dist.ProcessGroup | None = None,
    *,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save and return once the checkpoint is durable and committed (see :func:`async_save`)."""
    response = async_save(
        state_dict, checkpoint_id, process_group, timeout=timeout, storage_options=storage_options
    )
    response.upload_completion.result()


def load(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    process_group: dist.ProcessGroup | None = None,
    *,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Load a committed checkpoint (slipstream- or DCP-written) into ``state_dict`` in place.

    Resharding is implicit: each rank reads the parts of the saved chunks its tensors
    and DTensor shards cover. ``process_group`` is accepted for DCP compatibility; loading
    needs no communication.
    """
    del process_group
    loader.load(state_dict, checkpoint_id, strict=strict, storage_options=storage_options)
