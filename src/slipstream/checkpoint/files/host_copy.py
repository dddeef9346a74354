"""A copy of a checkpoint's object tree whose tensors live in reused host memory.

:meth:`HostCopy.copy` returns a deep copy of a tree (dicts, lists, tuples, any picklable
object) in which every tensor found through its containers is a view of a host storage that
this ``HostCopy`` keeps and reuses on the next copy, with the same size, stride and storage
offset as the original; tensors that shared a storage share one in the copy. So
``torch.save`` of the copy writes the same storages, the same views and the same pickled
structure as ``torch.save`` of the original, and storages that came from an accelerator
keep their device's location tag (a load puts them back where ``torch.save`` would).
Tensors reached only through other objects, and tensors without a plain strided storage
(sparse, quantized, nested), are copied by ``copy.deepcopy``.

Reuse is keyed by the source storage (device, address, size): a training loop's parameters
and optimizer state keep their storages from step to step, so from the second copy on no
host memory is allocated or first touched. Storages a copy did not use are let go.

Invariant: :meth:`copy` returns only once every byte is copied (device copies waited for),
and it never writes a storage while a reader the caller named with :meth:`hold` still has
it: it waits for :meth:`release` first, up to its timeout.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.serialization

from ...core import streams
from ...errors import PeerTimeoutError

_StorageKey = tuple[str, int, int]


@dataclass
class _HostStorage:
    storage: torch.UntypedStorage
    location: str
    """The source's location tag (``"cpu"``, ``"cuda:0"``): what ``torch.save`` records."""


class HostCopy:
    """Reused host storages for the copies of one state, and who reads the last copy."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._storages: dict[_StorageKey, _HostStorage] = {}
        self._readers = 0
        self._lock = threading.Condition()
        weakref.finalize(self, _forget, self._storages.values)

    def hold(self) -> None:
        """Mark the last copy as being read (a write of it in flight)."""
        with self._lock:
            self._readers += 1

    def release(self) -> None:
        """The reader that called :meth:`hold` is done with the last copy."""
        with self._lock:
            self._readers -= 1
            self._lock.notify_all()

    @property
    def nbytes(self) -> int:
        """Host bytes kept for reuse."""
        return sum(s.storage.nbytes() for s in self._storages.values())

    def copy(self, tree: Any) -> Any:
        """A deep copy of ``tree`` with its tensors in this object's host storages."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._readers == 0, self.timeout):
                raise PeerTimeoutError(
                    f"the previous checkpoint copy was still being written after "
                    f"{self.timeout:g} s; a new copy would overwrite it"
                )
        tensors = _tensors_in(tree)
        used: dict[_StorageKey, _HostStorage] = {}
        memo: dict[int, Any] = {}
        devices: set[torch.device] = set()
        for tensor in tensors:
            if not _plain_strided(tensor):
                continue
            source = tensor.untyped_storage()
            key = (str(source.device), source.data_ptr(), source.nbytes())
            host = used.get(key)
            if host is None:
                host = self._storages.get(key) or self._allocate(source)
                host.storage.copy_(source, non_blocking=source.device.type != "cpu")
                if source.device.type != "cpu":
                    devices.add(source.device)
                used[key] = host
            memo[id(tensor)] = _view(tensor, host.storage)
        for device in devices:
            stream = streams.current_stream(device)
            if stream is not None:
                stream.synchronize()
        for dropped in self._storages.keys() - used.keys():
            _locations.pop(self._storages[dropped].storage.data_ptr(), None)
        self._storages.clear()
        self._storages.update(used)
        _locations.update(
            {h.storage.data_ptr(): h.location for h in used.values() if h.location != "cpu"}
        )
        return copy.deepcopy(tree, memo)

    def _allocate(self, source: torch.UntypedStorage) -> _HostStorage:
        pin = source.device.type != "cpu" and torch.cuda.is_available()
        storage = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
        location = torch.serialization.location_tag(source)
        return _HostStorage(storage, location)


def _plain_strided(tensor: torch.Tensor) -> bool:
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout is torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type != "meta"
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _view(tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    view = torch.empty(0, dtype=tensor.dtype).set_(
        storage, tensor.storage_offset(), tensor.size(), tensor.stride()
    )
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
    return view.requires_grad_(tensor.requires_grad) if tensor.is_leaf else view


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor reachable through dicts, lists and tuples (each once)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [tree]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, (Mapping, list, tuple)) and id(value) not in seen:
            seen.add(id(value))
            stack.extend(value.values() if isinstance(value, Mapping) else value)
    return list(found.values())


_locations: dict[int, str] = {}
"""Address of a live :class:`HostCopy`'s storage of an accelerator's -> that location tag."""


def _forget(storages: Any) -> None:
    for host in list(storages()):
        _locations.pop(host.storage.data_ptr(), None)


def _location_of_copy(storage: Any) -> str | None:
    """``torch.save``'s location tag for a host copy of an accelerator's storage."""
    if getattr(storage, "device", None) is None or storage.device.type != "cpu":
        return None
    location = _locations.get(storage.data_ptr())
    return None if location in (None, "cpu") else location


torch.serialization.register_package(0, _location_of_copy, lambda obj, location: None)
