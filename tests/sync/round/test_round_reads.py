"""What a trainer other than the lead reads of a round does not grow with its rollouts.

In-process, on :mod:`round_board`: a round of R members, started by the lead (their
requests in the round's start) and acknowledged by every member (their lines in the
round's acknowledgements). A second trainer takes part in it: reads the start, watches
the round while it sends, and finishes it. Its store calls are counted: the same for 64
members as for 2, since it reads every member's request and acknowledgement in the one
key each comes in, not one key per member."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from round_board import Board, Group

from slipstream.errors import SyncError
from slipstream.sync.round.protocol import (
    Ack,
    Keys,
    ReceiverShape,
    Request,
    RoundStart,
    TransportOffer,
    ack_line,
    encode,
)
from slipstream.sync.round.trainer_round import TrainerRound
from slipstream.sync.round.versions import RolloutVersions

ROUND = 3
OFFER = TransportOffer("relay", "cached", ReceiverShape(1024, 2, 4096, None))


class CountingGroup(Group):
    """A rank's view of the board that counts its calls, by method."""

    def __init__(self, rank: int, board: Board) -> None:
        super().__init__(rank, board)
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        found = super().__getattribute__(name)
        if name in ("post", "post_first", "has", "get_text", "read", "append", "wait_keys"):
            super().__getattribute__("calls")[name] += 1
        return found


def board_of_round(members: list[int]) -> Board:
    """A board where the lead started round ``ROUND`` of ``members`` and each acknowledged
    holding its version."""
    board = Board()
    requests = {str(r): dataclasses.asdict(Request(None, incarnation=1)) for r in members}
    lives = {str(r): 1 for r in members}
    start = RoundStart(7, "plan", 0, members, lives=lives, requests=requests)
    board.keys[Keys.round(ROUND)] = encode(start)
    for r in members:
        board.keys[Keys.ack(r, ROUND)] = encode(Ack(7))
    board.keys[Keys.acks(ROUND)] = "".join(ack_line(r, Ack(7)) for r in members)
    return board


def second_trainer_calls(rollouts: int) -> tuple[Counter[str], dict[int, int | None]]:
    members = list(range(2, 2 + rollouts))
    group = CountingGroup(1, board_of_round(members))
    versions = RolloutVersions(members)
    rnd = TrainerRound(group, [0, 1], members, OFFER, 5.0, versions)  # type: ignore[arg-type]
    rnd._epoch, rnd._members = 0, members  # its transport for epoch 0 is built already
    start, requests = rnd.start(ROUND, 7, "plan")
    assert sorted(requests) == members and all(q.incarnation == 1 for q in requests.values())
    rnd._watch()
    assert rnd.finish(ROUND, start) == 7
    return group.calls, versions.snapshot()


def test_a_second_trainer_reads_the_same_for_two_rollouts_as_for_64() -> None:
    few, held_few = second_trainer_calls(2)
    many, held_many = second_trainer_calls(64)
    assert set(held_few.values()) == set(held_many.values()) == {7}
    assert many == few, (few, many)
    assert sum(many.values()) <= 6, many


def test_a_broken_member_in_the_acknowledgements_stops_the_watch() -> None:
    members = [2, 3, 4]
    board = board_of_round(members)
    board.keys[Keys.acks(ROUND)] = ack_line(3, Ack(None, "cut", broken=True))
    group: Any = Group(1, board)
    rnd = TrainerRound(group, [0, 1], members, OFFER, 5.0, RolloutVersions(members))
    rnd._epoch, rnd._members = 0, members
    rnd.start(ROUND, 7, "plan")
    with pytest.raises(SyncError, match="rollout rank 3's transfer broke: cut"):
        rnd._watch()
