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

from ..core.buffers import allocate_host
from ..core.process_memory import RemoteReadError, read_into
from ..errors import SyncError
from .shm import ShmReceiver, ShmSender, round_up
from .transport import Place


def _addresses(ring_header: torch.Tensor, header_cap: int) -> torch.Tensor:
    """The int64 words after a slot's bucket header: a count, then (address, length) pairs."""
    return ring_header[round_up(header_cap, 8) :].view(torch.int64)


class CmaSender(ShmSender):
    """The trainer's end: publishes where each part lies and keeps it alive until read."""

    separate_min = 0
    payload_in_ring = False

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
    ) -> None:
        super().__init__(
            path, rank, bucket_bytes, header_cap, num_slots, reader_ranks, reader_pids, timeout
        )
        self.bucket_bytes = bucket_bytes
        self._slots: dict[int, torch.Tensor] = {}
        self._holding: list[Sequence[torch.Tensor]] = [() for _ in range(num_slots)]

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

    separate_min = 0
    payload_in_ring = False

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
    ) -> None:
        super().__init__(
            path,
            reader,
            num_readers,
            root_rank,
            root_pid,
            bucket_bytes,
            header_cap,
            num_slots,
            timeout,
        )
        self._bucket: torch.Tensor | None = None

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._bucket is None else self._bucket.numel()

    def _take_payload(
        self, slot: int, header: torch.Tensor, payload_bytes: int, place: Place
    ) -> torch.Tensor:
        words = _addresses(self.ring.header(slot), self.header_cap)
        count = int(words[0])
        table = words[1 : 1 + 2 * count].tolist()
        if self._bucket is None:  # pages appear only where a part does not land in place
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8)
        payload = self._bucket[:payload_bytes]
        dests = place(header, payload)
        lengths = [d.numel() * d.element_size() for d in dests]
        if lengths != table[1::2]:
            raise SyncError(
                f"trainer rank {self.root_rank} sent parts of {table[1::2][:8]} bytes, the plan "
                f"expects {lengths[:8]} (first 8 shown)"
            )
        try:
            read_into(self.root_pid, list(zip(dests, table[0::2], strict=True)))
        except RemoteReadError as exc:
            raise SyncError(
                f"reading trainer rank {self.root_rank}'s memory (pid {self.root_pid}) failed: "
                f"{exc}"
            ) from exc
        return payload

    def close(self) -> None:
        super().close()
        self._bucket = None
