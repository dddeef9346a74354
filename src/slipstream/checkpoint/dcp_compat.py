"""``torch.distributed.checkpoint``'s own arguments, mapped to what slipstream does.

``storage_writer`` / ``storage_reader`` of DCP's filesystem and fsspec classes become a
location (their path), and the options slipstream can honour become its own; DCP's
default planners, default-configured, plan what slipstream plans. Anything else (a planner
or storage class of your own, DCP's Hugging Face writer and reader, an option slipstream
cannot honour) is a :class:`HandOff`: the call goes to DCP itself, unchanged, and the
reason is logged. A silent approximation of a DCP feature would be worse than either.

**Hand-off.** Invariant: a handed-off call runs DCP's own function with exactly the DCP
arguments the caller gave, so it does what DCP does, return value and errors included; the
only thing slipstream adds is one log line per reason and process, saying why.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    state_dict_loader,
    state_dict_saver,
)
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import SerializationFormat, _FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from .storage import Location


@dataclass(frozen=True)
class HandOff:
    """A call slipstream does not serve: DCP runs it, for ``reason``."""

    reason: str


class _NotServed(Exception):
    """Raised inside this module where an argument asks for what only DCP does."""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_FSSPEC_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "abfs"}
"""fsspec protocols whose URLs slipstream's object storage takes (``gcs://`` as ``gs://``)."""


def _fsspec_classes() -> tuple[type, ...]:
    try:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:  # fsspec is not installed: nobody can pass these
        return ()
    return (FsspecWriter, FsspecReader)


def _location_from_fsspec(argument: str, storage: Any) -> str:
    """The slipstream location of an fsspec writer or reader's URL."""
    url = str(os.fspath(storage.path))
    options = dict(getattr(storage.fs.fs, "storage_options", {}) or {})
    if options:
        raise _NotServed(
            f"{argument}: {type(storage).__name__} was given fsspec options "
            f"{sorted(options)}; slipstream's object storage takes storage_options= instead"
        )
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else None
    if scheme is None or scheme == "file":
        return url
    if scheme == "memory":
        raise _NotServed(f"{argument}: {url!r} is fsspec's in-process filesystem")
    if scheme not in _FSSPEC_SCHEMES:
        raise _NotServed(f"{argument}: slipstream has no backend for fsspec's {scheme!r}")
    return _FSSPEC_SCHEMES[scheme] + url[len(scheme) :]


@dataclass(frozen=True)
class SaveTarget:
    """Where a save goes and what its DCP arguments ask of it."""

    location: Location
    overwrite: bool = True
    """``False`` (``FileSystemWriter(overwrite=False)``): fail if a checkpoint is there."""


def _check_writer_options(writer: Any) -> bool:
    """Hand off the writer options slipstream cannot honour; return ``overwrite``.

    Honoured: ``overwrite``; ``sync_files=False`` (slipstream syncs anyway: more durable
    than asked, never less). Performance knobs slipstream sets its own way, and ignores:
    ``thread_count`` (``SaveOptions.io_threads``), ``per_thread_copy_ahead``,
    ``cache_staged_state_dict`` (staging buffers are always reused).
    """
    name = type(writer).__name__
    if not getattr(writer, "single_file_per_rank", True):
        raise _NotServed(
            f"storage_writer: {name}(single_file_per_rank=False) asks for a file per tensor"
        )
    extensions = getattr(getattr(writer, "transforms", None), "extensions", ())
    if extensions:
        raise _NotServed(f"storage_writer: {name} has stream extensions {list(extensions)}")
    serialization = getattr(writer, "serialization_format", SerializationFormat.TORCH_SAVE)
    if serialization != SerializationFormat.TORCH_SAVE:
        raise _NotServed(f"storage_writer: {name}(serialization_format={serialization})")
    return bool(getattr(writer, "overwrite", True))


