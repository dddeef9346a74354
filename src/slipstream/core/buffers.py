"""Flat host buffers that are allocated and touched once, then reused.

First-touch page faults cost many times a warm copy, and pinned memory is slow to allocate,
so staging memory is kept in a :class:`StagingPool` keyed by layout and handed out again
on every later save or publish of the same layout.

Invariant: a buffer handed out by :meth:`StagingPool.acquire` is not handed out again until
it is released; the pool's live bytes never exceed its budget (an over-budget acquire
raises instead of allocating).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Hashable

import torch

from ..errors import SlipstreamError

_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object
_PYBUF_WRITE = 0x200


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` over a contiguous CPU tensor's bytes (no copy).

    The view does not keep ``tensor`` alive: the caller holds the tensor while using it.
    It is built straight from the address, not through a ctypes array type per tensor size
    (several times slower, paid once per tensor of a load).
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"byte_view needs a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous tensor, got strides {tensor.stride()}")
    return memory_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable ``memoryview`` of ``nbytes`` of host memory at ``address``; the caller
    keeps that memory alive while the view is in use."""
    if nbytes == 0:
        return memoryview(bytearray(0))
    view: memoryview = _memory_view(address, nbytes, _PYBUF_WRITE)
    return view


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as a flat ``uint8`` tensor (contiguous input required)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


PAGE_BYTES = 4096


def allocate_host(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat ``uint8`` host buffer of ``nbytes``, every page touched once, pinned if asked.

    The buffer starts on a page boundary, so it can be the source of ``O_DIRECT`` writes.
    Pinned memory comes page-aligned from the driver, so it is asked for at its exact size:
    torch's pinned allocator rounds every request up to a power of two, and one page more
    would turn a 1 GiB buffer into 2 GiB of pinned memory.
    """
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pin else None
    if raw is None or raw.data_ptr() % PAGE_BYTES:
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % PAGE_BYTES
    buf = raw[start : start + nbytes]
    buf.zero_()
    return buf


def release_storage(tensor: torch.Tensor) -> None:
    """Give a tensor's storage back (size 0) while views of it stay valid objects."""
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def reallocate_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Re-grow a storage released by :func:`release_storage` to ``nbytes``."""
    storage = tensor.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def storage_is_released(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() == 0


class StagingBudgetError(SlipstreamError):
    """Raised when a staging buffer would push the pool past its memory budget."""


class StagingPool:
    """Reusable host buffers, one per layout key, within a byte budget.

    ``acquire(key, nbytes)`` returns the buffer kept for ``key`` (allocating it the first
    time); ``release(key)`` makes it available again. ``pin`` pins new buffers so device to
    host copies run as DMA. Buffers for a key whose size changed are replaced.
    """

    def __init__(self, budget_bytes: int | None = None, pin: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._in_use: set[Hashable] = set()
        self._lock = threading.Lock()
        self.allocations = 0
        self.peak_bytes = 0
        """The most bytes the pool has held at once."""

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._buffers.values())

    @property
    def all_pinned(self) -> bool | None:
        """Whether every buffer held is pinned (``None`` while none is held)."""
        with self._lock:
            held = list(self._buffers.values())
        return all(b.is_pinned() for b in held) if held else None

    def acquire(self, key: Hashable, nbytes: int) -> torch.Tensor:
        with self._lock:
            if key in self._in_use:
                raise SlipstreamError(f"staging buffer {key!r} is already in use")
            buf = self._buffers.get(key)
            if buf is None or buf.numel() != nbytes:
                self._buffers.pop(key, None)
                live = sum(b.numel() for b in self._buffers.values())
                if self.budget_bytes is not None and live + nbytes > self.budget_bytes:
                    raise StagingBudgetError(
                        f"staging {nbytes} bytes for {key!r} would exceed the pool budget of "
                        f"{self.budget_bytes} bytes ({live} bytes already held); raise the "
                        "budget or wait for earlier saves to finish"
                    )
                buf = allocate_host(nbytes, self.pin)
                self._buffers[key] = buf
                self.allocations += 1
                self.peak_bytes = max(self.peak_bytes, live + nbytes)
            self._in_use.add(key)
            return buf

    def release(self, key: Hashable) -> None:
        with self._lock:
            self._in_use.discard(key)

    def drop(self, key: Hashable) -> None:
        """Free the buffer for ``key`` (e.g. when a layout is no longer used)."""
        with self._lock:
            self._in_use.discard(key)
            self._buffers.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
            self._in_use.clear()
