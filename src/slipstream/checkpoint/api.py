"""Drop-in functions with ``torch.distributed.checkpoint``'s arguments (see :mod:`.dcp_args`).

``async_save`` keeps one :class:`CheckpointSaver` per process group so that staging
buffers and plans are reused across calls; they are closed at interpreter exit.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import LoadPlanner, SavePlanner, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ..errors import CheckpointError
from . import dcp_args, loader
from .commit import METADATA_FILE
from .options import SaveOptions
from .safe_types import Trusted
from .save_job import AsyncSaveResponse
from .saver import CheckpointSaver
from .storage import Location, resolve_storage

_savers: dict[tuple[Any, ...], CheckpointSaver] = {}
_savers_lock = threading.Lock()


def _group_key(process_group: dist.ProcessGroup | None, no_dist: bool) -> tuple[Any, ...]:
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return ("local",)
    group = process_group or dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def _current_store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _saver(
    process_group: dist.ProcessGroup | None, timeout: float | None, no_dist: bool = False
) -> CheckpointSaver:
    key = _group_key(process_group, no_dist)
    with _savers_lock:
        saver = _savers.get(key)
        if saver is not None and key != ("local",) and saver.channel.store is not _current_store():
            saver.close()  # the process group it coordinated through was destroyed
            saver = None
        if saver is None:
            saver = CheckpointSaver(process_group, SaveOptions(), no_dist=no_dist)
            _savers[key] = saver
        saver.options.timeout = SaveOptions.timeout if timeout is None else timeout
        return saver


@atexit.register
def _close_savers() -> None:
    with _savers_lock:
        for saver in _savers.values():
            saver.close()
        _savers.clear()


def _refuse_overwrite(location: Location, storage_options: dict[str, Any] | None) -> None:
    """``FileSystemWriter(overwrite=False)``: fail, as DCP does, where a checkpoint is."""
    storage = resolve_storage(location, storage_options)
    try:
        if storage.exists(METADATA_FILE):
            raise CheckpointError(
                f"{storage.url} already holds a checkpoint and the storage_writer says "
                "overwrite=False"
            )
    finally:
        if storage is not location:  # made here, not the caller's own Storage
            storage.close()


def async_save(
    state_dict: dict[str, Any],
    checkpoint_id: Location | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    async_checkpointer_type: AsyncCheckpointerType | None = None,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> AsyncSaveResponse:
    """Save asynchronously; returns at once with ``staging_completion``/``upload_completion``.

    Mutate the state only after ``staging_completion`` resolves; ``resp.metadata()`` is
    the committed checkpoint's ``Metadata`` once it is durable. Every rank of the group
    must call it with the same ``checkpoint_id``: a local path, ``file://``, ``s3://``,
    ``gs://``, ``az://`` or ``memory://`` URL, or a :class:`~slipstream.Storage`.
    ``storage_options`` override an object store's configuration (see docs/storage.md).
    ``timeout`` bounds every wait on another rank; ``None`` means ``SaveOptions.timeout``.

    DCP's arguments (``storage_writer``, ``planner``, ``async_checkpointer_type``,
    ``async_stager``, ``no_dist``, ``use_collectives``) are honoured where slipstream can,
    and refused with an error naming the argument where it cannot (see
    :mod:`.dcp_args`). ``no_dist=True`` saves this process's state alone, as one rank.
    """
    dcp_args.check_async_arguments(async_checkpointer_type, async_stager)
    target = dcp_args.save_target(checkpoint_id, storage_writer, planner, use_collectives)
    if not target.overwrite:
        _refuse_overwrite(target.location, storage_options)
    return _saver(process_group, timeout, no_dist).save(
        state_dict, target.location, storage_options=storage_options
    )


def save(
    state_dict: dict[str, Any],
    checkpoint_id: Location | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Metadata:
    """Save and return the committed checkpoint's ``Metadata`` once it is durable, as
    ``dcp.save`` does (see :func:`async_save` for the arguments)."""
    response = async_save(
        state_dict,
        checkpoint_id,
        process_group,
        storage_writer=storage_writer,
        planner=planner,
        no_dist=no_dist,
        use_collectives=use_collectives,
        timeout=timeout,
        storage_options=storage_options,
    )
    return response.metadata()


def load(
    state_dict: dict[str, Any],
    checkpoint_id: Location | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    no_dist: bool = False,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    trusted: Trusted = None,
) -> None:
    """Load a committed checkpoint (slipstream- or DCP-written) into ``state_dict`` in place.

    Resharding is implicit: each rank reads the parts of the saved chunks its tensors
    and DTensor shards cover. ``process_group`` and ``no_dist`` are accepted for DCP
    compatibility; loading needs no communication. ``storage_reader`` and ``planner``
    take DCP's filesystem and fsspec readers and its default load planner (see
    :mod:`.dcp_args`).

    Plain values are unpickled through an allow-list of plain data (see
    docs/checkpoint.md, "Safe loading"); ``trusted`` adds classes or functions (or their
    ``"module.Name"``), or is ``True`` to unpickle anything, running the code it names,
    as ``dcp.load`` does.
    """
    del process_group, no_dist
    location = dcp_args.load_target(checkpoint_id, storage_reader, planner)
    loader.load(
        state_dict, location, strict=strict, storage_options=storage_options, trusted=trusted
    )
