"""The rollout's side of a publish round: :class:`RolloutRound`.

A rollout asks for the next round (its request says which version it holds, and the base
of deltas it recorded), reads the round the lead trainer started, passes over rounds that
went on without it, and builds the epoch's receivers (one per trainer) when the members
changed. When its transfer breaks it drops them (freeing every member relaying from it)
and names the rank that broke the round (:mod:`.culprits`); it acknowledges every round it
took part in, with the error when it did not apply the version.

Invariant: the receivers belong to exactly one epoch and are held exactly while ``state`` is
:attr:`.state.EpochState.READY`; a rank's requests go to consecutive rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ...errors import PeerDiedError, SyncError
from ..group import STORE_HOST, SyncGroup
from ..transport.network import Receiver
from .culprits import in_transfer, post_abort, read_abort, who_broke
from .negotiation import build_receiver, epoch_tag
from .protocol import (
    Ack,
    Keys,
    Request,
    RoundAbort,
    RoundStart,
    TransportOffer,
    ack_line,
    decode,
    encode,
)
from .state import EpochState

_T = TypeVar("_T")


class RolloutRound:
    """The round state of one rollout rank: the next round to ask for, the epoch, its
    members and receivers."""

    def __init__(
        self,
        group: SyncGroup,
        trainer_ranks: Sequence[int],
        offers: dict[int, TransportOffer],
        timeout: float,
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.trainer_ranks = list(trainer_ranks)
        self.leader = self.trainer_ranks[0]
        self._offers = offers
        self.timeout = timeout
        self._round: int | None = None
        self._live_round = -1
        self.receivers: dict[int, Receiver] = {}
        self.state = EpochState.NONE
        self.epoch = -1
        """The epoch whose receivers are held (meaningful in READY only)."""
        self._members: list[int] = []

    def join(
        self,
        held: int | None,
        delta_base: int | None,
        wants: str | None = None,
        partial: bool = False,
    ) -> tuple[int, RoundStart]:
        """Ask for the next round this rank is a member of (``wants``, ``partial``: what it
        keeps, see :class:`.protocol.Request`); return it, with its transport built. A rank
        that (re)joins starts at the round the lead trainer is gathering; a round that went
        on without it, or was cancelled, is passed over."""
        k = self._round
        if k is None:
            k = int(self.group.store.get(Keys.NEXT_ROUND)) if self.group.has(Keys.NEXT_ROUND) else 0
        incarnation = self.group.incarnation
        while True:
            request = Request(held, incarnation, delta_base, wants, partial)
            self.group.post(Keys.request(self.rank, k), encode(request))
            self._round = k
            what = f"lead trainer rank {self.leader} to start round {k}"
            text = self.group.get_text(Keys.round(k), self.leader, what, self.timeout)
            start = decode(RoundStart, text)
            k += 1
            if start.takes_part(self.rank, incarnation):
                break
        self._round = k
        self._live_round = k - 1
        if start.epoch != self.epoch or self.state is not EpochState.READY:
            self._enter_epoch(k - 1, start)
        return k - 1, start

    def _enter_epoch(self, k: int, start: RoundStart) -> None:
        """Drop the last epoch's receivers and build this epoch's, one per trainer."""
        self.drop_receivers()
        try:
            for t in self.trainer_ranks:
                self.receivers[t] = build_receiver(
                    self.group,
                    self._offers[t],
                    t,
                    start.epoch,
                    start.members,
                    self.timeout,
                    self._watch,
                )
        except BaseException as exc:
            self.drop_receivers(EpochState.BROKEN)
            raise self.explain(k, exc) from exc
        self.epoch, self._members = start.epoch, list(start.members)
        self.state = EpochState.READY

    def drop_receivers(self, then: EpochState = EpochState.NONE) -> None:
        """Let the epoch's receivers go: their process groups' connections close, so a
        member blocked on one (relaying from us) is freed at once. ``then``: BROKEN when a
        round broke, NONE when the subscriber closes or a new epoch is entered."""
        for receiver in self.receivers.values():
            receiver.close()
        self.receivers = {}
        for t in self.trainer_ranks:
            self.group.drop_subgroup(
                [t, *self._members], epoch_tag(self.epoch), then is EpochState.BROKEN
            )
        self.state = then

    def _watch(self) -> None:
        """Raise when the trainers gave the current round up (a ring wait runs this)."""
        k = self._live_round
        if k >= 0 and self.group.has(Keys.abort(k)):
            raise self._abort(k).as_error(k)

    def _abort(self, k: int) -> RoundAbort:
        return read_abort(self.group, k, self.leader)

    def guarded(self, k: int, step: Callable[[], _T], forget: Callable[[], None]) -> _T:
        """Run one step of round ``k``'s transfer; when it breaks, drop the epoch's
        receivers and raise naming the rank that broke it."""
        try:
            return step()
        except BaseException as exc:
            self.drop_receivers(EpochState.BROKEN)
            forget()  # the round's own references to the receivers
            raise self.explain(k, exc) from exc

    def explain(self, k: int, exc: BaseException) -> BaseException:
        """The error for round ``k`` broken by ``exc``: when it is a transport's (not a
        timeout, not the target's own), the dead rank or the refusing trainer named by the
        round's abort, or a dead trainer or member found by :func:`.culprits.who_broke`
        (then posted as the abort); when it is this rank's own finding of a dead member
        (its transport's watchdog), that finding posted as the abort before the ack, so a
        trainer whose transfer this rank's cut ended names the dead rank too, not this
        rank's refusal (unless the store's host is among the dead); else ``exc`` itself."""
        if isinstance(exc, PeerDiedError) and STORE_HOST not in exc.ranks:
            try:
                abort = post_abort(self.group, k, exc.ranks, f"rollout rank {self.rank}: {exc}")
            except SyncError:  # the store's host is gone: every member finds that out
                return exc
            return abort.as_error(k) if abort.dead or abort.refused_by is not None else exc
        if not in_transfer(exc):
            return exc
        others = [r for r in [*self.trainer_ranks, *self._members] if r != self.rank]
        try:
            breach = who_broke(self.group, k, self.leader, others, [], exc)
            if breach.abort is not None:  # its dead, or the trainer that refused, broke it
                abort = breach.abort
                return abort.as_error(k) if abort.dead or abort.refused_by is not None else exc
            if breach.dead:  # the first to see the round break names the culprit
                reason = f"rollout rank {self.rank}: {exc}"
                return post_abort(self.group, k, list(breach.dead), reason).as_error(k)
        except SyncError as lost:  # the store's host (a trainer) is gone
            return lost
        return exc

    def ack(self, key: str, ack: Ack) -> None:
        try:
            self.group.post(key, encode(ack))
        except (RuntimeError, SyncError):
            pass

    def ack_round(self, k: int, ack: Ack) -> None:
        """Acknowledge round ``k``: under this rank's key, and as a line of the round's
        acknowledgements (what the trainers read)."""
        self.ack(Keys.ack(self.rank, k), ack)
        try:
            self.group.append(Keys.acks(k), ack_line(self.rank, ack))
        except (RuntimeError, SyncError):
            pass
