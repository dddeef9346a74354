"""The local tier's byte transfers between ranks, over a gloo group of the tier's own.

Every rank of a local tier makes one :class:`TierLink` when the tier opens (all together,
on the caller's thread). Its group carries the tier's replicas (on the tier's replication
thread) and its recoveries (on the caller's thread, in a load every rank runs together,
which first waits for every local save in flight): never both at once, and no other code
uses the group. There is no listening socket or handshake of slipstream's own: the
group's connections are torch.distributed's, set up through the job's store.

Invariant: a wait on a peer ends once that peer is found dead, not at the group's
timeout. gloo ends a transfer to a process that exited at once (its connection closes),
but one to a host that vanished (no reset) only at the group's timeout, and a gloo wait
cannot be cut short without closing the connection. So each batch of transfers is waited
on by a waiter thread of the link's, while the calling thread looks at the peers'
liveness every :data:`LOOK_SECONDS`: a peer found dead raises :class:`PeerDiedError`
naming it at once. The abandoned works end at the group's timeout at the latest (the job
restarts after a death); their waiter is a daemon thread, so it never holds up the
process's exit, and :meth:`TierLink.close` joins it as far as it can.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...core.control_plane import ranks_text
from ...core.gloo_groups import new_gloo_group
from ...core.waits import Deadline
from ...errors import CheckpointError, PeerDiedError
from ..save.channel import LIVENESS_CHECK_SECONDS, RankChannel

logger = logging.getLogger(__name__)

LOOK_SECONDS = LIVENESS_CHECK_SECONDS / 2
"""How often the peers of the transfers in flight are looked at (as the channel's waits do)."""
ABANDONED_JOIN_SECONDS = 1.0
"""How long :meth:`TierLink.close` waits for each waiter a death left behind."""


@dataclass(frozen=True)
class Move:
    """One transfer: ``data`` sent to ``peer`` (``outgoing``) or received from it, under
    ``tag`` (the same on both ends); ``what`` names it in errors."""

    peer: int
    tag: int
    data: torch.Tensor
    outgoing: bool
    what: str


class LinkBroken(CheckpointError):
    """A transfer failed in gloo (its connection dropped, or its timeout passed): the peer
    is gone or unreachable; ``peer`` is its rank."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class TierLink:
    """The tier's gloo group over the ranks of ``channel``, and its waits (see the module
    docstring)."""

    def __init__(self, channel: RankChannel, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout
        self.group = new_gloo_group(channel.global_ranks, timeout, "slipstream_local_tier")
        self._lock = threading.Lock()
        self._abandoned: list[threading.Thread] = []
        """Waiters left behind by a wait that ended on a death: their works end at the
        group's timeout (or sooner, as the dead peer's connection closes)."""

    def move(self, moves: Sequence[Move], deadline: Deadline) -> int:
        """Post every move at once, then wait for all of them; returns the bytes received.
        Raises :class:`PeerDiedError` naming a peer found dead (or whose connection
        dropped), :class:`CheckpointError` naming the peers still pending at ``deadline``."""
        if not moves:
            return 0
        with self._lock:  # one batch at a time
            works = [(m, self._post(m)) for m in moves]
            pending: list[int] = [m.peer for m in moves]
            done: Future[None] = Future()
            waiter = threading.Thread(
                target=_wait_all, args=(works, pending, done), name="slipstream-tier-wait",
                daemon=True,
            )  # fmt: skip
            waiter.start()
            try:
                self._wait(done, pending, deadline, moves)
            except BaseException:
                self._abandoned.append(waiter)
                raise
            waiter.join()
        return sum(m.data.numel() for m in moves if not m.outgoing)

    def _post(self, move: Move) -> Any:
        if move.outgoing:
            return dist.isend(move.data, group=self.group, tag=move.tag, group_dst=move.peer)
        return dist.irecv(move.data, group=self.group, tag=move.tag, group_src=move.peer)

    def _wait(
        self, done: Future[None], pending: list[int], deadline: Deadline, moves: Sequence[Move]
    ) -> None:
        me = self.channel.rank
        while True:
            try:
                done.result(min(LOOK_SECONDS, deadline.remaining() or LOOK_SECONDS))
                return
            except FutureTimeout:
                pass
            except LinkBroken as exc:
                why = f"rank {me} lost its connection to rank {exc.peer}: {exc}"
                raise PeerDiedError(why, [exc.peer], "a local-tier transfer") from exc
            waiting = sorted(set(pending))
            dead = self.channel.dead_among(waiting) if waiting else {}
            if dead:
                why = "; ".join(f"rank {me} found rank {r} dead ({w})" for r, w in dead.items())
                first = next(m.what for m in moves if m.peer in dead)
                raise PeerDiedError(f"{why}, while {first}", sorted(dead), first)
            if deadline.expired():
                raise CheckpointError(
                    f"{ranks_text(waiting)} did not finish a local-tier transfer with rank {me} "
                    f"within {deadline.timeout} s"
                )

    def close(self) -> None:
        """Drop the group, then join the waiters a death left behind (their works fail as
        the group goes; one still blocked is left to end at the group's timeout, logged)."""
        dist.destroy_process_group(self.group)
        for waiter in self._abandoned:
            waiter.join(ABANDONED_JOIN_SECONDS)
            if waiter.is_alive():
                logger.info(
                    "rank %d: a local-tier transfer to a dead peer ends at the group's "
                    "timeout (%.0f s)", self.channel.rank, self.timeout,
                )  # fmt: skip


def _wait_all(works: list[tuple[Move, Any]], pending: list[int], done: Future[None]) -> None:
    """Wait for ``works`` in order, taking each one's peer off ``pending`` once done; the
    outcome goes to ``done``."""
    for move, work in works:
        try:
            work.wait()
        except Exception as exc:
            done.set_exception(LinkBroken(f"{move.what} failed: {exc}", move.peer))
            return
        pending.remove(move.peer)
    done.set_result(None)
