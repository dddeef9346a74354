"""Pinned host buffers that carry loaded bytes to device tensors.

A read whose destination lives on an accelerator lands in a pinned slot, is verified there,
and is copied to the device on the reading thread's own stream; several reading threads
keep the disk (or page cache) and the host-to-device copies busy at once.

Invariant: a slot belongs to one thread from the read into it until its copy to the device
has finished; only then is it handed out again. The slots are allocated once per process
and kept, like the saver's staging buffers: pinning memory is slow.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from ...core import streams
from ...core.buffers import allocate_host, byte_view
from ...errors import CheckpointError

SLOT_BYTES = 16 * 1024 * 1024
SLOTS = 4
WAIT_SECONDS = 600.0

_slots: queue.Queue[torch.Tensor] | None = None
_slots_lock = threading.Lock()
_thread = threading.local()


def _free_slots() -> queue.Queue[torch.Tensor]:
    global _slots
    with _slots_lock:
        if _slots is None:
            _slots = queue.Queue()
            for _ in range(SLOTS):
                _slots.put(allocate_host(SLOT_BYTES, pin=True))
        return _slots


def _side_stream(device: torch.device) -> torch.Stream:
    cached = getattr(_thread, "streams", None)
    if cached is None:
        cached = _thread.streams = {}
    if device not in cached:
        cached[device] = streams.new_stream(device)
    stream: torch.Stream = cached[device]  # bounced reads go to accelerators only
    return stream


def read_to_device(
    read_into: Callable[[memoryview], None], dest: torch.Tensor, after: torch.Event | None
) -> None:
    """Fill the flat ``uint8`` device tensor ``dest`` (at most ``SLOT_BYTES``) with the bytes
    ``read_into`` writes into the memoryview it is given. The copy to the device waits for
    ``after``, an event recorded on the caller's stream, so it lands after work already
    queued on ``dest``; it has finished when this returns."""
    nbytes = dest.numel()
    if nbytes > SLOT_BYTES:
        raise ValueError(f"a bounced read takes at most {SLOT_BYTES} bytes, got {nbytes}")
    free = _free_slots()
    try:
        slot = free.get(timeout=WAIT_SECONDS)
    except queue.Empty as exc:
        raise CheckpointError(
            f"no pinned read buffer came free within {WAIT_SECONDS:.0f} s"
        ) from exc
    try:
        staged = slot[:nbytes]
        read_into(byte_view(staged))
        side = _side_stream(dest.device)
        streams.wait_event(side, after)
        with streams.on_stream(side):
            dest.copy_(staged, non_blocking=True)
        side.synchronize()
    finally:
        free.put(slot)
