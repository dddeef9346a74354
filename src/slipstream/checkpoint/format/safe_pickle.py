"""Reading pickles from a checkpoint without ever running code from it.

``.metadata`` is read by an unpickler that resolves only the classes DCP's metadata is
made of; non-tensor values by one that resolves the plain-data globals of
:mod:`.safe_types` (tensors, numpy arrays and random states, paths, dates, argparse
namespaces, ..., omegaconf configs, and the classes allowed by ``allow_types``). Both
add what the caller trusts (``trusted=``). A pickle that names anything else is refused
with :class:`UnsafeCheckpointError` naming every global it asks for that is not allowed
(found by a pass that resolves each global to an inert stand-in, so nothing of the
checkpoint runs), never one at a time.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import types
import zipfile
from typing import Any

import torch
import torch.distributed._shard.metadata as shard_md
import torch.distributed._shard.sharded_tensor.metadata as sharded_tensor_md
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
import torch.distributed.remote_device as remote_device

from ...errors import CorruptCheckpointError, UnsafeCheckpointError
from .safe_types import DEFAULT_TRUST, Trust, canonical_name

_METADATA_CLASSES: dict[str, Any] = {
    f"torch.distributed.checkpoint.metadata.{name}": getattr(dcp_md, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_LEGACY_METADATA_CLASSES: dict[str, Any] = {
    f"torch.distributed._shard.sharded_tensor.metadata.{name}": getattr(sharded_tensor_md, name)
    for name in ("TensorProperties", "ShardedTensorMetadata", "MEM_FORMAT_ENCODING")
}
_LEGACY_METADATA_CLASSES.update(
    {
        "torch.distributed._shard.metadata.ShardMetadata": shard_md.ShardMetadata,
        "torch.distributed.remote_device._remote_device": remote_device._remote_device,
        "torch.device": torch.device,
    }
)
"""What older DCP releases pickled into ``.metadata``: ``TensorProperties`` (and the
``MEM_FORMAT_ENCODING`` its state holds) from ``torch.distributed._shard``, and the
sharded tensor metadata beside it (``ShardedTensorMetadata``, ``ShardMetadata`` and its
``placement``, a ``_remote_device`` holding a ``torch.device``). Each is a plain data
class: unpickling one sets its fields (``TensorProperties`` maps its memory-format code to
a ``torch.memory_format``), nothing else runs."""
_METADATA_CLASSES.update(_LEGACY_METADATA_CLASSES)
_METADATA_CLASSES.update(
    {
        "torch.distributed.checkpoint.filesystem._StorageInfo": dcp_fs._StorageInfo,
        "torch.Size": torch.Size,
        "torch.serialization._get_layout": torch.serialization._get_layout,
        "collections.OrderedDict": collections.OrderedDict,
        "pathlib.PosixPath": pathlib.PurePosixPath,
        "pathlib.WindowsPath": pathlib.PureWindowsPath,
        "pathlib.PurePosixPath": pathlib.PurePosixPath,
        "pathlib.PureWindowsPath": pathlib.PureWindowsPath,
    }
)


def _metadata_global(full_name: str, trust: Trust) -> Any | None:
    found = _METADATA_CLASSES.get(full_name)
    if found is not None:
        return found
    module, _, name = full_name.rpartition(".")
    if module == "torch" and isinstance(
        getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
    ):
        return getattr(torch, name)
    return trust.extra.get(full_name)


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list; the caller lists every such global of the pickle."""


class _MetadataUnpickler(pickle.Unpickler):
    trust: Trust = DEFAULT_TRUST

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_global(canonical_name(module, name), self.trust)
        if found is None:
            raise _Refused(canonical_name(module, name))
        return found


class _ValueUnpickler(pickle.Unpickler):
    """Resolves the globals of :mod:`.safe_types` and the trusted ones; nothing else."""

    trust: Trust = DEFAULT_TRUST

    def find_class(self, module: str, name: str) -> Any:
        full_name = canonical_name(module, name)
        found = self.trust.resolve(full_name)
        if found is None:
            raise _Refused(full_name)
        return found


class _StandIn:
    """What every global resolves to while a pickle is scanned: accepts anything, runs nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, item: object) -> None:
        pass

    def extend(self, items: object) -> None:
        pass


class _ScanningUnpickler(pickle.Unpickler):
    """Records every global a pickle names, resolving each to an inert stand-in."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        full_name = canonical_name(module, name)
        if full_name not in self.names:
            self.names.append(full_name)
        return type(name, (_StandIn,), {})

    def persistent_load(self, pid: object) -> Any:
        return None