def save_target(
    checkpoint_id: Location | None,
    storage_writer: Any,
    planner: Any,
    use_collectives: bool,
) -> SaveTarget | HandOff:
    """The location and options of a save given DCP's arguments, or why DCP must run it
    (see the module docstring). As in ``dcp.save``, ``checkpoint_id`` wins over the
    writer's path when both are given."""
    if storage_writer is None and checkpoint_id is None:
        raise ValueError("save needs checkpoint_id= (or a DCP storage_writer=)")
    try:
        if planner is not None:
            _check_planner("planner", planner, DefaultSavePlanner, _DEFAULT_SAVE_PLANNER)
        if not use_collectives:
            raise _NotServed("use_collectives=False: DCP then writes a metadata file per rank")
        if storage_writer is None:
            assert checkpoint_id is not None, "checked above"
            return SaveTarget(checkpoint_id)
        path = _storage_location(
            "storage_writer", storage_writer, (FileSystemWriter, _FileSystemWriter), 0
        )
        overwrite = _check_writer_options(storage_writer)
    except _NotServed as exc:
        return HandOff(str(exc))
    return SaveTarget(checkpoint_id if checkpoint_id is not None else path, overwrite)


def _storage_location(
    argument: str, storage: Any, filesystem_types: tuple[type, ...], fsspec_index: int
) -> Location:
    """The location a DCP writer or reader stands for: the path of DCP's filesystem class,
    the URL of its fsspec class (``fsspec_index`` picks writer or reader); any other class
    is one only DCP runs."""
    fsspec = _fsspec_classes()
    if type(storage) in filesystem_types:
        return storage.path  # type: ignore[no-any-return]
    if fsspec and type(storage) is fsspec[fsspec_index]:
        return _location_from_fsspec(argument, storage)
    raise _NotServed(f"{argument}: {type(storage).__module__}.{type(storage).__name__}")


def load_target(
    checkpoint_id: Location | None, storage_reader: Any, planner: Any
) -> Location | HandOff:
    """The location of a load given DCP's arguments (``checkpoint_id`` wins, as in DCP),
    or why DCP must run it."""
    if storage_reader is None and checkpoint_id is None:
        raise ValueError("load needs checkpoint_id= (or a DCP storage_reader=)")
    try:
        if planner is not None:
            _check_planner("planner", planner, DefaultLoadPlanner, _DEFAULT_LOAD_PLANNER)
        if storage_reader is None:
            assert checkpoint_id is not None, "checked above"
            return checkpoint_id
        path = _storage_location("storage_reader", storage_reader, (FileSystemReader,), 1)
    except _NotServed as exc:
        return HandOff(str(exc))
    return checkpoint_id if checkpoint_id is not None else path


def reader_extensions(storage_reader: Any) -> ExtensionRegistry | None:
    """The registry of stream extensions a DCP reader decodes records with
    (``FileSystemReader(_extension_registry=...)``); ``None`` without a reader."""
    registry = getattr(getattr(storage_reader, "transforms", None), "extension_registry", None)
    return registry if isinstance(registry, ExtensionRegistry) else None


def writer_storage_meta(storage_writer: Any, checkpoint_id: Location | None) -> StorageMeta | None:
    """What DCP records as the checkpoint's ``storage_meta`` for a save through
    ``storage_writer`` (``None`` without one): as ``dcp.save`` does, the writer is first
    reset to ``checkpoint_id`` when both are given, which draws it a new ``save_id``."""
    if storage_writer is None:
        return None
    if checkpoint_id is not None and isinstance(checkpoint_id, (str, os.PathLike)):
        storage_writer.reset(checkpoint_id)
    meta = storage_writer.storage_meta()
    return meta if isinstance(meta, StorageMeta) else None


_DEFAULT_SAVE_PLANNER = {
    "flatten_state_dict": True,
    "flatten_sharded_tensors": True,
    "dedup_save_to_lowest_rank": False,
}
_DEFAULT_LOAD_PLANNER = {
    "flatten_state_dict": True,
    "flatten_sharded_tensors": True,
    "allow_partial_load": False,
}


def _check_planner(argument: str, planner: Any, default: type, settings: dict[str, Any]) -> None:
    """Accept ``default`` configured as DCP configures it by default; anything else is
    DCP's to run.

    slipstream plans its own way (flattened keys, sharded tensors by their chunks,
    replicated tensors spread over ranks, plans cached per layout); it cannot run a
    planner's hooks, and would otherwise ignore them silently.
    """
    if type(planner) is not default:
        raise _NotServed(f"{argument}: {type(planner).__module__}.{type(planner).__name__}")
    changed = {
        k: getattr(planner, k, v) for k, v in settings.items() if getattr(planner, k, v) != v
    }
    if changed:
        what = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        raise _NotServed(f"{argument}: {default.__name__}({what})")


