"""Colocated transport on torch's tensor sharing: the trainer shares its bucket slots once,
each rollout opens them and copies straight out.

The ring and handshake are :mod:`.shm`'s (ready and acknowledgement words per slot,
liveness by the peer's process and the round's watch), over buffers shared with
:mod:`.shared_tensors` (:mod:`torch.multiprocessing.reductions`) instead of a file of our
own: a host control block (the words and each slot's bucket header) and the payload slots
on the sync group's device (the GPU of a ``nccl`` group, else the host). On the host the
slots are shared memory; on a GPU they are device memory the rollouts open through CUDA
IPC, so a bucket of device weights goes from the trainer's weights to the rollout's by two
device copies (the trainer packs, the rollout copies out) and never crosses the host. The
code path is the same on both; on CPU the stream syncs are no-ops.

The slots are shared once per epoch (when the transport is built) and reused by every
message; nothing is allocated or shared per message.

Invariant (versions never mixed): a slot is rewritten only once every rollout of the epoch
acknowledged the message in it, and a rollout acknowledges only after its copies out of the
slot completed (on a device, its stream is synchronized first); the trainer publishes a
slot only after its own copies into it completed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...core.streams import current_stream, record_event
from ...errors import SyncError
from .network import Pending, Place
from .shared_tensors import SharedBuffer, describe, shared_buffer
from .shm import CTRL_PER_SLOT_FIXED, ShmReceiver, ShmSender, _Ring, round_up


@dataclass
class SharedRing:
    """An epoch's ring of a trainer shared through torch: for each reader, in the epoch's
    member order, its description of the host control block and of the payload slots; and
    the trainer's pid. Posted as JSON (its fields as plain data) and read by :meth:`read`."""

    controls: list[SharedBuffer]
    payloads: list[SharedBuffer]
    pid: int

    @classmethod
    def read(cls, text: bytes | str) -> SharedRing:
        raw = json.loads(text)
        return cls(
            [SharedBuffer(**c) for c in raw["controls"]],
            [SharedBuffer(**p) for p in raw["payloads"]],
            raw["pid"],
        )


def _control_bytes(num_slots: int, num_readers: int, header_cap: int) -> tuple[int, int]:
    """``(bytes of the words, bytes of each slot's header area)`` of the host control block."""
    words = num_slots * (CTRL_PER_SLOT_FIXED + num_readers)
    return round_up(words * 8, 64), round_up(header_cap, 64)


class _SharedRing(_Ring):
    """A ring whose words and headers lie in a shared host block, and whose payload slots lie
    in a shared buffer on the sync group's device."""

    def __init__(
        self,
        control: torch.Tensor,
        payload: torch.Tensor,
        num_slots: int,
        num_readers: int,
        bucket_bytes: int,
        header_cap: int,
    ) -> None:
        self.path = ""
        self.num_slots = num_slots
        self.num_readers = num_readers
        self.ctrl_bytes, self.header_cap = _control_bytes(num_slots, num_readers, header_cap)
        self.bucket_bytes = bucket_bytes
        self.buf = control
        self.ctrl = control[: self.ctrl_bytes].view(torch.int64)
        self.slots = payload
        self.slot_stride = round_up(bucket_bytes)

    def header(self, slot: int) -> torch.Tensor:
        start = self.ctrl_bytes + slot * self.header_cap
        return self.buf[start : start + self.header_cap]

    def payload(self, slot: int) -> torch.Tensor:
        start = slot * self.slot_stride
        return self.slots[start : start + self.bucket_bytes]

    def close(self) -> None:
        self.ctrl = self.buf = self.slots = None  # type: ignore[assignment]


def _settle(device: torch.device) -> None:
    """Wait until the work queued so far on ``device``'s current stream has run (nothing to
    wait for on the host, where copies are done when they return)."""
    event = record_event(current_stream(device))
    if event is not None:
        event.synchronize()


class IpcSender(ShmSender):
    """The trainer's end: packs each bucket into a shared slot (or copies a payload there)
    and publishes the slot once the copy has completed."""

    def __init__(
        self,
        rank: int,
        bucket_bytes: int,
        header_cap: int,
        num_slots: int,
        reader_ranks: list[int],
        reader_pids: list[int],
        timeout: float,
        device: torch.device,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.device = device
        super().__init__(
            "", rank, bucket_bytes, header_cap, num_slots, reader_ranks, reader_pids, timeout, watch
        )

    def _open_ring(
        self, path: str, num_slots: int, num_readers: int, bucket_bytes: int, header_cap: int
    ) -> _Ring:
        words, headers = _control_bytes(num_slots, num_readers, header_cap)
        control = shared_buffer(words + num_slots * headers, torch.device("cpu"))
        control.zero_()
        payload = shared_buffer(num_slots * round_up(bucket_bytes), self.device)
        return _SharedRing(control, payload, num_slots, num_readers, bucket_bytes, header_cap)

    def shared(self, pid: int) -> SharedRing:
        """What the readers open: the control block and the slots, described once for each
        reader (in member order)."""
        ring = self.ring
        assert isinstance(ring, _SharedRing)
        readers = range(ring.num_readers)
        return SharedRing(
            [describe(ring.buf) for _ in readers], [describe(ring.slots) for _ in readers], pid
        )

    @property
    def buffer_bytes(self) -> int:
        """The control block and the slots: shared with the readers, counted on this side."""
        ring = self.ring
        assert isinstance(ring, _SharedRing)
        return ring.buf.numel() + ring.slots.numel()

    def _put_payload(self, slot: int, parts: Sequence[torch.Tensor]) -> int:
        n = super()._put_payload(slot, parts)
        _settle(self.device)
        return n

    def unlink(self) -> None:
        """Nothing to unlink: torch's shared-memory manager owns the host block's file."""


class IpcReceiver(ShmReceiver):
    """A rollout's end: opens the trainer's shared slots once and reads each bucket where it
    lies; acknowledges a slot only once its copies out of it completed."""

    def __init__(
        self,
        shared: SharedRing,
        reader: int,
        num_readers: int,
        root_rank: int,
        bucket_bytes: int,
        header_cap: int,
        num_slots: int,
        timeout: float,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self._shared = shared
        self.reader, self.root_rank = reader, root_rank  # _open_ring reads them
        super().__init__(
            "",
            reader,
            num_readers,
            root_rank,
            shared.pid,
            bucket_bytes,
            header_cap,
            num_slots,
            timeout,
            watch,
        )

    def _open_ring(
        self, path: str, num_slots: int, num_readers: int, bucket_bytes: int, header_cap: int
    ) -> _Ring:
        control = self._shared.controls[self.reader]
        payload = self._shared.payloads[self.reader]
        assert isinstance(control, SharedBuffer) and isinstance(payload, SharedBuffer)
        words, headers = _control_bytes(num_slots, num_readers, header_cap)
        need = (words + num_slots * headers, num_slots * round_up(bucket_bytes))
        if (control.nbytes, payload.nbytes) != need:
            raise SyncError(
                f"trainer rank {self.root_rank} shared a ring of {control.nbytes} + "
                f"{payload.nbytes} bytes, the transport's shape needs {need[0]} + {need[1]}"
            )
        slots = payload.open()
        self._device = slots.device
        return _SharedRing(control.open(), slots, num_slots, num_readers, bucket_bytes, header_cap)

    def start(self, header_bytes: int, next_header_bytes: int | None, place: Place) -> Pending:
        pending = super().start(header_bytes, next_header_bytes, place)
        release = pending.release_fn

        def settled_release() -> None:
            _settle(self._device)
            release()

        pending.release_fn = settled_release
        return pending
