"""Choosing a transport, and building each epoch's senders and receivers.

When a publisher starts, each trainer rank settles on one kind of transport with the
rollouts (:func:`negotiate`, answered by :func:`read_offer`): ``ipc`` (torch's tensor
sharing) on one host once every rollout opened a small buffer the trainer shared (else
``shm`` for host weights, ``broadcast`` for device weights), across hosts ``relay`` (host
weights) or ``broadcast`` (device weights); ``cma`` (only after every rollout read a few
bytes of the trainer's memory) and ``shm`` on one host when asked for. The kind never
changes afterwards.

The transport itself belongs to an *epoch* (see :mod:`.protocol`): a sender or receiver is
built for the members of the round that starts the epoch (:func:`build_sender`,
:func:`build_receiver`), over a process group tagged with the epoch, or a shared-memory ring
of its own. A rank whose process was replaced is met in a new epoch's group with its new
process; the old group is dropped, never reused.

Invariant: every rank of an epoch builds its end from the same offer, epoch and members, so
their buffers, segments and process groups match.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence

import torch

from ...core import process_memory
from ...core.control_plane import died_error
from ...errors import SyncError
from ..group import SyncGroup
from ..layout.plan import HEADER_CAP
from ..transport.cma import CmaReceiver, CmaSender
from ..transport.ipc import IpcReceiver, IpcSender, SharedRing
from ..transport.network import (
    RELAY_SEPARATE_MIN_BYTES,
    SEPARATE_MIN_BYTES,
    BroadcastReceiver,
    BroadcastSender,
    Receiver,
    Sender,
)
from ..transport.shared_tensors import SharedBuffer, describe, shared_buffer
from ..transport.shm import ORDERED_STORES, ShmReceiver, ShmSender, new_ring_path
from ..transport.watchdog import Watchdog
from .culprits import exited
from .protocol import Keys, Probe, ProbeReply, ReceiverShape, RingInfo, TransportOffer, encode

logger = logging.getLogger(__name__)

TRANSPORTS = ("auto", "relay", "broadcast", "shm", "cma", "ipc")
#: Transports over the sync group's process groups (the others need one host).
NETWORK_TRANSPORTS = ("relay", "broadcast")
#: The transports for ranks on one host (``ipc`` alone carries device weights).
LOCAL_TRANSPORTS = ("ipc", "cma", "shm")
#: The colocated transports that carry host weights only.
HOST_TRANSPORTS = ("cma", "shm")
#: Why an explicit transport cannot be used, when a rollout refused its probe.
REFUSALS = {
    "cma": "rollouts cannot read trainer rank {rank}'s memory ({why}); they need ptrace "
    "access to it (docs/sync-advanced.md, Transports), else use 'ipc'",
    "ipc": "rollouts cannot open the buffers trainer rank {rank} shares through torch ({why}); "
    "on a GPU they must see its device under the same index (docs/sync.md, Limits)",
}

Watch = Callable[[], None]
"""``watch()``: raises when a round was given up (its abort, a member's broken transfer)."""


def unwatched() -> None:
    """The watch of a transfer outside any round (a refetch): nothing to look at."""


def liveness_watchdog(group: SyncGroup, members: Sequence[int], tag: str, watch: Watch) -> Watchdog:
    """The watchdog of this rank's transfer over the process group of ``members`` and
    ``tag``: while a wait is blocked it looks at the other members' liveness
    (:meth:`SyncGroup.dead`) and runs ``watch`` (the round's own look: its abort, a
    member's broken transfer); a member found dead cuts the group's connections and is
    named by :class:`~slipstream.errors.PeerDiedError`, and what ``watch`` raises cuts them
    too."""
    others = [r for r in members if r != group.rank]
    began = time.monotonic()
    waiter = f"rank {group.rank}"

    def look() -> None:
        found = group.dead(others)
        if found:
            raise died_error(found, "a transfer", time.monotonic() - began, waiter)
        watch()

    def cut() -> None:
        group.cut_subgroup(members, tag)

    return Watchdog(look, cut, f"slipstream-sync-watchdog-{tag}")


def candidates(group: SyncGroup, transport: str, rollout_ranks: Sequence[int]) -> list[str]:
    """The transports to try, best first: ``auto`` tries ``ipc`` when every rollout shares
    this host (then ``shm`` for host memory, ``broadcast`` for device memory), else relay
    (host memory) or broadcast (device memory)."""
    colocated = group.colocated(rollout_ranks)
    host = group.device.type == "cpu"
    if transport == "ipc" and not colocated:
        raise ValueError(f"transport='ipc' needs every rollout on trainer rank {group.rank}'s host")
    if transport in HOST_TRANSPORTS and not (colocated and host):
        raise ValueError(
            f"transport={transport!r} needs every rollout on trainer rank {group.rank}'s "
            "host and host buffers"
        )
    if transport in LOCAL_TRANSPORTS and not ORDERED_STORES:
        raise ValueError(
            f"transport={transport!r} needs an x86 CPU: its handshake relies on ordered "
            f"stores, which {platform.machine()} does not guarantee; use 'broadcast'"
        )
    if transport != "auto":
        return [transport]
    if colocated and ORDERED_STORES:
        return ["ipc", "shm" if host else "broadcast"]
    return ["relay" if host else "broadcast"]


def separate_min_for(kind: str, asked: int | None | str) -> int | None:
    """The ``separate_min_bytes`` asked for, with ``"auto"`` resolved for ``kind``."""
    if asked != "auto":
        return asked if asked is None else int(asked)
    return RELAY_SEPARATE_MIN_BYTES if kind == "relay" else SEPARATE_MIN_BYTES


def shape_of(bucket_bytes: int, num_slots: int, separate_min: int | None) -> ReceiverShape:
    return ReceiverShape(bucket_bytes, num_slots, HEADER_CAP, separate_min)


def negotiate(
    group: SyncGroup,
    rollouts: Sequence[int],
    tried: list[str],
    mode: str,
    bucket_bytes: int,
    num_slots: int,
    separate_min: int | None | str,
    timeout: float,
) -> TransportOffer:
    """Agree with ``rollouts`` on the first of ``tried`` they can all use and post it
    (``transport/{rank}``); raise :class:`SyncError` (posted too) when none fits."""
    rank = group.rank
    refused: dict[int, str] = {}
    if tried[0] == "cma":
        refused = probe_remote_reads(group, rollouts, timeout)
    elif tried[0] == "ipc":
        refused = probe_sharing(group, rollouts, timeout)
    else:
        group.post(Keys.probe(rank), "null")
    if refused:
        why = "; ".join(f"rollout rank {r}: {e}" for r, e in refused.items())
        if len(tried) == 1:
            error = f"transport={tried[0]!r}: {REFUSALS[tried[0]].format(rank=rank, why=why)}"
            group.post(Keys.transport(rank), encode(TransportOffer(error=error)))
            raise SyncError(error)
        logger.info("trainer rank %d: %s refused (%s); using %r", rank, tried[0], why, tried[1])
        tried = tried[1:]
    kind = tried[0]
    shape = shape_of(bucket_bytes, num_slots, separate_min_for(kind, separate_min))
    offer = TransportOffer(kind, mode, shape)
    group.post(Keys.transport(rank), encode(offer))
    return offer


def probe_remote_reads(group: SyncGroup, rollouts: Sequence[int], timeout: float) -> dict[int, str]:
    """Ask every rollout to read a few random bytes from this process; return why each one
    that could not failed (empty when all could)."""
    rank = group.rank
    probe = torch.randint(0, 256, (64,), dtype=torch.uint8)
    group.post(Keys.probe(rank), encode(Probe(os.getpid(), probe.data_ptr(), probe.tolist())))
    what = f"rollouts to try reading trainer rank {rank}'s memory"
    return _probe_replies(group, rollouts, what, timeout)


def probe_sharing(group: SyncGroup, rollouts: Sequence[int], timeout: float) -> dict[int, str]:
    """Share a few random bytes on the group's device through torch and ask every rollout to
    open them; return why each one that could not failed (empty when all could)."""
    rank = group.rank
    probe = torch.randint(0, 256, (64,), dtype=torch.uint8)
    buffer = shared_buffer(probe.numel(), group.device)
    buffer.copy_(probe)
    shared = {str(r): dataclasses.asdict(describe(buffer)) for r in rollouts}
    group.post(Keys.probe(rank), encode(Probe(os.getpid(), 0, probe.tolist(), shared)))
    what = f"rollouts to open the buffer trainer rank {rank} shared"
    return _probe_replies(group, rollouts, what, timeout)


def _probe_replies(
    group: SyncGroup, rollouts: Sequence[int], what: str, timeout: float
) -> dict[int, str]:
    """Every rollout's answer to this trainer's probe: why each one that failed did."""
    replies = {r: Keys.probed(group.rank, r) for r in rollouts}
    group.wait_keys(replies, what, timeout)
    refused = {}
    for r, key in replies.items():
        error = ProbeReply(**group.get_json(key, r, "a transport probe")).error
        if error:
            refused[r] = error
    return refused


def _open_probe(shared: SharedBuffer, expected: list[int]) -> str | None:
    """Why the probe buffer ``shared`` could not be opened here or did not hold ``expected``
    (``None`` when it did)."""
    try:
        found = shared.open().cpu().tolist()
    except SyncError as exc:
        return str(exc)
    return None if found == expected else "the shared buffer held other bytes"


def read_offer(group: SyncGroup, trainer: int, timeout: float) -> TransportOffer:
    """A rollout's side of :func:`negotiate`: answer the trainer's probe, return its offer."""
    what = f"trainer rank {trainer}'s publisher"
    probe = group.get_json(Keys.probe(trainer), trainer, what, timeout)
    if probe is not None:
        p = Probe(**probe)
        mine = p.shared.get(str(group.rank)) if p.shared is not None else None
        if p.shared is None:
            error = process_memory.probe(p.pid, p.addr, bytes(p.bytes))
            group.set_json(Keys.probed(trainer, group.rank), {"error": error})
        elif mine is not None:
            # a rollout that joined after the probe (past the group's first world size) was
            # not probed, and nobody waits for its answer
            assert isinstance(mine, dict)
            error = _open_probe(SharedBuffer(**mine), p.bytes)
            group.set_json(Keys.probed(trainer, group.rank), {"error": error})
    offer = TransportOffer.read(group.get_text(Keys.transport(trainer), trainer, what, timeout))
    if offer.error:
        raise SyncError(f"rollout rank {group.rank}: {offer.error}")
    return offer


def epoch_tag(epoch: int) -> str:
    return f"e{epoch}"


def network_sender(
    group: SyncGroup,
    rollouts: Sequence[int],
    shape: ReceiverShape,
    relay: bool,
    tag: str,
    timeout: float,
    watch: Watch,
) -> BroadcastSender:
    """A sender over the group of this rank and ``rollouts`` (tagged ``tag``), relaying along
    them with ``relay``; the rollouts build the matching :func:`network_receiver`. Its waits
    end as soon as a rollout is found dead or ``watch`` raises."""
    members = [group.rank, *rollouts]
    return BroadcastSender(
        group.subgroup(members, tag),
        group.rank,
        shape.bucket_bytes,
        shape.header_cap,
        shape.num_slots,
        timeout,
        group.device,
        shape.separate_min,
        rollouts,
        lambda: exited(group, rollouts),
        relay,
        liveness_watchdog(group, members, tag, watch),
    )


def network_receiver(
    group: SyncGroup,
    trainer: int,
    rollouts: Sequence[int],
    shape: ReceiverShape,
    relay: bool,
    tag: str,
    timeout: float,
    watch: Watch,
) -> BroadcastReceiver:
    """A receiver of what ``trainer`` sends over the group of ``trainer`` and ``rollouts``
    (tagged ``tag``), relayed along ``rollouts`` with ``relay``. Its waits end as soon as
    another member is found dead."""
    members = [trainer, *rollouts]
    return BroadcastReceiver(
        group.subgroup(members, tag),
        trainer,
        shape.bucket_bytes,
        shape.header_cap,
        shape.num_slots,
        timeout,
        group.device,
        shape.separate_min,
        chain=members if relay else None,
        watchdog=liveness_watchdog(group, members, tag, watch),
    )


def build_sender(
    group: SyncGroup,
    offer: TransportOffer,
    epoch: int,
    members: Sequence[int],
    timeout: float,
    watch: Watch,
) -> Sender:
    """This trainer's sender to ``members`` for ``epoch``. A ring is unlinked as soon as
    every member mapped it."""
    shape = offer.shape
    assert shape is not None
    if offer.kind in NETWORK_TRANSPORTS:
        return network_sender(
            group, members, shape, offer.kind == "relay", epoch_tag(epoch), timeout, watch
        )
    rank = group.rank
    pids = [group.member(r).pid for r in members]
    sender: ShmSender
    if offer.kind == "ipc":
        sender = IpcSender(
            rank,
            shape.bucket_bytes,
            shape.header_cap,
            shape.num_slots,
            list(members),
            pids,
            timeout,
            group.device,
            watch,
        )
        ring = encode(sender.shared(os.getpid()))
    else:
        path = new_ring_path(rank)
        ring_sender = CmaSender if offer.kind == "cma" else ShmSender
        sender = ring_sender(
            path,
            rank,
            shape.bucket_bytes,
            shape.header_cap,
            shape.num_slots,
            list(members),
            pids,
            timeout,
            watch,
        )
        ring = encode(RingInfo(path, os.getpid()))
    try:
        group.post(Keys.ring(epoch, rank), ring)
        group.wait_keys(
            {r: Keys.ring_opened(epoch, rank, r) for r in members},
            f"rollouts to map trainer rank {rank}'s shared-memory ring (epoch {epoch})",
            timeout,
        )
    except BaseException:
        sender.close()
        raise
    sender.unlink()
    return sender


def build_receiver(
    group: SyncGroup,
    offer: TransportOffer,
    trainer: int,
    epoch: int,
    members: Sequence[int],
    timeout: float,
    watch: Watch,
) -> Receiver:
    """This rollout's receiver from ``trainer`` for ``epoch`` (``members`` in order)."""
    shape = offer.shape
    assert shape is not None
    if offer.kind in NETWORK_TRANSPORTS:
        return network_receiver(
            group,
            trainer,
            members,
            shape,
            offer.kind == "relay",
            epoch_tag(epoch),
            timeout,
            watch,
        )
    what = f"trainer rank {trainer}'s shared-memory ring (epoch {epoch})"
    if offer.kind == "ipc":
        shared = SharedRing.read(group.get_text(Keys.ring(epoch, trainer), trainer, what, timeout))
        receiver: Receiver = IpcReceiver(
            shared,
            list(members).index(group.rank),
            len(members),
            trainer,
            shape.bucket_bytes,
            shape.header_cap,
            shape.num_slots,
            timeout,
            watch,
        )
        group.set_json(Keys.ring_opened(epoch, trainer, group.rank), True)
        return receiver
    ring = RingInfo(**group.get_json(Keys.ring(epoch, trainer), trainer, what, timeout))
    ring_receiver = CmaReceiver if offer.kind == "cma" else ShmReceiver
    receiver = ring_receiver(
        ring.path,
        list(members).index(group.rank),
        len(members),
        trainer,
        ring.pid,
        shape.bucket_bytes,
        shape.header_cap,
        shape.num_slots,
        timeout,
        watch,
    )
    group.set_json(Keys.ring_opened(epoch, trainer, group.rank), True)
    return receiver