@dataclass(frozen=True)
class AsyncStaging:
    """How slipstream serves ``dcp.async_save``'s staging arguments."""

    returns_at_once: bool
    """DCP returns at once (an ``AsyncSaveResponse``, staging on the stager's thread)
    rather than once staged (a ``Future``): an ``async_stager`` that stages
    asynchronously."""
    note: str | None
    """What slipstream does instead of what the arguments asked for (logged once)."""


def async_staging(async_checkpointer_type: Any, async_stager: Any) -> AsyncStaging | HandOff:
    """``dcp.async_save``'s ``async_checkpointer_type`` and ``async_stager``, served by
    slipstream's own staging: its reused buffers (pinned where the state is on an
    accelerator), copied and written on its own threads. A stager other than DCP's
    ``DefaultStager`` is DCP's to run (its ``stage`` may do anything)."""
    notes = []
    if getattr(async_checkpointer_type, "value", "thread") != "thread":
        notes.append(
            f"async_checkpointer_type={async_checkpointer_type}: slipstream saves on threads "
            "of this process (its copies and writes release the GIL)"
        )
    returns_at_once = False
    if async_stager is not None:
        if type(async_stager) is not DefaultStager:
            return HandOff(
                f"async_stager: {type(async_stager).__module__}.{type(async_stager).__name__}"
            )
        config = getattr(async_stager, "_config", StagingOptions())
        returns_at_once = bool(config.use_async_staging)
        notes.append(
            "async_stager: slipstream stages into its own reused buffers (pinned where the "
            "state is on an accelerator) on its own thread; the DefaultStager is not used"
        )
    return AsyncStaging(returns_at_once, "; ".join(notes) or None)


logger = logging.getLogger("slipstream.dcp")

# DCP's own functions, taken from the modules that define them when this module is first
# imported: users swap slipstream in by rebinding ``torch.distributed.checkpoint.save``
# (and load, async_save), and a hand-off must still reach DCP, not come back here.
_dcp_save = state_dict_saver.save
_dcp_async_save = state_dict_saver.async_save
_dcp_load = state_dict_loader.load

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(message: str) -> None:
    """Log ``message`` at INFO, the first time this process sees it."""
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    logger.info("%s", message)


def dcp_checkpoint_id(
    checkpoint_id: Location | None, storage_options: dict[str, Any] | None, why: HandOff
) -> str | os.PathLike[str] | None:
    """``checkpoint_id`` as DCP takes it; slipstream's own storage arguments cannot go
    to DCP, and are refused naming why the call had to."""
    if storage_options:
        raise ValueError(
            f"storage_options= configures slipstream's storage, but this call goes to "
            f"torch.distributed.checkpoint ({why.reason})"
        )
    if isinstance(checkpoint_id, str) and checkpoint_id.startswith("memory://"):
        raise ValueError(
            f"checkpoint_id={checkpoint_id!r} is slipstream's in-process storage, which "
            f"torch.distributed.checkpoint, which this call goes to, cannot reach ({why.reason})"
        )
    if checkpoint_id is None or isinstance(checkpoint_id, (str, os.PathLike)):
        return checkpoint_id
    raise TypeError(
        f"checkpoint_id: a slipstream {type(checkpoint_id).__name__} cannot be given to "
        f"torch.distributed.checkpoint, which this call goes to ({why.reason})"
    )


def save(why: HandOff, state_dict: dict[str, Any], **dcp_arguments: Any) -> Any:
    """``dcp.save`` (returns its ``Metadata``)."""
    log_once(f"slipstream hands this save to torch.distributed.checkpoint: {why.reason}")
    return _dcp_save(state_dict, **dcp_arguments)


def async_save(why: HandOff, state_dict: dict[str, Any], **dcp_arguments: Any) -> Any:
    """``dcp.async_save`` (returns its ``Future`` or ``AsyncSaveResponse``)."""
    log_once(f"slipstream hands this async_save to torch.distributed.checkpoint: {why.reason}")
    return _dcp_async_save(state_dict, **dcp_arguments)


def load(why: HandOff, state_dict: dict[str, Any], **dcp_arguments: Any) -> None:
    """``dcp.load``, which unpickles the checkpoint's values with no allow-list."""
    log_once(
        f"slipstream hands this load to torch.distributed.checkpoint: {why.reason} (DCP "
        "unpickles its values without slipstream's allow-list)"
    )
    _dcp_load(state_dict, **dcp_arguments)
