"""Where checkpoints live: a path or URL resolved to a :class:`Storage` backend.

``resolve_storage`` maps what the user passes as ``checkpoint_id`` or ``root``:

* a :class:`Storage` instance: used as it is (a backend of your own);
* ``scheme://...`` for a scheme registered with :func:`register_storage`;
* ``s3://``, ``gs://``, ``az://``, ``abfs://``: :class:`ObjectStorage` (needs
  ``pip install "slipstream[s3]"``);
* ``memory://name/prefix``: :class:`MemoryStorage`, an object store in this process;
* ``file://path`` or a plain path: :class:`LocalStorage`.

Any other ``scheme://`` raises, naming it, before anything is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from .base import DataWriter, Storage
from .local import LocalStorage
from .memory import MemoryStorage

OBJECT_STORE_SCHEMES = ("s3", "gs", "az", "abfs")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_registered: dict[str, Callable[[str, dict[str, Any]], Storage]] = {}

Location = str | os.PathLike[str] | Storage


def register_storage(scheme: str, factory: Callable[[str, dict[str, Any]], Storage]) -> None:
    """Route ``scheme://...`` locations to ``factory(url, storage_options)``."""
    _registered[scheme.lower()] = factory


def resolve_storage(
    location: Location,
    storage_options: dict[str, Any] | None = None,
    *,
    spare_dir_name: str | None = None,
    direct_io: bool = True,
) -> Storage:
    """The backend for ``location`` (see the module docstring).

    ``spare_dir_name``: on the local disk, keep retired data files in this directory under
    ``location`` for reuse (a ``Checkpointer`` root); ignored by other backends.
    """
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match else None
    options = dict(storage_options or {})
    if scheme in _registered:
        return _registered[scheme](text, options)
    if scheme in OBJECT_STORE_SCHEMES:
        from .object_store import ObjectStorage

        return ObjectStorage(text, options)
    if scheme == "memory":
        if options:
            raise CheckpointError(f"storage_options {sorted(options)} do not apply to {text!r}")
        return MemoryStorage(text)
    if scheme not in (None, "file"):
        known = sorted({"file", "memory", *OBJECT_STORE_SCHEMES, *_registered})
        raise CheckpointError(
            f"unknown storage scheme {scheme!r} in {text!r}; known schemes: "
            f"{', '.join(s + '://' for s in known)} or a local path"
        )
    if options:
        raise CheckpointError(
            f"storage_options {sorted(options)} were given for the local path {text!r}; "
            "they apply to object stores only"
        )
    path = Path(text[len("file://") :] if scheme == "file" else text)
    spare_dir = path / spare_dir_name if spare_dir_name else None
    return LocalStorage(path, spare_dir=spare_dir, direct_io=direct_io)


__all__ = [
    "DataWriter",
    "LocalStorage",
    "Location",
    "MemoryStorage",
    "OBJECT_STORE_SCHEMES",
    "Storage",
    "register_storage",
    "resolve_storage",
]
