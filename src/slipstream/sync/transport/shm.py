"""Colocated transport: a ring of bucket slots in a shared-memory file mapped by both sides.

The owning trainer creates ``/dev/shm/slipstream-sync-*`` holding a control block and
``num_slots`` slots (a header area, then ``bucket_bytes`` of payload). Message ``m`` (1-based)
goes to slot ``(m - 1) % num_slots``. Handshake, one 8-byte word each:

- the trainer writes the slot's header and payload, then sets ``ready[slot] = m``;
- each reader ``j`` waits for ``ready[slot] >= m``, consumes the slot, then sets
  ``acked[slot][j] = m``;
- the trainer reuses a slot for message ``m + num_slots`` only once every reader acked ``m``.

The file is unlinked as soon as every reader has mapped it, so nothing is left behind if
either side dies. Waits poll with short sleeps, check that the peer process is alive (and
run a ``watch`` that fails when the round was given up elsewhere, e.g. another reader died),
and time out naming the peer rank with the control plane's errors
(:mod:`..core.control_plane`). Stores are ordered on x86 (TSO), so a reader that sees
``ready`` also sees the bytes written before it; on other CPUs (ARM reorders stores) the
handshake would need fences Python cannot issue, so the ring is offered on x86 only
(:data:`ORDERED_STORES`, :data:`..core.threads.X86_CPU`).

:mod:`.cma` reuses the ring and its handshake with slots that carry the parts' addresses
in place of their bytes (``payload_in_ring`` false).

Invariant: a slot is never rewritten while a reader may still be reading it, and a reader
never reads a slot before the trainer published it.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Callable, Sequence

import torch

from ...core.control_plane import died_error
from ...core.threads import X86_CPU
from ...errors import MissingRanksError, SyncError
from ..group import process_alive
from .network import Pending, Place

PAGE = 4096
#: Whether this CPU makes stores visible to other cores in program order, which the
#: handshake relies on.
ORDERED_STORES = X86_CPU
CTRL_PER_SLOT_FIXED = 1
#: A ring without payloads carries a count, then each part's address and length (two
#: int64), with room for as many parts as a header can name slices (``header_cap``).
PART_ADDRESS_BYTES = 16


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class _Ring:
    """The mapped file and the views both sides share."""

    def __init__(
        self,
        path: str,
        num_slots: int,
        num_readers: int,
        bucket_bytes: int,
        header_cap: int,
        create: bool,
    ) -> None:
        self.path = path
        self.num_slots = num_slots
        self.num_readers = num_readers
        self.header_cap = round_up(header_cap, 64)
        words = num_slots * (CTRL_PER_SLOT_FIXED + num_readers)
        self.ctrl_bytes = round_up(words * 8)
        self.slot_stride = round_up(self.header_cap + bucket_bytes)
        size = self.ctrl_bytes + num_slots * self.slot_stride
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        if create:
            self.buf.zero_()
        self.ctrl = self.buf[: self.ctrl_bytes].view(torch.int64)
        self.bucket_bytes = bucket_bytes

    def ready_word(self, slot: int) -> int:
        return slot * (CTRL_PER_SLOT_FIXED + self.num_readers)

    def ack_word(self, slot: int, reader: int) -> int:
        return self.ready_word(slot) + CTRL_PER_SLOT_FIXED + reader

    def header(self, slot: int) -> torch.Tensor:
        start = self.ctrl_bytes + slot * self.slot_stride
        return self.buf[start : start + self.header_cap]

    def payload(self, slot: int) -> torch.Tensor:
        start = self.ctrl_bytes + slot * self.slot_stride + self.header_cap
        return self.buf[start : start + self.bucket_bytes]

    def close(self) -> None:
        self.ctrl = self.buf = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass


#: Seconds between looks at the peer's process (and at ``watch``) while a poll waits.
LOOK_EVERY = 0.05


def _poll(
    cond: Callable[[], bool],
    timeout: float,
    peer: tuple[str, int],
    peer_pid: int | None,
    what: str,
    waiter: str,
    watch: Callable[[], None] | None = None,
) -> None:
    """Wait for ``cond()`` with short sleeps. Every :data:`LOOK_EVERY` seconds, fail at once
    if the peer (``(role, rank)``, process ``peer_pid`` of this host) died, and run
    ``watch`` (which raises when the round was given up elsewhere); else fail at the
    timeout. Errors are the control plane's, naming the peer rank."""
    if cond():
        return
    role, rank = peer
    start = time.monotonic()
    last_check = start
    sleep = 0.0
    while not cond():
        now = time.monotonic()
        if now - last_check > LOOK_EVERY:
            last_check = now
            if peer_pid is not None and not process_alive(peer_pid):
                reason = f"{role} rank {rank}'s process (pid {peer_pid}) is gone"
                raise died_error({rank: reason}, what, now - start, waiter)
            if watch is not None:
                watch()
            if now - start > timeout:
                raise MissingRanksError(
                    f"{role} rank {rank} did not answer within {timeout:.1f} s while {waiter} "
                    f"waited for {what}",
                    [rank],
                    what,
                    now - start,
                )
        time.sleep(sleep)
        sleep = min(2e-4, sleep + 2e-5)


