"""Moving one bucket (header + payload) from its owning trainer to every rollout rank.

Five transports share one interface: the two network ones here, and three between the
processes of one host:

- :class:`BroadcastSender` / :class:`BroadcastReceiver` over a process group of the owning
  trainer and the rollout ranks (built from the sync group's store, so no other trainer
  ever receives another's bucket), in one of two ways: ``broadcast`` (one collective per
  message), or ``relay``: the trainer sends each message once, to the first rollout, and
  each rollout passes it on to the next as soon as it has it (a pipelined chain). Over a
  relay the trainer's link carries the weights once however many rollouts there are, and a
  message costs less than a collective, so smaller slices go unpacked;
- :mod:`.shm`: a ring of bucket slots in a shared-memory file, for colocated ranks;
- :mod:`.cma`: the same ring carrying addresses, the rollouts copying the bytes straight out
  of the trainer's memory;
- :mod:`.ipc`: the same ring's handshake over slots shared through torch (host memory, or a
  GPU's through CUDA IPC).

A sender keeps ``num_slots`` reused buffers and hands out the next one with
:meth:`next_buffer` (waiting until its previous message has left); :meth:`submit` queues a
message without waiting for it, so the caller packs bucket g+1 while bucket g is in flight.
A receiver's :meth:`start` posts the receive of the next message and returns a
:class:`Pending` whose :meth:`Pending.finish` waits for it, so the caller unpacks bucket g-1
while bucket g arrives.

A payload travels as the *segments* :func:`..layout.segments.payload_segments` cuts it
into: runs of small slices, and (over broadcast) each slice of at least ``separate_min``
bytes on its own, sent from the trainer's tensor and received straight into the rollout's,
so the bulk of the bytes is never packed or unpacked.

Invariant: a buffer is never written while a message it holds is still in flight, every
tensor a message reads stays referenced until it has left, and every wait has a timeout
naming the peer rank.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ...core.buffers import allocate_host
from ...errors import SyncError
from ..layout.plan import HEADER_PREFIX
from .watchdog import Watchdog

#: Slices of at least this many bytes cross a broadcast on their own, without a copy. Each
#: extra message costs about a millisecond on gloo over loopback, about what packing and
#: unpacking a few MiB costs there, so only slices this large (an LLM's embedding and MLP
#: weights) gain from going alone: on a transformer-shaped model 16 MiB did a little
#: better than 4 MiB, and both far better than packing everything (benchmarks/sync.py).
SEPARATE_MIN_BYTES = 16 * 1024 * 1024
#: The same over a relay, where an extra message is a point-to-point send (about a tenth
#: of a millisecond here): 1 MiB messages moved a GiB as fast as one message did.
RELAY_SEPARATE_MIN_BYTES = 1024 * 1024

#: ``place(header, payload)``: the receive buffers of the payload's segments, in order.
Place = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]


class Sender(Protocol):
    @property
    def bytes_sent(self) -> int: ...
    @property
    def separate_min(self) -> int | None: ...
    @property
    def buffer_bytes(self) -> int: ...

    def next_buffer(self) -> torch.Tensor: ...
    def submit(self, header: torch.Tensor, parts: Sequence[torch.Tensor]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class Pending:
    """A message being received: ``finish()`` waits for it and returns ``(header, payload)``;
    ``release()`` hands its buffer back to the sender once the payload has been used."""

    finish_fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    release_fn: Callable[[], None]

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.finish_fn()

    def release(self) -> None:
        self.release_fn()


class Receiver(Protocol):
    reads_in_place: bool
    """Whether a payload is read where it lies (shared with the trainer), so a rollout
    copies out only the bytes it takes; else every byte of it arrives in this process."""

    @property
    def buffer_bytes(self) -> int: ...
    @property
    def separate_min(self) -> int | None: ...

    def start(self, header_bytes: int, next_header_bytes: int | None, place: Place) -> Pending: ...
    def close(self) -> None: ...


def _broadcast_from_root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


#: Every broadcast here is sent by member 0 of its group: the owning trainer.
_FROM_ROOT = _broadcast_from_root()


def _buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return allocate_host(nbytes, pin=False)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _failure(what: str, how: str, why: Callable[[], str] | None, exc: Exception) -> SyncError:
    """The error for ``what`` having ``how`` (e.g. "failed"), with ``why()`` when given."""
    note = f" ({why()})" if why is not None else ""
    return SyncError(f"{what} {how}{note}: {exc}")


def _wait(
    work: dist.Work,
    timeout: float,
    what: str,
    why: Callable[[], str] | None = None,
    watchdog: Watchdog | None = None,
) -> None:
    """Wait for ``work``; on failure raise naming ``what`` and, when given, ``why()``.

    With ``watchdog`` the wait is watched: a member found dead meanwhile cuts the transfer,
    and the wait raises the watchdog's error (naming the member) at once."""
    with watchdog.blocked() if watchdog is not None else nullcontext():
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as exc:
            found = watchdog.failure() if watchdog is not None else None
            if found is not None:
                raise found from exc
            raise _failure(what, f"failed or timed out after {timeout:.1f} s", why, exc) from exc


