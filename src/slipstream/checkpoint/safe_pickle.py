"""Reading pickles from a checkpoint without ever running code from it.

``.metadata`` is read by an unpickler that resolves only the classes DCP's metadata is
made of; non-tensor values are read with ``torch.load(weights_only=True)`` (torch's own
allow-list, extendable by the user with ``torch.serialization.add_safe_globals``).
Anything else is refused with :class:`UnsafeCheckpointError` naming what was asked for.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md

from ..errors import CorruptCheckpointError, UnsafeCheckpointError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
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
_METADATA_CLASSES.update(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_CLASSES.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout)
        ):
            return getattr(torch, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.memory_format):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not on the allow-list; "
            "refusing to load it (a checkpoint from an untrusted place could run code this way)"
        )


def load_metadata(data: bytes, where: str) -> dcp_md.Metadata:
    """Unpickle a DCP ``.metadata`` blob through the allow-list."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{where}: {exc}") from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: unreadable checkpoint metadata ({exc})") from exc
    if not isinstance(metadata, dcp_md.Metadata):
        raise CorruptCheckpointError(
            f"{where}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


_GLOBAL_IN_MESSAGE = re.compile(
    r"GLOBAL ([\w.]+)|Unsupported class ([\w.]+)|([\w.]+) was not an allowed"
)


def load_value(data: bytes, key: str, where: str) -> object:
    """Load a non-tensor value record with torch's ``weights_only`` allow-list."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        match = _GLOBAL_IN_MESSAGE.search(str(exc))
        offending = next((g for g in match.groups() if g), None) if match else None
        what = (
            f"type {offending}" if offending else "a type outside torch's weights_only allow-list"
        )
        raise UnsafeCheckpointError(
            f"{where}: value {key!r} needs {what}; refusing to unpickle it. If you trust this "
            "checkpoint, allow the type with torch.serialization.add_safe_globals([...])"
        ) from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: value {key!r} is unreadable ({exc})") from exc