def new_ring_path(rank: int) -> str:
    return f"/dev/shm/slipstream-sync-{os.getpid()}-{rank}-{uuid.uuid4().hex[:8]}"


def ring_shape(end: ShmSender | ShmReceiver, bucket_bytes: int, header_cap: int) -> tuple[int, int]:
    """``(payload bytes, header bytes)`` of each slot of the ring ``end`` maps: a ring that
    carries payloads holds ``bucket_bytes`` of it; one that carries only addresses
    (``end.payload_in_ring`` false) holds them after the header."""
    if end.payload_in_ring:
        return bucket_bytes, header_cap
    return 0, header_cap + 8 + PART_ADDRESS_BYTES * header_cap


class ShmSender:
    """The trainer's end of a ring: writes each message once for every colocated reader.

    Every byte is copied into the ring once, so a payload is one segment
    (``separate_min`` is ``None``): packing straight into :meth:`next_buffer` is the copy.
    """

    separate_min: int | None = None
    payload_in_ring = True

    def __init__(
        self,
        path: str,
        rank: int,
        bucket_bytes: int,
        header_cap: int,
        num_slots: int,
        reader_ranks: list[int],
        reader_pids: list[int],
        timeout: float,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self.watch = watch
        self.reader_ranks = reader_ranks
        self.reader_pids = reader_pids
        self.timeout = timeout
        self.header_cap = header_cap
        self.bucket_bytes = bucket_bytes
        self.ring = self._open_ring(path, num_slots, len(reader_ranks), bucket_bytes, header_cap)
        self._count = 0
        self.bytes_sent = 0

    def _open_ring(
        self, path: str, num_slots: int, num_readers: int, bucket_bytes: int, header_cap: int
    ) -> _Ring:
        """The ring this end writes: created here, as a file at ``path``."""
        shape = ring_shape(self, bucket_bytes, header_cap)
        return _Ring(path, num_slots, num_readers, *shape, True)

    @property
    def buffer_bytes(self) -> int:
        """The ring: shared with the readers, counted on this side."""
        return self.ring.buf.numel()

    def _wait_free(self, slot: int, message: int) -> None:
        previous = message - self.ring.num_slots
        if previous <= 0:
            return
        ctrl = self.ring.ctrl
        for j, (rank, pid) in enumerate(zip(self.reader_ranks, self.reader_pids, strict=True)):
            word = self.ring.ack_word(slot, j)

            def freed(w: int = word) -> bool:
                return int(ctrl[w]) >= previous

            _poll(
                freed,
                self.timeout,
                ("rollout", rank),
                pid,
                f"rollout rank {rank} to release a shared-memory slot",
                f"trainer rank {self.rank}",
                self.watch,
            )

    def next_buffer(self) -> torch.Tensor:
        slot = self._count % self.ring.num_slots
        self._wait_free(slot, self._count + 1)
        return self.ring.payload(slot)

    def submit(self, header: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        message = self._count + 1
        slot = self._count % self.ring.num_slots
        self._wait_free(slot, message)
        if header.numel() > self.header_cap:
            raise SyncError(
                f"bucket header of {header.numel()} bytes exceeds the shared-memory slot's "
                f"{self.header_cap}; use a smaller bucket_bytes"
            )
        self.ring.header(slot)[: header.numel()].copy_(header)
        self.bytes_sent += self._put_payload(slot, parts)
        self.ring.ctrl[self.ring.ready_word(slot)] = message
        self._count = message

    def _put_payload(self, slot: int, parts: Sequence[torch.Tensor]) -> int:
        """Make ``parts`` readable from ``slot``; return their bytes. Here: copy the one
        segment into the slot's payload, unless it was packed there."""
        if len(parts) > 1:
            raise SyncError(f"a shared-memory message is one segment, got {len(parts)}")
        payload = parts[0] if parts else torch.empty(0, dtype=torch.uint8)
        target = self.ring.payload(slot)
        n = payload.numel()
        if n and payload.data_ptr() != target.data_ptr():
            target[:n].copy_(payload)
        return n

    def flush(self) -> None:
        """Wait until every reader consumed every message (the slots are free again)."""
        for k in range(min(self._count, self.ring.num_slots)):
            message = self._count - k
            slot = (message - 1) % self.ring.num_slots
            self._wait_free(slot, message + self.ring.num_slots)

    def unlink(self) -> None:
        try:
            os.unlink(self.ring.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        self.ring.close()


class ShmReceiver:
    """A rollout's end of a trainer's ring (reader index ``reader``).

    :meth:`start` only names the next message's slot; :meth:`Pending.finish` waits for the
    trainer to publish it. So a rollout unpacks bucket g-1 while the trainer is still
    writing bucket g, and releases each slot as soon as it has been unpacked.
    """

    separate_min: int | None = None
    payload_in_ring = True
    reads_in_place = True

    def __init__(
        self,
        path: str,
        reader: int,
        num_readers: int,
        root_rank: int,
        root_pid: int,
        bucket_bytes: int,
        header_cap: int,
        num_slots: int,
        timeout: float,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.watch = watch
        self.ring = self._open_ring(path, num_slots, num_readers, bucket_bytes, header_cap)
        self.header_cap = header_cap
        self.bucket_bytes = bucket_bytes
        self.reader = reader
        self.root_rank = root_rank
        self.root_pid = root_pid
        self.timeout = timeout
        self._count = 0

    def _open_ring(
        self, path: str, num_slots: int, num_readers: int, bucket_bytes: int, header_cap: int
    ) -> _Ring:
        """The trainer's ring, mapped from its file at ``path``."""
        shape = ring_shape(self, bucket_bytes, header_cap)
        return _Ring(path, num_slots, num_readers, *shape, False)

    @property
    def buffer_bytes(self) -> int:
        """Nothing of its own: the ring is the trainer's mapping, counted on its side."""
        return 0

    def start(self, header_bytes: int, next_header_bytes: int | None, place: Place) -> Pending:
        """The next message; its payload is taken once the trainer published it."""
        message = self._count + 1
        slot = self._count % self.ring.num_slots
        self._count = message
        ctrl = self.ring.ctrl
        word = self.ring.ready_word(slot)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            _poll(
                lambda: int(ctrl[word]) >= message,
                self.timeout,
                ("trainer", self.root_rank),
                self.root_pid,
                f"a bucket in shared memory from trainer rank {self.root_rank}",
                "a rollout",
                self.watch,
            )
            header = self.ring.header(slot)[:header_bytes].clone()
            payload_bytes = int(header[:8].view(torch.int64).item())
            return header, self._take_payload(slot, header, payload_bytes, place)

        def release() -> None:
            ctrl[self.ring.ack_word(slot, self.reader)] = message

        return Pending(finish, release)

    def _take_payload(
        self, slot: int, header: torch.Tensor, payload_bytes: int, place: Place
    ) -> torch.Tensor:
        """The message's payload; here it is read where it lies, in the ring."""
        return self.ring.payload(slot)[:payload_bytes]

    def close(self) -> None:
        self.ring.close()
