"""Point-to-point transfers on a gloo group of slipstream's own, waited on with liveness.

The read-once exchange of a load and the local tier's replicas and recoveries move bytes
between ranks with gloo's ``isend``/``irecv``. gloo ends a transfer to a process that
exited at once (its connection closes), but one to a host that vanished (no reset) only
at the group's timeout, and a gloo wait cannot be cut short without closing the
connection. So :func:`move` posts a batch, waits on it on a waiter thread of its own, and
meanwhile looks at the peers' liveness every :data:`LOOK_SECONDS` through the group's
channel (:class:`~.save.channel.RankChannel`, whose ranks are the group's).

Invariant: a wait on a peer ends once that peer is found dead, or its connection drops,
raising :class:`PeerDiedError` naming it and the transfer, or at the deadline, raising
:class:`CheckpointError` naming the peers still pending; never at the group's timeout.
The works a death abandons end at the group's timeout at the latest; their waiter is a
daemon thread (it never holds up the process's exit), handed to the caller to join as far
as it can.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.control_plane import ranks_text
from ..core.waits import Deadline
from ..errors import CheckpointError, PeerDiedError
from .save.channel import LIVENESS_CHECK_SECONDS, RankChannel

LOOK_SECONDS = LIVENESS_CHECK_SECONDS / 2
"""How often the peers of the transfers in flight are looked at (as the channel's waits do)."""


@dataclass(frozen=True)
class Move:
    """One transfer: ``data`` sent to ``peer`` (``outgoing``) or received from it, under
    ``tag`` (the same on both ends); ``what`` names it in errors."""

    peer: int
    tag: int
    data: torch.Tensor
    outgoing: bool
    what: str


class _Broken(CheckpointError):
    """A transfer failed in gloo (its connection dropped, or its timeout passed)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


def move(
    group: dist.ProcessGroup,
    channel: RankChannel,
    moves: Sequence[Move],
    deadline: Deadline,
    abandoned: list[threading.Thread],
) -> int:
    """Post every move at once on ``group``, then wait for all of them (see the module
    docstring); returns the bytes received. A waiter left behind is appended to
    ``abandoned``."""
    if not moves:
        return 0
    works = [(m, _post(group, m)) for m in moves]
    pending = [m.peer for m in moves]
    done: Future[None] = Future()
    waiter = threading.Thread(
        target=_wait_all, args=(works, pending, done), name="slipstream-transfer-wait",
        daemon=True,
    )  # fmt: skip
    waiter.start()
    try:
        _wait(channel, done, pending, deadline, moves)
    except BaseException:
        abandoned.append(waiter)
        raise
    waiter.join()
    return sum(m.data.numel() for m in moves if not m.outgoing)


def _post(group: dist.ProcessGroup, m: Move) -> Any:
    if m.outgoing:
        return dist.isend(m.data, group=group, tag=m.tag, group_dst=m.peer)
    return dist.irecv(m.data, group=group, tag=m.tag, group_src=m.peer)


def _wait(
    channel: RankChannel,
    done: Future[None],
    pending: list[int],
    deadline: Deadline,
    moves: Sequence[Move],
) -> None:
    me = channel.rank
    while True:
        try:
            done.result(min(LOOK_SECONDS, deadline.remaining() or LOOK_SECONDS))
            return
        except FutureTimeout:
            pass
        except _Broken as exc:
            why = f"rank {me} lost its connection to rank {exc.peer}: {exc}"
            raise PeerDiedError(why, [exc.peer], "a transfer between ranks") from exc
        waiting = sorted(set(pending))
        dead = channel.dead_among(waiting) if waiting else {}
        if dead:
            why = "; ".join(f"rank {me} found rank {r} dead ({w})" for r, w in dead.items())
            first = next(m.what for m in moves if m.peer in dead)
            raise PeerDiedError(f"{why}, while {first}", sorted(dead), first)
        if deadline.expired():
            raise CheckpointError(
                f"{ranks_text(waiting)} did not finish a transfer with rank {me} within "
                f"{deadline.timeout} s"
            )


def _wait_all(works: list[tuple[Move, Any]], pending: list[int], done: Future[None]) -> None:
    """Wait for ``works`` in order, taking each one's peer off ``pending`` once done; the
    outcome goes to ``done``."""
    for m, work in works:
        try:
            work.wait()
        except Exception as exc:
            done.set_exception(_Broken(f"{m.what} failed: {exc}", m.peer))
            return
        pending.remove(m.peer)
    done.set_result(None)
