"""Who broke a round: the one place a trainer or a rollout works that out.

A round breaks for everyone when one member's transfer breaks (its transport fails, a
peer dies, a target refuses the bytes). The rank that sees it first looks for the cause
with :func:`who_broke`: the abort another rank already posted (the first to see a round
break names the culprit, :func:`post_abort`; the others agree with it), the suspects found
dead, or the members whose acknowledgements refused the version. After a transport's own
error it looks for up to :data:`LOOK_FOR` seconds, since a process exits a moment after
its sockets close and one on another host is known dead only once its heartbeat has been
still for :data:`..group.SILENT_AFTER_SECONDS`; after any other error it looks once.

Invariant: every member of a round that broke ends up with the same abort (the first one
posted), so every member names the same dead ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...errors import PeerTimeoutError
from ..group import SILENT_AFTER_SECONDS, SyncGroup, host_identity
from .protocol import Ack, Keys, RoundAbort, decode, encode

#: How long a rank whose transfer broke looks for the rank that broke it, in seconds.
LOOK_FOR = SILENT_AFTER_SECONDS + 1.0
POLL = 0.05


@dataclass
class Breach:
    """What broke a round: ``abort``, when a rank posted one; ``dead``, the suspects found
    dead, with why; ``refused``, the members' refusals (rank: error)."""

    abort: RoundAbort | None = None
    dead: dict[int, str] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)


def in_transfer(exc: BaseException) -> bool:
    """Whether ``exc`` is a transport's own error (not a timeout, not the caller's), after
    which the culprit may still be exiting."""
    return isinstance(exc, RuntimeError) and not isinstance(exc, PeerTimeoutError)


def exited(group: SyncGroup, ranks: Sequence[int], within: float = 1.0) -> list[int]:
    """Those of ``ranks`` on this host whose process is gone, looking for up to ``within``
    seconds (what a transport's error names as the likely cause)."""
    here = host_identity()
    local = [r for r in ranks if group.member(r).host == here]
    deadline = time.monotonic() + within
    while local:
        gone = group.dead(local)
        if gone or time.monotonic() >= deadline:
            return sorted(gone)
        time.sleep(POLL)
    return []


def who_broke(
    group: SyncGroup,
    k: int,
    leader: int,
    suspects: Sequence[int],
    members: Sequence[int],
    exc: BaseException,
) -> Breach:
    """Who broke round ``k`` (led by ``leader``), which failed here with ``exc``: the abort
    posted for it, else those of ``suspects`` found dead and those of ``members`` whose
    acknowledgements refused it. Looks for up to :data:`LOOK_FOR` seconds after a
    transport's error (see :func:`in_transfer`), else once."""
    deadline = time.monotonic() + (LOOK_FOR if in_transfer(exc) else 0.0)
    while True:
        breach = Breach()
        if group.has(Keys.abort(k)):
            breach.abort = read_abort(group, k, leader)
            return breach
        breach.dead = group.dead(suspects)
        breach.refused = refusals(group, k, members)
        if breach.dead or breach.refused or time.monotonic() >= deadline:
            return breach
        time.sleep(POLL)


def refusals(group: SyncGroup, k: int, members: Sequence[int]) -> dict[int, str]:
    """The refusals of round ``k`` that ``members`` posted in their acknowledgements
    (rank: error), whether or not they still run."""
    found = {}
    for r in members:
        if group.has(Keys.ack(r, k)):
            ack = read_ack(group, r, k)
            if ack.error:
                found[r] = ack.error
    return found


def read_abort(group: SyncGroup, k: int, leader: int) -> RoundAbort:
    """Round ``k``'s posted abort (``leader`` hosts the round: named if it is gone)."""
    return decode(RoundAbort, group.get_text(Keys.abort(k), leader, "abort"))


def read_ack(group: SyncGroup, r: int, k: int) -> Ack:
    """Rollout ``r``'s acknowledgement of round ``k``."""
    return decode(Ack, group.get_text(Keys.ack(r, k), r, "an acknowledgement"))


def post_abort(
    group: SyncGroup,
    k: int,
    dead: Sequence[int],
    reason: str,
    refused_by: int | None = None,
) -> RoundAbort:
    """Post round ``k``'s abort naming ``dead`` (or the trainer ``refused_by`` whose own
    step refused it) unless a rank posted one first; return the abort that stands."""
    mine = encode(RoundAbort(sorted(dead), reason[:2000], refused_by))
    return decode(RoundAbort, group.post_first(Keys.abort(k), mine))


def refused_here(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a trainer's own step of a round, is that rank's refusal
    rather than a transfer's failure: slipstream's errors and torch.distributed's are
    ``RuntimeError`` subclasses, so anything else came from the caller's tensors on this
    rank or the code reading them (a :class:`..layout.plan.LayoutMismatch`, a ``TypeError`` for
    an item that is not a tensor, the iterator's own error). Such a rank is the culprit:
    no member needs looking for."""
    return not isinstance(exc, RuntimeError)
