"""Drop-in functions with ``torch.distributed.checkpoint``'s arguments (see :mod:`.dcp_compat`).

``async_save`` keeps one :class:`CheckpointSaver` per process group so that staging
buffers and plans are reused across calls; they are closed at interpreter exit. What
slipstream cannot serve goes to DCP itself (:mod:`.dcp_compat`).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint import LoadPlanner, SavePlanner, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncSaveResponse as DcpAsyncSaveResponse,
)

from ..errors import CheckpointError, UnsafeCheckpointError
from . import collective_load, dcp_compat
from .agreement import agreement_for
from .format.names import METADATA_FILE
from .format.safe_types import Trust, Trusted
from .hf import load as hf_load
from .load import loader
from .save.job import AsyncSaveResponse
from .save.options import SaveOptions
from .save.saver import CheckpointSaver
from .storage import Location, Storage, resolve_storage

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


def _saver(process_group: dist.ProcessGroup | None, no_dist: bool = False) -> CheckpointSaver:
    """The group's shared saver (its channel also agrees on the group's loads). Its options
    are never changed once made: a call's ``timeout`` goes with that call's save alone, so
    it cannot change the waits of a save already in flight."""
    key = _group_key(process_group, no_dist)
    with _savers_lock:
        saver = _savers.get(key)
        if saver is not None and key != ("local",) and saver.channel.store is not _current_store():
            saver.close()  # the process group it coordinated through was destroyed
            saver = None
        if saver is None:
            saver = CheckpointSaver(process_group, SaveOptions(), no_dist=no_dist)
            _savers[key] = saver
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


@dataclass(frozen=True)
class Started:
    """A save slipstream serves, started: its response, and whether DCP would have
    returned before staging finished (``dcp.async_save`` with an asynchronous stager)."""

    response: AsyncSaveResponse
    returns_at_once: bool


@dataclass(frozen=True)
class HandedOff:
    """A save DCP ran (see :mod:`.dcp_compat`): what ``dcp.async_save`` returned."""

    result: Any


def begin_async_save(
    state_dict: Mapping[str, Any],
    checkpoint_id: Location | None,
    process_group: dist.ProcessGroup | None,
    *,
    storage_writer: StorageWriter | None,
    planner: SavePlanner | None,
    async_checkpointer_type: AsyncCheckpointerType | None,
    async_stager: AsyncStager | None,
    no_dist: bool,
    use_collectives: bool,
    timeout: float | None,
    storage_options: dict[str, Any] | None,
) -> Started | HandedOff:
    """The one implementation behind :func:`async_save`, :func:`save` and
    ``slipstream.dcp.async_save``: serve the save, or hand it to DCP unchanged."""
    staging = dcp_compat.async_staging(async_checkpointer_type, async_stager)
    target = dcp_compat.save_target(checkpoint_id, storage_writer, planner, use_collectives)
    why = target if isinstance(target, dcp_compat.HandOff) else staging
    if isinstance(why, dcp_compat.HandOff):
        arguments: dict[str, Any] = {
            "checkpoint_id": dcp_compat.dcp_checkpoint_id(checkpoint_id, storage_options, why),
            "storage_writer": storage_writer,
            "planner": planner,
            "process_group": process_group,
            "no_dist": no_dist,
            "use_collectives": use_collectives,
        }
        if async_checkpointer_type is not None:
            arguments["async_checkpointer_type"] = async_checkpointer_type
        if async_stager is not None:
            arguments["async_stager"] = async_stager
        return HandedOff(dcp_compat.async_save(why, dict(state_dict), **arguments))
    assert isinstance(target, dcp_compat.SaveTarget)
    assert isinstance(staging, dcp_compat.AsyncStaging)
    if staging.note is not None:
        dcp_compat.log_once(staging.note)
    if not target.overwrite:
        _refuse_overwrite(target.location, storage_options)
    response = _saver(process_group, no_dist).save(
        state_dict,
        target.location,
        storage_options=storage_options,
        storage_meta=dcp_compat.writer_storage_meta(storage_writer, checkpoint_id),
        timeout=timeout,
    )
    return Started(response, staging.returns_at_once)


def _response_of(result: Any) -> AsyncSaveResponse:
    """What ``dcp.async_save`` returned, as slipstream's response: a ``Future`` (DCP
    returned once staged) or DCP's ``AsyncSaveResponse``; both resolve to ``Metadata``."""
    upload: Future[Any]
    if isinstance(result, DcpAsyncSaveResponse):
        staged, upload = result.staging_completion, result.upload_completion
    else:
        staged, upload = Future(), result
        staged.set_result(None)
    response = AsyncSaveResponse(staging_completion=staged, upload_completion=upload)
    response.committed_as(lambda: cast(Metadata, upload.result()))  # DCP's resolves to it
    return response