def _pickled_part(data: bytes) -> bytes:
    """The pickle of a ``torch.save`` archive (its ``data.pkl``), or ``data`` itself."""
    if not zipfile.is_zipfile(io.BytesIO(data)):
        return data
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
        return archive.read(name) if name is not None else data


def globals_named(data: bytes) -> list[str]:
    """Every global the pickle in ``data`` names (a ``torch.save`` archive or a bare
    pickle), in order, without resolving any of them to real code."""
    scanner = _ScanningUnpickler(io.BytesIO(_pickled_part(data)))
    try:
        scanner.load()
    except Exception:
        pass  # a pickle the stand-ins cannot follow to its end: report what was found
    return scanner.names


def _refusal(data: bytes, first: str, allowed: Any) -> str:
    """Why ``data`` is refused: the globals it names that ``allowed(name)`` refuses (and
    ``first``, the one the unpickler stopped at, if given)."""
    missing = [n for n in globals_named(data) if allowed(n) is None]
    if first and first not in missing:
        missing.insert(0, first)
    names = ", ".join(missing)
    listed = ", ".join(repr(n) for n in missing)
    return (
        f"needs {names}, not on the allow-list of plain data; refusing to unpickle it (a "
        "checkpoint from an untrusted place could run code this way). If you trust this "
        f"checkpoint, pass trusted=[{listed}] to load (slipstream command: "
        + " ".join(f"--trust {n}" for n in missing)
        + ")"
    )


def load_metadata(data: bytes, where: str, trust: Trust = DEFAULT_TRUST) -> dcp_md.Metadata:
    """Unpickle a DCP ``.metadata`` blob through the allow-list (and ``trust``)."""
    try:
        if trust.everything:
            metadata = pickle.loads(data)
        else:
            unpickler = _MetadataUnpickler(io.BytesIO(data))
            unpickler.trust = trust
            metadata = unpickler.load()
    except _Refused as exc:
        why = _refusal(data, str(exc), lambda n: _metadata_global(n, trust))
        raise UnsafeCheckpointError(f"{where}: checkpoint metadata {why}") from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: unreadable checkpoint metadata ({exc})") from exc
    if not isinstance(metadata, dcp_md.Metadata):
        raise CorruptCheckpointError(
            f"{where}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


def _value_pickle_module(trust: Trust) -> types.ModuleType:
    """A stand-in for the ``pickle`` module, for ``torch.load(pickle_module=...)``: torch
    reads its archive (and tensor storages), this module's Unpickler resolves globals."""
    unpickler = type("Unpickler", (_ValueUnpickler,), {"trust": trust})
    module = types.ModuleType("slipstream_safe_pickle")
    module.__dict__.update(Unpickler=unpickler, UnpicklingError=pickle.UnpicklingError)
    return module


def _torch_forces_weights_only() -> bool:
    """``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes ``torch.load`` refuse a pickle module; torch's
    own ``weights_only`` unpickler then reads values, given the same allow-list and trusted
    globals (it is stricter still: it sets items only on plain dicts, for one)."""
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def load_value(data: bytes, key: str, where: str, trust: Trust = DEFAULT_TRUST) -> object:
    """Load a non-tensor value record (``torch.save`` bytes) through the allow-list."""
    try:
        if trust.everything:
            return torch.load(io.BytesIO(data), weights_only=False)
        if _torch_forces_weights_only():
            allowed = trust.allowed(globals_named(data))
            with torch.serialization.safe_globals([(v, k) for k, v in allowed.items()]):
                return torch.load(io.BytesIO(data), weights_only=True)
        module = _value_pickle_module(trust)
        return torch.load(io.BytesIO(data), weights_only=False, pickle_module=module)
    except _Refused as exc:
        why = _refusal(data, str(exc), trust.resolve)
        raise UnsafeCheckpointError(f"{where}: value {key!r} {why}") from None
    except pickle.UnpicklingError as exc:
        if any(trust.resolve(name) is None for name in globals_named(data)):
            why = _refusal(data, "", trust.resolve)
            raise UnsafeCheckpointError(f"{where}: value {key!r} {why}") from None
        raise UnsafeCheckpointError(f"{where}: value {key!r} was refused ({exc})") from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: value {key!r} is unreadable ({exc})") from exc
