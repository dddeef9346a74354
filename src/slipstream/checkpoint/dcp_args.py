"""``torch.distributed.checkpoint``'s own arguments, mapped to what slipstream does.

``storage_writer`` / ``storage_reader`` of DCP's filesystem and fsspec classes become a
location (their path), and the options slipstream can honour become its own; DCP's
default planners, default-configured, plan what slipstream plans. Anything else (a planner
or storage class of your own, an option slipstream cannot honour) is refused before
anything is written or read, by an error that names the argument and says why: a silent
approximation of a DCP feature would be worse than none.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.filesystem import SerializationFormat, _FileSystemWriter

from .storage import Location

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
        raise ValueError(
            f"{argument}: {type(storage).__name__} was given fsspec options "
            f"{sorted(options)}; slipstream's object storage is configured differently: "
            "pass storage_options= (see docs/storage.md) and checkpoint_id= instead"
        )
    match = _SCHEME.match(url)
    scheme = match.group(1).lower() if match else None
    if scheme is None or scheme == "file":
        return url
    if scheme == "memory":
        raise ValueError(
            f"{argument}: {url!r} is fsspec's in-process filesystem, which slipstream does "
            "not write to or read from; checkpoint_id='memory://...' is slipstream's own"
        )
    if scheme not in _FSSPEC_SCHEMES:
        raise ValueError(
            f"{argument}: slipstream has no backend for fsspec's {scheme!r} protocol "
            f"({url!r}); it writes to local paths and s3://, gs://, az://, abfs:// URLs"
        )
    return _FSSPEC_SCHEMES[scheme] + url[len(scheme) :]


@dataclass(frozen=True)
class SaveTarget:
    """Where a save goes and what its DCP arguments ask of it."""

    location: Location
    overwrite: bool = True
    """``False`` (``FileSystemWriter(overwrite=False)``): fail if a checkpoint is there."""


def _check_writer_options(writer: Any) -> bool:
    """Refuse the writer options slipstream cannot honour; return ``overwrite``.

    Honoured: ``overwrite``; ``sync_files=False`` (slipstream syncs anyway: more durable
    than asked, never less). Performance knobs slipstream sets its own way, and ignores:
    ``thread_count`` (``SaveOptions.io_threads``), ``per_thread_copy_ahead``,
    ``cache_staged_state_dict`` (staging buffers are always reused).
    """
    name = type(writer).__name__
    if not getattr(writer, "single_file_per_rank", True):
        raise ValueError(
            f"storage_writer: {name}(single_file_per_rank=False) asks for a file per tensor; "
            "slipstream writes one file per rank (DCP and slipstream read either)"
        )
    extensions = getattr(getattr(writer, "transforms", None), "extensions", ())
    if extensions:
        raise ValueError(
            f"storage_writer: {name} has stream extensions {list(extensions)}; slipstream "
            "writes records untransformed and cannot apply them"
        )
    serialization = getattr(writer, "serialization_format", SerializationFormat.TORCH_SAVE)
    if serialization != SerializationFormat.TORCH_SAVE:
        raise ValueError(
            f"storage_writer: {name}(serialization_format={serialization}) is not supported; "
            "slipstream writes DCP's default torch.save records"
        )
    return bool(getattr(writer, "overwrite", True))


def save_target(
    checkpoint_id: Location | None,
    storage_writer: Any,
    planner: Any,
    use_collectives: bool,
) -> SaveTarget:
    """The location and options of a save given DCP's arguments (see the module docstring).

    As in ``dcp.save``, ``checkpoint_id`` wins over the writer's path when both are given.
    """
    if planner is not None:
        _check_planner("planner", planner, DefaultSavePlanner, _DEFAULT_SAVE_PLANNER)
    if not use_collectives:
        raise ValueError(
            "use_collectives=False: DCP then writes a metadata file per rank; slipstream "
            "writes one .metadata, coordinated through the job's store (it runs no "
            "collective on your process group either way), so leave it at True"
        )
    if storage_writer is None:
        if checkpoint_id is None:
            raise ValueError("save needs checkpoint_id= (or a DCP storage_writer=)")
        return SaveTarget(checkpoint_id)
    path = _storage_location(
        "storage_writer", storage_writer, (FileSystemWriter, _FileSystemWriter), 0, "dcp.save"
    )
    overwrite = _check_writer_options(storage_writer)
    return SaveTarget(checkpoint_id if checkpoint_id is not None else path, overwrite)


def _storage_location(
    argument: str, storage: Any, filesystem_types: tuple[type, ...], fsspec_index: int, runs: str
) -> Location:
    """The location a DCP writer or reader stands for: the path of DCP's filesystem class,
    the URL of its fsspec class (``fsspec_index`` picks writer or reader); any other class
    is refused naming the argument."""
    fsspec = _fsspec_classes()
    if type(storage) in filesystem_types:
        return storage.path  # type: ignore[no-any-return]
    if fsspec and type(storage) is fsspec[fsspec_index]:
        return _location_from_fsspec(argument, storage)
    kinds = ("Writer", "Reader")[fsspec_index]
    raise TypeError(
        f"{argument}: {type(storage).__module__}.{type(storage).__name__} is not one "
        f"slipstream can stand in for; it takes DCP's FileSystem{kinds} and Fsspec{kinds} "
        f"(their path and options). A storage class of your own runs only under {runs}, "
        "or implement slipstream's Storage (docs/storage.md)"
    )


def load_target(checkpoint_id: Location | None, storage_reader: Any, planner: Any) -> Location:
    """The location of a load given DCP's arguments (``checkpoint_id`` wins, as in DCP)."""
    if planner is not None:
        _check_planner("planner", planner, DefaultLoadPlanner, _DEFAULT_LOAD_PLANNER)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("load needs checkpoint_id= (or a DCP storage_reader=)")
        return checkpoint_id
    path = _storage_location("storage_reader", storage_reader, (FileSystemReader,), 1, "dcp.load")
    return checkpoint_id if checkpoint_id is not None else path


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
    """Accept ``default`` configured as DCP configures it by default; refuse anything else.

    slipstream plans its own way (flattened keys, sharded tensors by their chunks,
    replicated tensors spread over ranks, plans cached per layout); a planner that asks
    for something else would be silently ignored, so it is refused.
    """
    if type(planner) is not default:
        raise TypeError(
            f"{argument}: {type(planner).__module__}.{type(planner).__name__} is not "
            f"DCP's {default.__name__}; slipstream plans saves and loads itself and cannot "
            "run a planner's hooks (a planner of your own runs only under DCP)"
        )
    changed = {
        k: getattr(planner, k, v) for k, v in settings.items() if getattr(planner, k, v) != v
    }
    if changed:
        what = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        raise ValueError(
            f"{argument}: {default.__name__}({what}) is not supported; slipstream does what "
            f"the default {default.__name__}() does ({_why_not(changed)})"
        )


def _why_not(changed: dict[str, Any]) -> str:
    if "allow_partial_load" in changed:
        return (
            "every key of the state dict must be in the checkpoint; strict=False ignores the "
            "checkpoint's keys you do not ask for"
        )
    if "dedup_save_to_lowest_rank" in changed:
        return "replicated tensors are spread over the ranks that hold them"
    return "state dicts are flattened, sharded tensors saved by their chunks"


def check_async_arguments(async_checkpointer_type: Any, async_stager: Any) -> None:
    """Refuse ``dcp.async_save`` options slipstream cannot honour."""
    if async_checkpointer_type is not None and getattr(async_checkpointer_type, "value", "") != (
        "thread"
    ):
        raise ValueError(
            f"async_checkpointer_type={async_checkpointer_type}: slipstream saves on threads "
            "of the calling process (AsyncCheckpointerType.THREAD)"
        )
    if async_stager is not None:
        raise ValueError(
            f"async_stager: slipstream stages into its own reusable buffers beside training "
            f"(pinned on accelerators) and cannot use a {type(async_stager).__name__}; leave "
            "it out"
        )
