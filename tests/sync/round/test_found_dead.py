"""A member found dead by one rollout's watch is named by every member of the round.

In-process, on :mod:`round_board`. Over a relay, the rollout that passes buckets on to a
frozen rollout finds it dead (its transport's watchdog: the heartbeat went still) and cuts
its transport, which ends the trainer's send with gloo's "connection closed". That rollout
posts its finding as the round's abort before it acknowledges the round with its error, so
the trainer, whichever of the two it reads first, raises
:class:`~slipstream.errors.PeerDiedError` naming the frozen rank, not "not applied
everywhere" naming the rollout that found it (what a trainer raised when the rollout's
watch came first, as it does under load). A death of the store's host is not posted.
"""

from __future__ import annotations

from typing import Any

import pytest
from round_board import Board, Group, Sender, fail

from slipstream.errors import PeerDiedError, SyncError
from slipstream.sync.round.protocol import (
    Ack,
    Keys,
    ReceiverShape,
    RoundAbort,
    RoundStart,
    TransportOffer,
    decode,
    encode,
)
from slipstream.sync.round.rollout_round import RolloutRound
from slipstream.sync.round.trainer_round import TrainerRound
from slipstream.sync.round.versions import RolloutVersions

ROUND = 1
START = RoundStart(ROUND, "plan", 0, [1, 2])
OFFER = TransportOffer("relay", "cached", ReceiverShape(1024, 2, 4096, None))


def rollout(rank: int, board: Board) -> RolloutRound:
    group: Any = Group(rank, board)
    return RolloutRound(group, [0], {0: OFFER}, 5.0)


def trainer(board: Board) -> TrainerRound:
    group: Any = Group(0, board)
    rnd = TrainerRound(group, [0], [1, 2], OFFER, 5.0, RolloutVersions([1, 2]))
    rnd.sender = Sender()  # type: ignore[assignment]
    return rnd


def frozen(rank: int, waiter: int) -> PeerDiedError:
    return PeerDiedError(
        f"rank {rank} died (no heartbeat for 3.0 s) during a transfer, found by rank {waiter}",
        [rank],
        "a transfer",
    )


def rollout_finds_dead(board: Board, dead: int) -> BaseException:
    """Rollout 1's step of round 1 fails with its watch's finding; it acknowledges the round
    with the error it raises, as the subscriber does."""
    with pytest.raises(PeerDiedError) as err:
        rollout(1, board).guarded(ROUND, fail(frozen(dead, 1)), lambda: None)
    Group(1, board).post(Keys.ack(1, ROUND), encode(Ack(0, str(err.value), broken=True)))
    return err.value


def test_a_rollouts_finding_is_posted_as_the_abort_before_its_ack():
    board = Board()
    raised = rollout_finds_dead(board, 2)
    assert raised.ranks == [2]
    assert board.log == [
        "transport of 1 cut",
        f"{Keys.abort(ROUND)} posted by 1",
        f"{Keys.ack(1, ROUND)} posted by 1",
    ]
    abort = decode(RoundAbort, board.keys[Keys.abort(ROUND)])
    assert abort.dead == [2] and "found by rank 1" in abort.reason


@pytest.mark.parametrize("abort_seen_first", [True, False])
def test_a_trainer_whose_send_that_finding_cut_names_the_dead_rank(abort_seen_first):
    board = Board()
    rollout_finds_dead(board, 2)
    if not abort_seen_first:  # the trainer's first look misses the abort, sees the ack
        board.hidden.add(Keys.abort(ROUND))
    cut = SyncError(
        "trainer rank 0 sending a bucket to rollout rank 1 failed: Connection closed by peer"
    )
    with pytest.raises(PeerDiedError) as err:
        trainer(board).guarded(ROUND, START, fail(cut))
    assert err.value.ranks == [2]
    assert "not applied everywhere" not in str(err.value)


def test_a_dead_store_host_is_not_posted():
    board = Board()
    with pytest.raises(PeerDiedError) as err:
        rollout(1, board).guarded(ROUND, fail(frozen(0, 1)), lambda: None)
    assert err.value.ranks == [0]
    assert Keys.abort(ROUND) not in board.keys