def _wait_unmarked(
    work: dist.Work,
    timeout: float,
    what: str,
    why: Callable[[], str] | None,
    watchdog: Watchdog | None,
) -> None:
    """:func:`_wait` run apart (:meth:`Watchdog.wait_apart` looks meanwhile): the wait is
    not marked blocked, and a failure after the watchdog cut the transfer raises its
    error."""
    try:
        _wait(work, timeout, what, why)
    except SyncError as exc:
        found = watchdog.failure() if watchdog is not None else None
        if found is not None:
            raise found from exc
        raise


def _post(
    op: Callable[[], dist.Work], what: str, why: Callable[[], str] | None = None
) -> dist.Work:
    """Start ``op`` (a point-to-point send or receive, which fails at once when its peer
    has gone); on failure raise naming ``what`` and, when given, ``why()``."""
    try:
        return op()
    except RuntimeError as exc:
        raise _failure(what, "failed", why, exc) from exc


@dataclass
class RoutedMessage:
    """One member's part of a bucket in a routed round: its header and payload segments;
    ``member`` is its index in the epoch's process group."""

    member: int
    header: torch.Tensor
    parts: list[torch.Tensor]


class BroadcastSender:
    """Sends buckets from ``rank`` (member 0 of ``pg``) to every other member of ``pg``: by
    broadcast, or with ``relay`` to member 1 alone, which passes them on."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        bucket_bytes: int,
        header_bytes: int,
        num_slots: int,
        timeout: float,
        device: torch.device,
        separate_min: int | None = SEPARATE_MIN_BYTES,
        peers: Sequence[int] = (),
        exited: Callable[[], list[int]] = list,
        relay: bool = False,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.pg: Any = pg
        self.watchdog = watchdog
        self.rank = rank
        self.peers = list(peers)
        self.relay = relay
        self.exited = exited
        self.timeout = timeout
        self.num_slots = num_slots
        self.separate_min = separate_min
        self.device = device
        self.bucket_bytes = bucket_bytes
        self._slots: dict[int, torch.Tensor] = {}
        self._headers = [_buffer(header_bytes, device) for _ in range(num_slots)]
        self._works: list[list[dist.Work]] = [[] for _ in range(num_slots)]
        self._sending: list[Sequence[torch.Tensor]] = [() for _ in range(num_slots)]
        self._count = 0
        self.bytes_sent = 0

    def _who_exited(self) -> str:
        gone = self.exited()
        return f"rollout rank(s) {gone} exited" if gone else "no rollout here exited"

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the slots allocated so far (a slot is allocated when first packed into:
        a sender that only sends from tensors or a cache never holds one) and headers."""
        headers = sum(h.numel() for h in self._headers)
        return len(self._slots) * self.bucket_bytes + headers

    @property
    def _what(self) -> str:
        if self.relay:
            return f"trainer rank {self.rank} sending a bucket to rollout rank {self.peers[0]}"
        return f"trainer rank {self.rank} broadcasting a bucket to rollout rank(s) {self.peers}"

    def _drain(self, slot: int) -> None:
        """Wait for the messages of ``slot``. Apart (see :mod:`.watchdog`): gloo may leave a
        send to a member that stopped reading pending until the timeout, and the watch
        sees such a member's refusal."""
        for work in self._works[slot]:
            if self.watchdog is None or work.is_completed():
                _wait(work, self.timeout, self._what, self._who_exited)
                continue
            self.watchdog.wait_apart(functools.partial(self._wait_sent, work), self.timeout)
        self._works[slot] = []
        self._sending[slot] = ()

    def _wait_sent(self, work: dist.Work) -> None:
        _wait_unmarked(work, self.timeout, self._what, self._who_exited, self.watchdog)

    def next_buffer(self) -> torch.Tensor:
        slot = self._count % self.num_slots
        self._drain(slot)
        if slot not in self._slots:
            self._slots[slot] = _buffer(self.bucket_bytes, self.device)
        return self._slots[slot]

    def _post(self, t: torch.Tensor) -> dist.Work:
        if self.relay:
            return _post(lambda: self.pg.send([t], 1, 0), self._what, self._who_exited)
        return self.pg.broadcast([t], _FROM_ROOT)

    def submit(self, header: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        """Send ``header`` then each part (the payload's segments) from this rank."""
        slot = self._count % self.num_slots
        self._drain(slot)
        hdr = self._headers[slot][: header.numel()]
        hdr.copy_(header)
        works = [self._post(hdr)]
        works += [self._post(part) for part in parts]
        self._works[slot] = works
        self._sending[slot] = parts
        self.bytes_sent += sum(part.numel() for part in parts)
        self._count += 1

    def submit_routed(self, messages: Sequence[RoutedMessage]) -> None:
        """Send each member its own message of one bucket (a routed round): its header,
        then its parts, point to point, whatever the transport's kind."""
        slot = self._count % self.num_slots
        self._drain(slot)
        works: list[dist.Work] = []
        parts: list[torch.Tensor] = []
        for m in messages:
            peer = self.peers[m.member - 1]
            what = f"trainer rank {self.rank} sending a bucket to rollout rank {peer}"
            for t in (m.header.to(self.device), *m.parts):
                send = functools.partial(self.pg.send, [t], m.member, 0)
                works.append(_post(send, what, self._who_exited))
                parts.append(t)
            self.bytes_sent += sum(p.numel() for p in m.parts)
        self._works[slot] = works
        self._sending[slot] = parts
        self._count += 1

    def flush(self) -> None:
        for slot in range(self.num_slots):
            self._drain(slot)

    def close(self) -> None:
        """Let go of the buffers, the messages in flight and the process group (its
        connections close once nothing else holds it)."""
        self._slots.clear()
        self._headers.clear()
        self._sending.clear()
        self._works = [[] for _ in range(self.num_slots)]
        self.pg = None
        if self.watchdog is not None:
            self.watchdog.close()


class BroadcastReceiver:
    """Receives the buckets a trainer (``root_rank``, member 0 of ``pg``) sends.

    With ``chain`` (the global ranks of ``pg``'s members in order, trainer first) the
    buckets come relayed: from the member before this rank, and each piece of a message
    (its header, then each payload segment) is passed on to the member after it as soon as
    it has arrived and this rank next calls :meth:`start` or :meth:`Pending.finish`, in
    arrival order, so the next rank's receives match them. A slot is written again only
    once what was passed on from it has left, and the last message of a round
    (``next_header_bytes`` is None) is released only once everything passed on has left,
    so the caller may change its tensors after the round.
    """

    reads_in_place = False

    def __init__(
        self,
        pg: dist.ProcessGroup,
        root_rank: int,
        bucket_bytes: int,
        header_bytes: int,
        num_slots: int,
        timeout: float,
        device: torch.device,
        separate_min: int | None,
        chain: Sequence[int] | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.pg: Any = pg
        self.watchdog = watchdog
        self.root_rank = root_rank
        self._from: int | None = None
        self._to: int | None = None
        self.what = f"bucket from trainer rank {root_rank}"
        if chain is not None:
            me = pg.rank()
            self._from = me - 1
            self._to = me + 1 if me + 1 < len(chain) else None
            if self._from > 0:
                self.what += f" relayed by rollout rank {chain[self._from]}"
            if self._to is not None:
                self._relay_what = (
                    f"passing a bucket from trainer rank {root_rank} on to rollout rank "
                    f"{chain[self._to]}"
                )
        self.separate_min = separate_min
        self.timeout = timeout
        self.num_slots = num_slots
        self._slots = [_buffer(bucket_bytes, device) for _ in range(num_slots)]
        size = max(header_bytes, HEADER_PREFIX)
        self._headers = [_buffer(size, device) for _ in range(2)]
        self._count = 0
        self._header_count = 0
        self.buffer_bytes = num_slots * bucket_bytes + 2 * size
        self._posted: tuple[dist.Work, torch.Tensor] | None = None
        #: per slot, the sends passing on the message last received into it
        self._passing: list[list[dist.Work]] = [[] for _ in range(num_slots)]
        #: received pieces not yet passed on, in arrival order: (receive, piece, slot)
        self._arriving: deque[tuple[dist.Work, torch.Tensor, int]] = deque()

    def _receive(self, buf: torch.Tensor, routed: bool = False) -> dist.Work:
        src = 0 if routed else self._from
        if src is None:
            return self.pg.broadcast([buf], _FROM_ROOT)
        return _post(lambda: self.pg.recv([buf], src, 0), f"receiving a {self.what}")

    def _pass_on_arrived(self) -> None:
        """Pass on every piece posted so far, in order, waiting for each to arrive."""
        while self._arriving:
            work, piece, slot = self._arriving[0]
            _wait(work, self.timeout, f"receiving a {self.what}", watchdog=self.watchdog)
            self._arriving.popleft()
            send = self._pass_on(piece)
            self._passing[slot].append(send)

    def _pass_on(self, piece: torch.Tensor) -> dist.Work:
        """Send ``piece`` on to the next member of the chain."""
        to = self._to
        assert to is not None
        return _post(lambda: self.pg.send([piece], to, 0), self._relay_what)

    def _wait_passed(self, slot: int) -> None:
        """Wait for what was passed on from ``slot``. Apart (see :mod:`.watchdog`): gloo
        may leave a send to a next member that died pending until the timeout."""
        for work in self._passing[slot]:
            if self.watchdog is None or work.is_completed():
                _wait(work, self.timeout, self._relay_what)
                continue
            self.watchdog.wait_apart(functools.partial(self._wait_sent, work), self.timeout)
        self._passing[slot] = []

    def _wait_sent(self, work: dist.Work) -> None:
        _wait_unmarked(work, self.timeout, self._relay_what, None, self.watchdog)

    def _post_header(self, header_bytes: int, routed: bool) -> tuple[dist.Work, torch.Tensor]:
        buf = self._headers[self._header_count % 2][:header_bytes]
        self._header_count += 1
        return self._receive(buf, routed), buf

    def start(self, header_bytes: int, next_header_bytes: int | None, place: Place) -> Pending:
        """Receive the next header, post its payload segments' receives, and post the header
        after it.

        ``place(header, payload)`` names where each segment lands (a part of the slot, or
        the target's own memory). ``next_header_bytes`` (the size of this trainer's next
        bucket header, if any) lets that header's receive be posted now, so the trainer
        never waits for us to ask.
        """
        return self._start(header_bytes, next_header_bytes, place, routed=False)

    def start_routed(
        self, header_bytes: int, next_header_bytes: int | None, place: Place
    ) -> Pending:
        """:meth:`start` for a routed round: this rank's own message, straight from the
        trainer (point to point whatever the transport's kind; nothing is passed on)."""
        return self._start(header_bytes, next_header_bytes, place, routed=True)

    def _start(
        self, header_bytes: int, next_header_bytes: int | None, place: Place, routed: bool
    ) -> Pending:
        relaying = self._to is not None and not routed
        if relaying:
            self._pass_on_arrived()
        work, received = self._posted or self._post_header(header_bytes, routed)
        self._posted = None
        _wait(work, self.timeout, f"receiving a {self.what}", watchdog=self.watchdog)
        header = received.cpu().clone()
        payload_bytes = int(header[:HEADER_PREFIX].view(torch.int64).item())
        index = self._count % self.num_slots
        self._count += 1
        if relaying:
            self._wait_passed(index)
            forward = received.clone()
            self._passing[index].append(self._pass_on(forward))
        payload = self._slots[index][:payload_bytes]
        buffers = place(header, payload)
        works = [self._receive(buf, routed) for buf in buffers]
        if relaying:
            self._arriving.extend((w, buf, index) for w, buf in zip(works, buffers, strict=True))
        if next_header_bytes is not None:
            self._posted = self._post_header(next_header_bytes, routed)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            if relaying:
                self._pass_on_arrived()  # waits for this message's pieces too
            else:
                for w in works:
                    _wait(w, self.timeout, f"receiving a {self.what}", watchdog=self.watchdog)
            return header, payload

        def release() -> None:
            if relaying and next_header_bytes is None:
                for slot in range(self.num_slots):
                    self._wait_passed(slot)

        return Pending(finish, release)

    def close(self) -> None:
        """Let go of the buffers, the messages in flight and the process group (its
        connections close once nothing else holds it)."""
        self._slots.clear()
        self._posted = None
        self._passing = [[] for _ in range(self.num_slots)]
        self._arriving.clear()
        self.pg = None
        if self.watchdog is not None:
            self.watchdog.close()
