"""Colocated transport with one copy in all: rollouts read the trainer's memory directly.

Like :mod:`.shm`, a ring in a shared-memory file carries each bucket's header and the
ready/ack handshake. Unlike it, the bytes stay where the trainer has them (its tensors, its
host cache, or a bucket it packed) and the slot carries each part's address and length
instead. A rollout copies every part with ``process_vm_readv`` (cross-memory attach,
:mod:`..core.process_memory`) straight to where it belongs: the parameter itself, or its
own bucket buffer. The trainer copies nothing; it only checksums what it sends.

Every slice is a part of its own (``separate_min`` is 0), so a slice lands in its
parameter and nothing is packed unless the transport has to (a cached round that leaves
unchanged slices out packs the rest, from the cache, into a private bucket).

The kernel lets a rollout read the trainer's memory only where it may ptrace it; the
publisher probes that when it starts and falls back to the copying ring where it may not.

Invariant: every part a message names stays referenced by the sender (so its memory is
neither freed nor reused by us) until every reader acknowledged that message; a reader
acknowledges only once every part has been copied out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core.buffers import allocate_host
from ...core.process_memory import RemoteReadError, read_into
from ...errors import SyncError
from ..layout.plan import BucketPlan, encode_header
from ..layout.segments import payload_segments
from .network import Pending, Place
from .shm import ShmReceiver, ShmSender, round_up


def _addresses(ring_header: torch.Tensor, header_cap: int) -> torch.Tensor:
    """The int64 words after a slot's bucket header: a count, then (address, length) pairs."""
    return ring_header[round_up(header_cap, 8) :].view(torch.int64)


class _Landing:
    """A rollout's bucket for the parts that cannot land in their final place (a callable
    target, a dtype or device mismatch, a drained round). It is allocated on first use and
    never touched as a whole, so memory appears only where a part lands in it."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._bucket: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._bucket is None else self._bucket.numel()

    def read(
        self,
        trainer: int,
        pid: int,
        header: torch.Tensor,
        payload_bytes: int,
        place: Place,
        addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> torch.Tensor:
        """Copy the parts at ``addresses`` (of ``lengths`` bytes) in trainer rank ``trainer``'s
        process ``pid`` to where ``place`` puts them; return the payload (this bucket)."""
        if self._bucket is None:
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8)
        payload = self._bucket[:payload_bytes]
        dests = place(header, payload)
        expected = [d.numel() * d.element_size() for d in dests]
        if expected != list(lengths):
            raise SyncError(
                f"trainer rank {trainer} sent parts of {list(lengths)[:8]} bytes, the plan "
                f"expects {expected[:8]} (first 8 shown)"
            )
        try:
            read_into(pid, list(zip(dests, addresses, strict=True)))
        except RemoteReadError as exc:
            raise SyncError(
                f"reading trainer rank {trainer}'s memory (pid {pid}) failed: {exc}"
            ) from exc
        return payload

    def close(self) -> None:
        self._bucket = None


class CmaSender(ShmSender):
    """The trainer's end: publishes where each part lies and keeps it alive until read."""

    separate_min: int | None = 0
    payload_in_ring = False

    def __init__(self, *args, **kwargs) -> None:
        """As :class:`.shm.ShmSender`."""
        super().__init__(*args, **kwargs)
        self._slots: dict[int, torch.Tensor] = {}
        self._holding: list[Sequence[torch.Tensor]] = [() for _ in range(self.ring.num_slots)]

    @property
    def buffer_bytes(self) -> int:
        """The ring (headers and addresses only) and the packing buffers made so far."""
        return self.ring.buf.numel() + len(self._slots) * self.bucket_bytes

    def next_buffer(self) -> torch.Tensor:
        """A private bucket to pack into, free once its last message has been read."""
        slot = self._count % self.ring.num_slots
        self._wait_free(slot, self._count + 1)
        self._holding[slot] = ()
        if slot not in self._slots:
            self._slots[slot] = allocate_host(self.bucket_bytes, pin=False)
        return self._slots[slot]

    def _put_payload(self, slot: int, parts: Sequence[torch.Tensor]) -> int:
        words = _addresses(self.ring.header(slot), self.header_cap)
        if 1 + 2 * len(parts) > words.numel():
            raise SyncError(f"a bucket of {len(parts)} parts does not fit a ring slot")
        for part in parts:
            if part.device.type != "cpu" or not part.is_contiguous():
                raise SyncError(
                    "a part read from the trainer's memory must be contiguous host memory"
                )
        table = [v for part in parts for v in (part.data_ptr(), part.numel() * part.element_size())]
        words[0] = len(parts)
        if table:
            words[1 : 1 + len(table)].copy_(torch.tensor(table, dtype=torch.int64))
        self._holding[slot] = list(parts)
        return sum(table[1::2])

    def flush(self) -> None:
        """Wait until every reader read every message, then let go of the parts."""
        super().flush()
        self._holding = [() for _ in self._holding]

    def close(self) -> None:
        super().close()
        self._slots.clear()
        self._holding = []


