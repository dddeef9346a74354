"""Byte buffers shared with other processes of this host through torch's own tensor sharing
(:mod:`torch.multiprocessing.reductions`): host memory as a file of torch's shared-memory
manager, accelerator memory as a CUDA IPC handle.

One code path for both: :func:`shared_buffer` allocates a buffer that can be shared,
:func:`describe` turns it into a :class:`SharedBuffer` for one reader (plain data, sent
through the store as JSON, never a pickle), and :meth:`SharedBuffer.open` maps the same
memory in that reader's process. Only how the handle is made and opened differs by device,
and torch does both.

Invariants: as with torch's own pickling of a shared tensor, each description takes one
reference for one reader, which that reader's open takes over; the owner keeps the buffer
referenced for as long as a reader may open it; a reader's tensor is the owner's memory
(writes are seen both ways), on the owner's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing import reductions

from ...errors import SyncError


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` buffer of ``nbytes`` that :func:`describe` can share: on the host, made
    straight in shared memory (a file of torch's shared-memory manager); on an accelerator,
    an ordinary allocation (CUDA IPC shares the block it lies in)."""
    if device.type == "cpu":
        storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


@dataclass
class SharedBuffer:
    """How to open one shared buffer: its bytes, device, and torch's handle for it (hex
    where torch's is bytes)."""

    nbytes: int
    device: str
    handle: list[object]

    def open(self) -> torch.Tensor:
        """The owner's buffer in this process (``uint8``, ``nbytes`` long)."""
        device = torch.device(self.device)
        try:
            if device.type == "cpu":
                return _open_host(self.nbytes, self.handle)
            return _open_ipc(device, self.nbytes, self.handle)
        except (RuntimeError, OSError) as exc:
            raise SyncError(
                f"could not open a shared {self.device} buffer of {self.nbytes} bytes: {exc}"
            ) from exc


#: How many times a host buffer's open is tried while torch's shared-memory manager does
#: not answer in time (its socket's own timeout, which a loaded host can outlast).
MANAGER_TRIES = 3
MANAGER_TIMED_OUT = "Shared memory manager connection has timed out"


def _open_host(nbytes: int, handle: list[object]) -> torch.Tensor:
    """A host buffer opened through torch's shared-memory manager, tried again where the
    manager's connection timed out: that fails before anything is mapped, so no reference
    is taken twice."""
    manager, name = (bytes.fromhex(str(h)) for h in handle)
    tries = 1
    while True:
        try:
            storage = reductions.rebuild_storage_filename(
                torch.UntypedStorage, manager, name, nbytes
            )
            return torch.empty(0, dtype=torch.uint8).set_(storage)
        except RuntimeError as exc:
            if MANAGER_TIMED_OUT not in str(exc) or tries >= MANAGER_TRIES:
                raise
            tries += 1


def describe(buffer: torch.Tensor) -> SharedBuffer:
    """Share ``buffer`` (from :func:`shared_buffer`) with one more process, which opens it
    once with :meth:`SharedBuffer.open` (call once per reader)."""
    storage = buffer.untyped_storage()
    nbytes = buffer.numel()
    if buffer.device.type == "cpu":
        manager, handle, _size = storage._share_filename_cpu_()
        storage._shared_incref()  # the reader's open takes it over
        return SharedBuffer(nbytes, "cpu", [manager.hex(), handle.hex()])
    _rebuild, args = reductions.reduce_tensor(buffer)
    (
        _cls,
        _size,
        _stride,
        offset,
        _storage_cls,
        _dtype,
        device_index,
        handle,
        storage_bytes,
        storage_offset,
        _grad,
        counter_handle,
        counter_offset,
        event_handle,
        event_sync,
    ) = args
    return SharedBuffer(
        nbytes,
        f"{buffer.device.type}:{device_index}",
        [
            offset,
            handle.hex(),
            storage_bytes,
            storage_offset,
            counter_handle.hex(),
            counter_offset,
            event_handle.hex() if event_handle is not None else None,
            event_sync,
        ],
    )


def _open_ipc(device: torch.device, nbytes: int, handle: list[object]) -> torch.Tensor:
    """The tensor :func:`describe` shared from device memory (CUDA IPC)."""
    offset, ipc, storage_bytes, storage_offset, counter, counter_offset, event, sync = handle
    return reductions.rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([nbytes]),
        (1,),
        offset,
        torch.storage.TypedStorage,
        torch.uint8,
        device.index,
        bytes.fromhex(str(ipc)),
        storage_bytes,
        storage_offset,
        False,
        bytes.fromhex(str(counter)),
        counter_offset,
        bytes.fromhex(str(event)) if event is not None else None,
        sync,
    )
