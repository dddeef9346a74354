"""Which globals a checkpoint's pickles may name: plain data, rebuilt from data.

A pickle runs code only through the globals it names: the unpickler imports each one and
may call it. :class:`Trust` is the set of globals an unpickler resolves; everything else is
refused before it is imported.

Invariant of :data:`PLAIN_DATA`: every global on it is a class or function that only builds
a value out of its arguments (no I/O, no import, no attribute lookup by name, nothing run
from the data), so that no combination of them, called in any order with any arguments a
pickle can build, does more than construct values. Types a user trusts (``trusted=``) are
the user's call.

Beyond it, two lists resolve by name only, never by the import of a name a pickle chose:
:data:`WELL_KNOWN` (configuration containers of widely used libraries, imported from their
fixed module the first time a pickle names one), and the classes a user allows for the
whole process with :func:`allow_types`.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import datetime
import decimal
import fractions
import importlib
import pathlib
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch._weights_only_unpickler as _torch_safe

TrustedEntry = type | Callable[..., Any] | str
"""A trusted global: the class or function itself, or its ``"module.qualname"``."""


def _standard_library() -> dict[str, Any]:
    found: dict[str, Any] = {
        "argparse.Namespace": argparse.Namespace,
        "collections.OrderedDict": collections.OrderedDict,
        "collections.defaultdict": collections.defaultdict,
        "collections.deque": collections.deque,
        "collections.Counter": collections.Counter,
        "datetime.date": datetime.date,
        "datetime.time": datetime.time,
        "datetime.datetime": datetime.datetime,
        "datetime.timedelta": datetime.timedelta,
        "datetime.timezone": datetime.timezone,
        "decimal.Decimal": decimal.Decimal,
        "fractions.Fraction": fractions.Fraction,
        "uuid.UUID": uuid.UUID,
        "uuid.SafeUUID": uuid.SafeUUID,
        "_codecs.encode": _torch_safe.encode,
    }
    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath"):
        found[f"pathlib.{name}"] = getattr(pathlib, name)
    found["pathlib.PureWindowsPath"] = pathlib.PureWindowsPath
    # defaultdict's factory and the builtin containers and numbers: constructors only.
    for builtin in (list, dict, set, frozenset, int, float, complex, bytearray, slice, range):
        found[f"builtins.{builtin.__name__}"] = builtin
    return found


def _numpy() -> dict[str, Any]:
    """numpy arrays, scalars, dtypes, and random generators and their states, under the
    module names numpy 1.x and 2.x both write (``numpy.core`` / ``numpy._core``)."""
    try:
        import numpy as np
        import numpy.random._pickle as np_random_pickle
        from numpy.random.bit_generator import SeedSequence
    except ImportError:
        return {}
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x before numpy._core existed
        multiarray = importlib.import_module("numpy.core.multiarray")
    found: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found[f"{module}._reconstruct"] = multiarray._reconstruct
        found[f"{module}.scalar"] = multiarray.scalar
    # numpy 2 pickles a dtype as numpy.dtype, and some versions by its class (numpy.dtypes).
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in dir(dtypes):
            if name.endswith("DType"):
                found[f"numpy.dtypes.{name}"] = getattr(dtypes, name)
    for name in ("__bit_generator_ctor", "__generator_ctor", "__randomstate_ctor"):
        found[f"numpy.random._pickle.{name}"] = getattr(np_random_pickle, name)
    for name, cls in np_random_pickle.BitGenerators.items():
        found[f"{cls.__module__}.{name}"] = cls
    found["numpy.random.bit_generator.SeedSequence"] = SeedSequence
    unpickle_seed = getattr(
        importlib.import_module("numpy.random.bit_generator"), "__pyx_unpickle_SeedSequence", None
    )
    if unpickle_seed is not None:
        found["numpy.random.bit_generator.__pyx_unpickle_SeedSequence"] = unpickle_seed
    return found


def _torch_values() -> dict[str, Any]:
    """What ``torch.load(weights_only=True)`` accepts: tensors, dtypes, devices, sizes."""
    return dict(_torch_safe._get_allowed_globals())


def plain_data() -> dict[str, Any]:
    """The default allow-list, by ``"module.name"`` (see the module docstring)."""
    return {**_torch_values(), **_standard_library(), **_numpy()}


PLAIN_DATA = plain_data()


def _well_known() -> frozenset[str]:
    names = {"omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig"}
    names |= {f"omegaconf.base.{n}" for n in ("Metadata", "ContainerMetadata")}
    nodes = ["ValueNode", "AnyNode", "StringNode", "PathNode", "IntegerNode", "BytesNode"]
    nodes += ["FloatNode", "BooleanNode", "EnumNode", "LiteralNode"]
    names |= {f"omegaconf.nodes.{n}" for n in nodes}
    names |= {f"typing.{n}" for n in ("Any", "Dict", "List", "Tuple", "Optional", "Union")}
    names |= {
        "lightning.fabric.utilities.data.AttributeDict",
        "lightning.pytorch.utilities.parsing.AttributeDict",
        "pytorch_lightning.utilities.parsing.AttributeDict",
    }
    return frozenset(names)


WELL_KNOWN = _well_known()
"""Globals of widely used libraries that hold configuration as plain data: omegaconf's
containers, their metadata and value nodes (whose ``__setstate__`` only stores the state
it is given; a node's ``Enum`` or structured-config class is still looked up on its own),
the ``typing`` markers they record, and Lightning's ``AttributeDict`` (a ``dict``).
Resolved by importing their own module, named here, never one a pickle names."""

_well_known_cache: dict[str, Any] = {}


def _import_well_known(full_name: str) -> Any | None:
    """The object of a :data:`WELL_KNOWN` name, or ``None`` if its library is missing."""
    found = _well_known_cache.get(full_name)
    if found is None and full_name in WELL_KNOWN:
        module, _, name = full_name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
        _well_known_cache[full_name] = found
    return found


_allowed_lock = threading.Lock()
_allowed: dict[str, Any] = {}
"""Classes the process allows (:func:`allow_types`), by ``"module.qualname"``."""


def _entry_name(entry: TrustedEntry) -> tuple[str, Any]:
    if isinstance(entry, str):
        return entry, _resolve_name(entry)
    if callable(entry):
        return f"{entry.__module__}.{entry.__qualname__}", entry
    raise TypeError(f"{entry!r} is neither a class, a function nor a 'module.Name'")


class AllowedTypes:
    """Classes :func:`allow_types` allowed; :meth:`revoke` (or leaving a ``with`` block)
    takes back those this call added."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.names = names

    def revoke(self) -> None:
        with _allowed_lock:
            for name, obj in self.names.items():
                if _allowed.get(name) is obj:
                    del _allowed[name]

    def __enter__(self) -> AllowedTypes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.revoke()


def allow_types(*entries: TrustedEntry) -> AllowedTypes:
    """Allow these classes (or their ``"module.Name"``) in every load's plain values, in
    this process, beside the plain data and :data:`WELL_KNOWN`.

    Allow a class only if building it from any state a pickle can give does nothing but
    store that state: a dataclass or plain class without ``__reduce__``/``__setstate__``
    of its own, or an ``Enum`` with members (calling it looks a member up by value; its
    functional API refuses to extend it). Returns a handle
    whose :meth:`~AllowedTypes.revoke` (or ``with``) takes them back.
    """
    added: dict[str, Any] = {}
    for entry in entries:
        name, obj = _entry_name(entry)
        added[name] = obj
    with _allowed_lock:
        fresh = {k: v for k, v in added.items() if k not in _allowed}
        _allowed.update(fresh)
    return AllowedTypes(fresh)


def resolve_allowed(full_name: str) -> Any | None:
    """What ``full_name`` resolves to without ``trusted=``: plain data, a well-known
    library's configuration class, or a class allowed by :func:`allow_types`."""
    found = PLAIN_DATA.get(full_name)
    if found is None:
        found = _allowed.get(full_name)
    if found is None and full_name in WELL_KNOWN:
        found = _import_well_known(full_name)
    return found


def canonical_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 calls it (protocol 2 pickles say ``__builtin__`` etc.)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _resolve_name(text: str) -> Any:
    """Import ``"package.module.Qualname"``: the longest importable module prefix, then
    attributes (the user named it, so importing it is the user's choice)."""
    parts = text.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ValueError(f"cannot import {text!r} (expected the 'module.Name' of a class)")


@dataclass(frozen=True)
class Trust:
    """What an unpickler of checkpoint data may resolve.

    ``everything`` trusts the whole checkpoint: its pickles are loaded as ``pickle`` and
    ``dcp.load`` load them, which runs whatever code they name.
    """

    extra: dict[str, Any] = field(default_factory=dict)
    everything: bool = False

    @classmethod
    def of(cls, trusted: Trust | bool | Iterable[TrustedEntry] | None) -> Trust:
        """``trusted`` as given to ``load``: ``True`` (everything), a list of classes,
        functions or their ``"module.Name"`` names, or ``None``/``False``/``()``."""
        if isinstance(trusted, Trust):
            return trusted
        if trusted is True:
            return cls(everything=True)
        if trusted is None or trusted is False:
            return cls()
        if isinstance(trusted, str):
            trusted = [trusted]
        extra: dict[str, Any] = {}
        for entry in trusted:
            try:
                name, obj = _entry_name(entry)
            except TypeError as exc:
                raise TypeError(f"trusted: {exc}") from None
            extra[name] = obj
        return cls(extra)

    def resolve(self, full_name: str) -> Any | None:
        """The object ``full_name`` stands for, or ``None`` if it is not trusted."""
        found = resolve_allowed(full_name)
        return found if found is not None else self.extra.get(full_name)

    def allowed(self, names: Iterable[str]) -> dict[str, Any]:
        """Every global this trust resolves, by name: the plain data, and of ``names``
        (those a pickle asks for) the ones resolved beyond it."""
        found = {**PLAIN_DATA, **self.extra}
        for name in names:
            obj = self.resolve(name)
            if obj is not None:
                found[name] = obj
        return found


DEFAULT_TRUST = Trust()

Trusted = Trust | bool | Iterable[TrustedEntry] | None
"""What ``load(trusted=...)`` takes (see :meth:`Trust.of`)."""
