"""A trainer's own refusal of a round (the caller's tensors on it do not fit: a layout
mismatch) is the round's cause, whatever the other ranks found meanwhile.

In-process, on a stand-in for the sync group's store that logs what happens in order: the
refusing trainer posts the abort naming itself before it cuts its transport (so a member
whose transfer the cut ends reads the cause), and raises its own error even when a
rollout's refusal is already posted and no abort is (what a slower trainer met when another
trainer's cut reached the rollouts first: it raised their refusal, not its mismatch). A
trainer whose transfer broke under another trainer's refusal raises that refusal.
"""

from __future__ import annotations

from typing import Any

import pytest
from round_board import Board, Group, Sender, fail

from slipstream.errors import SyncError
from slipstream.sync import LayoutMismatch
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
from slipstream.sync.round.trainer_round import TrainerRound
from slipstream.sync.round.versions import RolloutVersions

ROUND = 2
START = RoundStart(ROUND, "plan", 0, [2, 3])
MISMATCH = "'b3' is [1002] float32, the layout has [1003] float32"


def trainer(rank: int, board: Board) -> TrainerRound:
    offer = TransportOffer("broadcast", "direct", ReceiverShape(1024, 2, 4096, None))
    group: Any = Group(rank, board)
    rnd = TrainerRound(group, [0, 1], [2, 3], offer, 5.0, RolloutVersions([2, 3]))
    rnd.sender = Sender()  # type: ignore[assignment]
    return rnd


def test_a_trainers_own_mismatch_is_posted_before_its_cut_and_raised_over_a_posted_refusal():
    board = Board()
    refusal = Ack(None, "receiving a bucket from trainer rank 0 failed: connection closed", True)
    board.keys[Keys.ack(3, ROUND)] = encode(refusal)  # posted before any abort
    mismatch = LayoutMismatch(MISMATCH)
    with pytest.raises(LayoutMismatch) as err:
        trainer(1, board).guarded(ROUND, START, fail(mismatch))
    assert err.value is mismatch
    assert board.log == [f"{Keys.abort(ROUND)} posted by 1", "transport of 1 cut"]
    abort = decode(RoundAbort, board.keys[Keys.abort(ROUND)])
    assert abort.refused_by == 1 and abort.dead == [] and MISMATCH in abort.reason
    said = str(abort.as_error(ROUND))
    assert "trainer rank 1" in said and MISMATCH in said


def test_every_trainer_raises_its_own_mismatch_when_another_refused_first():
    board = Board()
    with pytest.raises(LayoutMismatch):
        trainer(0, board).guarded(ROUND, START, fail(LayoutMismatch(MISMATCH)))
    with pytest.raises(LayoutMismatch):
        trainer(1, board).guarded(ROUND, START, fail(LayoutMismatch(MISMATCH)))
    assert decode(RoundAbort, board.keys[Keys.abort(ROUND)]).refused_by == 0  # the first


def test_a_transfer_broken_by_another_trainers_refusal_raises_that_refusal():
    board = Board()
    with pytest.raises(LayoutMismatch):
        trainer(1, board).guarded(ROUND, START, fail(LayoutMismatch(MISMATCH)))
    cut = SyncError("trainer rank 0 broadcasting a bucket failed: connection closed by peer")
    with pytest.raises(SyncError) as err:
        trainer(0, board).guarded(ROUND, START, fail(cut))
    assert "trainer rank 1" in str(err.value) and MISMATCH in str(err.value)
    assert err.value.__cause__ is cut