class CmaReceiver(ShmReceiver):
    """A rollout's end: copies each part from the trainer's memory to where ``place`` says."""

    separate_min: int | None = 0
    payload_in_ring = False
    reads_in_place = False

    def __init__(self, *args, **kwargs) -> None:
        """As :class:`.shm.ShmReceiver`."""
        super().__init__(*args, **kwargs)
        self._landing = _Landing(self.bucket_bytes)

    @property
    def buffer_bytes(self) -> int:
        return self._landing.nbytes

    def _take_payload(
        self, slot: int, header: torch.Tensor, payload_bytes: int, place: Place
    ) -> torch.Tensor:
        words = _addresses(self.ring.header(slot), self.header_cap)
        table = words[1 : 1 + 2 * int(words[0])].tolist()
        return self._landing.read(
            self.root_rank, self.root_pid, header, payload_bytes, place, table[0::2], table[1::2]
        )

    def close(self) -> None:
        super().close()
        self._landing.close()


class CacheReader:
    """A rollout's end of a refetch from a colocated trainer's host cache: no ring, no
    sender. The trainer holds its cache locked and unchanged until the rollout acknowledges;
    each :meth:`start` reads the trainer's next bucket (in plan order) out of it.

    ``cache`` is the cache's address in process ``pid``; ``offsets[g]`` where bucket ``g``
    starts in it, laid out as the plan lays out a bucket with every slice included.
    """

    separate_min: int | None = 0
    reads_in_place = False

    def __init__(
        self, trainer: int, pid: int, plan: BucketPlan, cache: int, offsets: dict[int, int]
    ) -> None:
        self.trainer = trainer
        self.pid = pid
        self.plan = plan
        self.cache = cache
        self.offsets = offsets
        self._buckets = iter(plan.owned(trainer))
        self._landing = _Landing(plan.bucket_bytes)

    @property
    def buffer_bytes(self) -> int:
        return self._landing.nbytes

    def start(self, header_bytes: int, next_header_bytes: int | None, place: Place) -> Pending:
        g = next(self._buckets)
        bucket = self.plan.buckets[g]
        slices = self.plan.bucket_slices(g)
        mask = [1] * len(slices)
        header = encode_header(torch.empty(header_bytes, dtype=torch.uint8), bucket.nbytes, mask)
        base = self.cache + self.offsets[g]
        segments = payload_segments(slices, mask, self.separate_min)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            payload = self._landing.read(
                self.trainer,
                self.pid,
                header,
                bucket.nbytes,
                place,
                [base + seg.start for seg in segments],
                [seg.nbytes for seg in segments],
            )
            return header, payload

        return Pending(finish, lambda: None)

    def close(self) -> None:
        self._landing.close()
