"""A stand-in for ``torch.distributed.checkpoint``: ``import slipstream.dcp as dcp``.

Code written against DCP switches by importing this module where it imported DCP (or by
binding it to the name DCP was bound to), with no other change. Invariant: every call
keeps DCP's contract for the same arguments, in its return type and in when the caller
may touch the state again:

- :func:`save` returns the committed ``Metadata`` once the checkpoint is durable.
- :func:`async_save` without an asynchronous stager returns once the state is staged, a
  :class:`SaveFuture` (a ``concurrent.futures.Future``) resolving to the ``Metadata``;
  with ``DefaultStager(StagingOptions(use_async_staging=True))`` it returns at once with
  DCP's own ``AsyncSaveResponse``, and the caller waits on ``staging_completion``.
- :func:`load` ignores checkpoint keys the state dict does not ask for and names those it
  asks for that the checkpoint lacks (``strict=True`` refuses the former too), and casts a
  tensor saved in another dtype into the state dict's, as DCP's ``copy_`` does.
- :func:`save` and :func:`load` take the storage writer / reader as a second positional
  argument, with DCP's own warning, as DCP does; a save through a writer records the
  writer's ``storage_meta()`` (its ``save_id``) in the committed ``Metadata``.

slipstream serves what it can (DCP's filesystem and fsspec writers and readers, default
planners, ``DefaultStager``, ``AsyncCheckpointerType.PROCESS``: its own staging buffers and
threads, one log line saying so); anything else (DCP's Hugging Face writer and reader, a
planner or storage class of your own) goes to DCP itself, unchanged, with one log line.
Every other name resolves to DCP's own (``FileSystemWriter``, ``DefaultStager``,
``state_dict_saver``, ...).
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as _torch_dcp
from torch.distributed.checkpoint import (
    BytesStorageMetadata,
    CheckpointException,
    ChunkStorageMetadata,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
    LoadPlan,
    LoadPlanner,
    Metadata,
    QuantizedHuggingFaceStorageReader,
    ReadItem,
    SavePlan,
    SavePlanner,
    StorageReader,
    StorageWriter,
    TensorStorageMetadata,
    WriteItem,
    load_sharded_optimizer_state_dict,
    load_state_dict,
    save_state_dict,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

from .checkpoint import api as _api
from .checkpoint.format.safe_types import Trusted
from .checkpoint.save.job import AsyncSaveResponse as _SlipstreamResponse
from .checkpoint.save.options import SaveOptions as _SaveOptions
from .checkpoint.storage import Location

__all__ = [
    "AsyncCheckpointerType",
    "AsyncSaveResponse",
    "BytesStorageMetadata",
    "CheckpointException",
    "ChunkStorageMetadata",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "HuggingFaceStorageReader",
    "HuggingFaceStorageWriter",
    "LoadPlan",
    "LoadPlanner",
    "Metadata",
    "QuantizedHuggingFaceStorageReader",
    "ReadItem",
    "SaveFuture",
    "SavePlan",
    "SavePlanner",
    "StorageReader",
    "StorageWriter",
    "TensorStorageMetadata",
    "WriteItem",
    "async_save",
    "load",
    "load_sharded_optimizer_state_dict",
    "load_state_dict",
    "save",
    "save_state_dict",
]


def __getattr__(name: str) -> Any:
    """DCP's other names (its submodules: ``state_dict_saver``, ``staging``, ...)."""
    try:
        return getattr(_torch_dcp, name)
    except AttributeError:
        raise AttributeError(f"module 'slipstream.dcp' has no attribute {name!r}") from None


class SaveFuture(Future[Metadata]):
    """What :func:`async_save` returns without an asynchronous stager: a ``Future`` that
    resolves to the committed checkpoint's ``Metadata`` once it is durable (or raises the
    save's error), carrying slipstream's ``staging_completion``, ``upload_completion``
    and ``timings``."""

    def __init__(self, response: _SlipstreamResponse) -> None:
        super().__init__()
        self._response = response
        self.staging_completion = response.staging_completion
        self.upload_completion = response.upload_completion
        self.timings = response.timings
        response.upload_completion.add_done_callback(self._finished)

    def _finished(self, upload: Future[None]) -> None:
        error = upload.exception()
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(None)  # type: ignore[arg-type]  # result() reads the Metadata

    def result(self, timeout: float | None = None) -> Metadata:
        """The committed ``Metadata`` (read back once on ranks other than 0)."""
        super().result(timeout)
        return self._response.metadata(timeout)