def async_save(
    state_dict: Mapping[str, Any],
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
    ``async_stager``, ``no_dist``, ``use_collectives``) are served by slipstream where it
    can; what it cannot serve (a planner or storage writer of your own, DCP's Hugging Face
    writer, an option slipstream has no equivalent of) is handed to
    ``torch.distributed.checkpoint.async_save`` unchanged, with one log line (see
    :mod:`.dcp_compat`). ``no_dist=True`` saves this process's state alone, as one rank.
    """
    started = begin_async_save(
        state_dict,
        checkpoint_id,
        process_group,
        storage_writer=storage_writer,
        planner=planner,
        async_checkpointer_type=async_checkpointer_type,
        async_stager=async_stager,
        no_dist=no_dist,
        use_collectives=use_collectives,
        timeout=timeout,
        storage_options=storage_options,
    )
    if isinstance(started, HandedOff):
        return _response_of(started.result)
    return started.response


def save(
    state_dict: Mapping[str, Any],
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
    target = dcp_compat.save_target(checkpoint_id, storage_writer, planner, use_collectives)
    if isinstance(target, dcp_compat.HandOff):
        return dcp_compat.save(  # type: ignore[no-any-return]
            target,
            dict(state_dict),
            checkpoint_id=dcp_compat.dcp_checkpoint_id(checkpoint_id, storage_options, target),
            storage_writer=storage_writer,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
            use_collectives=use_collectives,
        )
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


def load_state(
    state_dict: dict[str, Any],
    checkpoint_id: Location | None,
    process_group: dist.ProcessGroup | None,
    *,
    storage_reader: StorageReader | None,
    planner: LoadPlanner | None,
    no_dist: bool,
    strict: bool,
    storage_options: dict[str, Any] | None,
    trusted: Trusted,
    untrusted_hand_off: bool,
    cast: bool,
) -> None:
    """The one implementation behind :func:`load` and ``slipstream.dcp.load``.

    A load DCP must run (see :mod:`.dcp_compat`) unpickles the checkpoint's values as DCP
    does, with no allow-list: it is handed off only with ``trusted=True`` or where the
    caller stands in for DCP itself (``untrusted_hand_off``)."""
    location = dcp_compat.load_target(checkpoint_id, storage_reader, planner)
    if isinstance(location, dcp_compat.HandOff):
        if not (untrusted_hand_off or Trust.of(trusted).everything):
            raise UnsafeCheckpointError(
                f"{location.reason}: only torch.distributed.checkpoint.load can run this "
                "load, and it unpickles the checkpoint's values without slipstream's "
                "allow-list; pass trusted=True to let it"
            )
        dcp_compat.load(
            location,
            state_dict,
            checkpoint_id=dcp_compat.dcp_checkpoint_id(checkpoint_id, storage_options, location),
            storage_reader=storage_reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
        return

    def prepare() -> loader.PlannedLoad | None:
        storage = resolve_storage(location, storage_options)
        if hf_load.is_hf_directory(storage):
            return hf_load.open_hf(state_dict, storage, strict=strict)
        return loader.open_plan(
            state_dict,
            storage,
            strict=strict,
            trusted=trusted,
            cast=cast,
            extensions=dcp_compat.reader_extensions(storage_reader),
        )

    saver = _saver(process_group, no_dist)
    where = location.url if isinstance(location, Storage) else str(location)
    agreement = agreement_for(saver.channel)
    collective_load.load(agreement, f"load of {where}", prepare, saver.options.timeout)


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
    cast: bool = False,
) -> None:
    """Load a committed checkpoint (slipstream- or DCP-written) into ``state_dict`` in place.

    Resharding is implicit: each rank reads the parts of the saved chunks its tensors
    and DTensor shards cover. Every rank of ``process_group`` calls it together: a load
    that fails on one rank fails on every rank (agreed through the job's store, never a
    collective; a rank that died is named within seconds), each rank's error naming the
    ranks that failed and why. ``no_dist=True`` loads on this process alone.
    ``storage_reader`` and ``planner`` take DCP's filesystem and fsspec readers and its
    default load planner; others (DCP's Hugging Face reader, a planner of your own) are
    handed to ``dcp.load`` when ``trusted=True`` (see :mod:`.dcp_compat`). A directory of
    Hugging Face safetensors (and no DCP checkpoint) is read by
    :func:`~slipstream.load_hf`, its name prefix found from the keys.

    Keys: every key of ``state_dict`` must be in the checkpoint (an error names those
    missing); with ``strict`` (the default) the checkpoint may hold no others.
    ``slipstream.dcp.load`` keeps DCP's rule instead (``strict=False``): keys of the
    checkpoint nobody asked for are ignored.

    Plain values are unpickled through an allow-list of plain data (see
    docs/checkpoint-files.md, "Safe loading") and the classes :func:`~slipstream.allow_types`
    allows; ``trusted`` adds classes or functions (or their ``"module.Name"``), or is
    ``True`` to unpickle anything, running the code it names, as ``dcp.load`` does.

    A tensor saved in another dtype than the state dict's is an error naming it, unless
    ``cast=True``: then it is cast as ``dcp.load`` casts (``copy_``; what
    ``slipstream.dcp.load`` always does). Records DCP wrote through stream extensions
    (``FileSystemWriter(_extensions=...)``) are decoded with DCP's default
    ``ExtensionRegistry``, or the one of ``storage_reader=FileSystemReader(path,
    _extension_registry=...)``.
    """
    load_state(
        state_dict,
        checkpoint_id,
        process_group,
        storage_reader=storage_reader,
        planner=planner,
        no_dist=no_dist,
        strict=strict,
        storage_options=storage_options,
        trusted=trusted,
        untrusted_hand_off=False,
        cast=cast,
    )
