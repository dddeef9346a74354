"""The trainer's side of a publish round: :class:`TrainerRound`.

A round (see :mod:`.protocol`): the lead trainer (``trainer_ranks[0]``) gathers the requests
of the rollouts that take part, leaving out any found dead, and starts the round (version,
plan, epoch, members); every trainer reads it, builds the epoch's transport when the
members changed (:mod:`.negotiation`), sends its buckets (the publisher's part) and waits
for every member's acknowledgement. A round that breaks is given up for everyone: the
epoch's transport is dropped (freeing every member blocked on it), the abort names the
culprit (:mod:`.culprits`), and the next round starts a new epoch.

Invariant: a round starts only once every rollout not found dead asked for it, and each
rank's transport belongs to exactly one epoch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ...core import tracing
from ...core.control_plane import died_error
from ...errors import MissingRanksError, PeerDiedError, SyncError
from ..group import SyncGroup
from ..layout.described import DESCRIBED
from ..layout.runs import Routes, Runs
from ..transport.network import Sender
from .culprits import post_abort, read_abort, read_ack, refusals, refused_here, who_broke
from .negotiation import NETWORK_TRANSPORTS, build_sender, epoch_tag
from .protocol import (
    Ack,
    Keys,
    Request,
    RoundStart,
    TransportOffer,
    Wants,
    ack_lines,
    decode,
    encode,
)
from .state import EpochState
from .versions import RolloutVersions

logger = logging.getLogger(__name__)


class TrainerRound:
    """The round state of one trainer rank: the epoch, its members and transport, and the
    round being run (shared by the caller's thread and the publisher's worker, which never
    run a round at the same time)."""

    def __init__(
        self,
        group: SyncGroup,
        trainer_ranks: Sequence[int],
        rollout_ranks: Sequence[int],
        offer: TransportOffer,
        timeout: float,
        rollout_versions: RolloutVersions,
    ) -> None:
        self.group = group
        self.rank = group.rank
        self.leader = trainer_ranks[0]
        self.rollout_ranks = list(rollout_ranks)
        self._offer = offer
        self.timeout = timeout
        self.rollout_versions = rollout_versions
        self.sender: Sender | None = None
        self._sent_by_old_senders = 0
        self.state = EpochState.NONE
        self._epoch = -1
        """The current epoch's number (the last one entered; -1 before the first)."""
        self._members: list[int] = []
        self._lives: dict[str, int] = {}
        self._live_round = -1
        self._acked_whole: set[int] = set()
        """Members whose acknowledgement of the live round said their transfer was whole."""
        self.routes: Routes | None = None
        """The live round's, when it is routed (:attr:`.protocol.RoundStart.routed`)."""
        self._wants: dict[tuple[int, str], dict[int, Runs]] = {}

    def start(
        self,
        k: int,
        version: int,
        plan_id: str,
        idle: Callable[[], None] | None = None,
    ) -> tuple[RoundStart, dict[int, Request]]:
        """Agree on round ``k``: its members (the lead trainer waits for every rollout not
        found dead to ask; the others read the lead's decision), and the epoch, whose
        transport this rank builds when it is new. Returns the round and each member's
        request (what it holds). ``plan_id`` names the plan (or
        :data:`..layout.described.DESCRIBED`). ``idle`` runs while the lead waits."""
        self._live_round = k
        self._acked_whole = set()
        requests: dict[int, Request] = {}
        if self.rank == self.leader:
            start, requests = self._gather(k, version, plan_id, idle)
        else:
            what = f"lead trainer rank {self.leader} to start round {k}"
            start = decode(
                RoundStart, self.group.get_text(Keys.round(k), self.leader, what, self.timeout)
            )
            if start.cancelled:
                raise SyncError(f"round {k} was cancelled by the lead trainer: {start.cancelled}")
            if (start.version, start.plan) != (version, plan_id):
                raise SyncError(
                    f"trainer rank {self.rank} publishes version {version} (plan "
                    f"{plan_id}) but lead trainer rank {self.leader} publishes version "
                    f"{start.version} (plan {start.plan}) in round {k}: ranks disagree on the "
                    "version or on the tensors' names/shapes/dtypes"
                )
        for r in start.absent:
            self.rollout_versions.record(int(r), None)
        if not requests:  # the lead read them while gathering the round
            requests = start.member_requests()
        if start.epoch != self._epoch:
            self.guarded(k, start, lambda: self._enter_epoch(start))
        self.routes = None
        if start.routed:  # a member that died before it posted its wants fails the round
            self.routes = self.guarded(k, start, lambda: self._routes(k, start, requests))
        return start, requests

    def _routes(self, k: int, start: RoundStart, requests: dict[int, Request]) -> Routes:
        """Each member's runs in routed round ``k``: those it posted for the round's plan
        as it asked (read once per member and wants), or after it read the round (a member
        that may keep part of the tensors, without wants of this plan yet), else every
        byte."""
        members: dict[int, dict[int, Runs]] = {}
        for i, r in enumerate(start.members, 1):
            token = requests[r].wants_for(start.plan)
            if token is not None and (r, token) not in self._wants:
                text = self.group.get_text(Keys.wants(r, token), r, "its wants", self.timeout)
                self._wants[(r, token)] = _runs(decode(Wants, text))
            if token is not None:
                members[i] = self._wants[(r, token)]
            elif requests[r].partial:
                what = f"its wants for round {k}"
                text = self.group.get_text(Keys.round_wants(r, k), r, what, self.timeout)
                members[i] = _runs(decode(Wants, text))
            else:
                members[i] = {}
        return Routes(members)

    def _gather(
        self, k: int, version: int, plan_id: str, idle: Callable[[], None] | None
    ) -> tuple[RoundStart, dict[int, Request]]:
        """The lead's side of :meth:`start`: wait for the requests, post the round;
        returns it with the members' requests."""
        self.group.post(Keys.NEXT_ROUND, str(k))
        try:
            absent = self.group.wait_keys(
                {r: Keys.request(r, k) for r in self.rollout_ranks},
                f"rollouts to ask for version {version} (round {k})",
                self.timeout,
                idle=idle,
                drop_dead=True,
            )
        except MissingRanksError as exc:
            cancelled = RoundStart(version, plan_id, self._epoch, [], cancelled=str(exc))
            self.group.post(Keys.round(k), encode(cancelled))
            raise
        lives = {}
        asked_by: dict[int, Request] = {}
        present = [r for r in self.rollout_ranks if r not in absent]
        texts = self.group.read_all([Keys.request(r, k) for r in present])  # one request
        processes = self.group.members(present)  # and one more
        for r, text in zip(present, texts, strict=True):
            asked = decode(Request, text)
            now = processes[r].incarnation
            if asked.incarnation != now:  # asked by a process that was replaced since
                absent[r] = f"its request came from incarnation {asked.incarnation}, not {now}"
            else:
                lives[str(r)] = now
                asked_by[r] = asked
        absent.update(self.group.dead([int(r) for r in lives]))
        members = [r for r in self.rollout_ranks if r not in absent]
        lives = {str(r): lives[str(r)] for r in members}
        epoch = self._epoch
        if lives != self._lives or self.state is not EpochState.READY:
            epoch = self._epoch + 1
        if absent:
            logger.warning(
                "trainer rank %d: version %d goes to rollout rank(s) %s only; left out: %s",
                self.rank,
                version,
                members,
                absent,
            )
        routed = (
            self._offer.kind in NETWORK_TRANSPORTS
            and plan_id != DESCRIBED  # its layout is learned as it arrives
            and any(asked_by[r].partial or asked_by[r].wants_for(plan_id) for r in members)
        )
        start = RoundStart(
            version,
            plan_id,
            epoch,
            members,
            {str(r): w for r, w in absent.items()},
            lives,
            routed=routed,
            requests={str(r): dataclasses.asdict(asked_by[r]) for r in members},
        )
        self.group.append(Keys.acks(k), "")  # there before any member reads the round
        self.group.post(Keys.round(k), encode(start))
        self.group.post(Keys.NEXT_ROUND, str(k + 1))
        return start, {r: asked_by[r] for r in members}

    def _enter_epoch(self, start: RoundStart) -> None:
        """Drop the last epoch's transport and build this rank's sender for ``start``'s."""
        self.drop_sender()
        if start.members:
            self.sender = build_sender(
                self.group, self._offer, start.epoch, start.members, self.timeout, self._watch
            )
        self._epoch, self._members = start.epoch, list(start.members)
        self._lives = dict(start.lives)
        self.state = EpochState.READY

    def close(self) -> None:
        """Let the transport go for good (the publisher closes)."""
        self.drop_sender()
        self.state = EpochState.NONE

    def drop_sender(self, broken: bool = False) -> None:
        """Let the current epoch's transport go: its process group's connections close
        (``broken``: its transfer broke, see :meth:`.SyncGroup.drop_subgroup`)."""
        sender = self.sender
        if sender is None:
            return
        self.sender = None
        self._sent_by_old_senders += sender.bytes_sent
        sender.close()
        self.group.drop_subgroup([self.rank, *self._members], epoch_tag(self._epoch), broken)

    def _watch(self) -> None:
        """Raise when the current round was given up by another trainer, or a member's
        transfer broke (a ring wait runs this: such a member frees no slot again)."""
        k = self._live_round
        if k < 0:
            return
        if self.group.has(Keys.abort(k)):
            abort = read_abort(self.group, k, self.leader)
            raise abort.as_error(k)
        for r, ack in self._acks(k).items():
            if r in self._members and r not in self._acked_whole:
                if ack.broken:
                    raise SyncError(f"rollout rank {r}'s transfer broke: {ack.error}")
                self._acked_whole.add(r)

    def _acks(self, k: int) -> dict[int, Ack]:
        """Round ``k``'s acknowledgements posted so far, by member: one request."""
        return ack_lines(self.group.read(Keys.acks(k)))

    def guarded(self, k: int, start: RoundStart, step: Callable[[], Any]) -> Any:
        """Run one step of round ``k``; when it fails, give the round up for everyone."""
        try:
            return step()
        except BaseException as exc:
            raise self._give_up(k, start, exc) from exc

    def _give_up(self, k: int, start: RoundStart, exc: BaseException) -> BaseException:
        """Give round ``k`` up: drop the epoch's transport (freeing every member blocked on
        it), post the abort naming the members found dead, and return the error to raise:
        the dead rank as its subject when one is found, else the members' own refusals.

        A refusal of this rank's own (:func:`.culprits.refused_here`: the caller's tensors
        here did not fit the round) is posted as the abort *before* the transport is cut,
        so every member whose transfer the cut ends reads it as the cause, and is raised
        as it is, whatever the others found meanwhile: this rank is the culprit."""
        self.state = EpochState.BROKEN
        if refused_here(exc):
            reason = f"trainer rank {self.rank}: {type(exc).__name__}: {exc}"
            try:
                post_abort(self.group, k, [], reason, refused_by=self.rank)
            except RuntimeError:  # SyncError among them
                pass  # the store's host is gone: every member finds that out by itself
            self.drop_sender(broken=True)
            return exc
        self.drop_sender(broken=True)
        dead: dict[int, str] = {}
        refused: dict[int, str] = {}
        breach_known = False  # another rank's abort was read: posting one would read it back
        if isinstance(exc, PeerDiedError):
            dead = {r: str(exc) for r in exc.ranks}
            refused = refusals(self.group, k, exc.ranks)
        else:
            try:
                breach = who_broke(self.group, k, self.leader, start.members, start.members, exc)
                dead, refused = breach.dead, breach.refused
                if breach.abort is not None and breach.abort.refused_by is not None:
                    return breach.abort.as_error(k)  # another trainer refused it: the cause
                if breach.abort is not None:
                    dead = {r: "found dead by another rank" for r in breach.abort.dead}
                    breach_known = True
            except RuntimeError:  # SyncError among them
                pass  # the store's host is gone: every member finds that out by itself
        # a rollout that refused the version and then exited is found gone: its posted
        # refusal is the cause, not its exit
        dead = {r: why for r, why in dead.items() if r not in refused}
        if not breach_known:
            try:  # the first to see the round break names the culprit; later ones agree
                posted = post_abort(self.group, k, list(dead), str(exc))
                if posted.dead:
                    dead = {r: dead.get(r, "found dead by another rank") for r in posted.dead}
            except (RuntimeError, SyncError):
                pass
        what = f"version {start.version} (round {k})"
        if dead and not (isinstance(exc, PeerDiedError) and set(exc.ranks) == set(dead)):
            return died_error(dead, what, 0.0, f"trainer rank {self.rank} sending")
        if refused and not dead:
            causes = "; ".join(f"rollout rank {r}: {e}" for r, e in sorted(refused.items()))
            return SyncError(f"{what} was not applied everywhere: {causes}")
        return exc

    def finish(self, k: int, start: RoundStart) -> int:
        """Wait until every send left and every member acknowledged round ``k``."""
        self.guarded(k, start, lambda: self._await_acks(k, start))
        errors = []
        acks = self._acks(k)
        for r in start.members:
            ack = acks.get(r) or read_ack(self.group, r, k)  # its line may have failed
            self.rollout_versions.record(r, ack.holds)
            if ack.error:
                errors.append(f"rollout rank {r}: {ack.error}")
        if errors:
            self.state = EpochState.BROKEN
            raise SyncError(
                f"version {start.version} was not applied everywhere: " + "; ".join(errors)
            )
        return start.version

    @tracing.spanned("slipstream.sync.publish.await_acks")
    def _await_acks(self, k: int, start: RoundStart) -> None:
        if self.sender is not None:
            self.sender.flush()
        self.group.wait_keys(
            {r: Keys.ack(r, k) for r in start.members},
            f"rollouts to acknowledge version {start.version}",
            self.timeout,
            idle=self._watch,
        )

    def sent_bytes(self) -> int:
        current = self.sender.bytes_sent if self.sender is not None else 0
        return self._sent_by_old_senders + current


def _runs(wants: Wants) -> dict[int, Runs]:
    return {int(t): Runs(*v) for t, v in wants.runs.items()}