_Storage = TypeVar("_Storage", StorageWriter, StorageReader)


def _positional(
    function: str, argument: str, extra: tuple[_Storage, ...], keyword: _Storage | None
) -> _Storage | None:
    """The storage writer or reader given as the second positional argument (DCP's older
    argument order, which it still takes with this warning), or the keyword one."""
    if not extra:
        return keyword
    if len(extra) > 1:
        raise TypeError(
            f"{function}() takes from 1 to 2 positional arguments but {1 + len(extra)} were given"
        )
    (positional,) = extra
    if keyword is not None:
        raise TypeError(
            f"{function}() got {argument} twice: as the second positional argument and as "
            f"{argument}="
        )
    if isinstance(positional, (str, os.PathLike)):
        raise TypeError(
            f"{function}(): the second positional argument is DCP's {argument}, not a "
            f"location (got {type(positional).__name__} {os.fspath(positional)!r}); pass "
            "checkpoint_id= instead"
        )
    warnings.warn(
        f"The argument order of {function} has been changed. "
        "Please check the document to avoid future breakages.",
        stacklevel=3,
    )
    return positional


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: Location | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
    async_stager: AsyncStager | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Future[Any] | AsyncSaveResponse:
    """``dcp.async_save``: returns once staged (a :class:`SaveFuture`), or at once with
    DCP's ``AsyncSaveResponse`` given an asynchronous ``DefaultStager`` (see the module
    docstring). ``timeout`` and ``storage_options`` are slipstream's own (see
    :func:`slipstream.async_save`)."""
    started = _api.begin_async_save(
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
    if isinstance(started, _api.HandedOff):
        return started.result
    future = SaveFuture(started.response)
    if started.returns_at_once:
        return AsyncSaveResponse(
            staging_completion=started.response.staging_completion,
            upload_completion=future,  # type: ignore[arg-type]  # DCP's resolves to Metadata too
        )
    started.response.staging_completion.result(_SaveOptions.timeout if timeout is None else timeout)
    return future


def save(
    state_dict: dict[str, Any],
    *positional_writer: StorageWriter,
    checkpoint_id: Location | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    timeout: float | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Metadata:
    """``dcp.save``: returns the committed ``Metadata`` once the checkpoint is durable.
    ``dcp.save(state_dict, storage_writer)`` works as in DCP, with its warning."""
    return _api.save(
        state_dict,
        checkpoint_id,
        process_group,
        storage_writer=_positional("save", "storage_writer", positional_writer, storage_writer),
        planner=planner,
        no_dist=no_dist,
        use_collectives=use_collectives,
        timeout=timeout,
        storage_options=storage_options,
    )


def load(
    state_dict: dict[str, Any],
    *positional_reader: StorageReader,
    checkpoint_id: Location | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    trusted: Trusted = None,
) -> None:
    """``dcp.load``, in place: keys of the checkpoint the state dict does not ask for are
    ignored; keys it asks for that the checkpoint lacks are an error naming them
    (``strict=True``: the checkpoint may hold no others either). A tensor saved in
    another dtype is cast into the state dict's, as DCP casts (``copy_``).
    ``dcp.load(state_dict, storage_reader)`` works as in DCP, with its warning.

    Served by slipstream, plain values are unpickled through its allow-list (``trusted``
    and :func:`slipstream.allow_types` extend it; ``trusted=True`` unpickles anything, as
    DCP does). A load handed to DCP (its Hugging Face reader, a planner of your own such
    as ``_EmptyStateDictLoadPlanner``) unpickles as DCP does."""
    _api.load_state(
        state_dict,
        checkpoint_id,
        process_group,
        storage_reader=_positional("load", "storage_reader", positional_reader, storage_reader),
        planner=planner,
        no_dist=no_dist,
        strict=strict,
        storage_options=storage_options,
        trusted=trusted,
        untrusted_hand_off=True,
        cast=True,
    )
