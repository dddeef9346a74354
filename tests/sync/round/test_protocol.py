"""The wire protocol: messages survive the store's JSON both ways, and keys never collide."""

from __future__ import annotations

import itertools

from slipstream.errors import PeerDiedError, SyncError
from slipstream.sync.round.protocol import (
    AgainOffer,
    CacheAddress,
    Keys,
    ReceiverShape,
    Request,
    RoundAbort,
    RoundStart,
    TransportOffer,
    decode,
    encode,
)


def test_messages_round_trip_through_json_and_ignore_fields_they_do_not_know():
    start = RoundStart(7, "abc", 3, [1, 2], {"4": "its process (pid 9) is gone"}, {"1": 1, "2": 2})
    assert decode(RoundStart, encode(start)) == start
    assert decode(Request, '{"held": 6, "incarnation": 2, "later": true}') == Request(6, 2)
    offer = TransportOffer("relay", "cached", ReceiverShape(1024, 2, 4096, None))
    assert TransportOffer.read(encode(offer)) == offer
    again = AgainOffer(5, "p", "cma", ReceiverShape(64, 2, 64, 0), CacheAddress(11, 4096, {"0": 0}))
    assert AgainOffer.read(encode(again)) == again


def test_a_round_is_taken_part_in_by_the_incarnation_it_names_only():
    start = RoundStart(7, "abc", 3, [1, 2], lives={"1": 1, "2": 2})
    assert start.takes_part(2, 2)
    assert not start.takes_part(2, 1)  # the process that rank 2 replaced
    assert not start.takes_part(3, 1)
    cancelled = RoundStart(7, "abc", 3, [], cancelled="rank(s) [2] did not answer")
    assert not cancelled.takes_part(2, 2)


def test_an_abort_names_the_dead_as_its_subject():
    err = RoundAbort([2], "connection closed").as_error(5)
    assert isinstance(err, PeerDiedError) and err.ranks == [2]
    assert str(err).startswith("rollout rank(s) [2] died during round 5")
    plain = RoundAbort([], "timed out").as_error(5)
    assert isinstance(plain, SyncError) and not isinstance(plain, PeerDiedError)


def test_keys_of_different_messages_never_collide():
    builders = {
        "request": Keys.request,
        "round": lambda a, b: Keys.round(a),
        "abort": lambda a, b: Keys.abort(a),
        "ack": Keys.ack,
        "transport": lambda a, b: Keys.transport(a),
        "probe": lambda a, b: Keys.probe(a),
        "probed": Keys.probed,
        "ring": Keys.ring,
        "ring_opened": lambda a, b: Keys.ring_opened(a, b, 0),
        "again_count": lambda a, b: Keys.again_count(a),
        "again_ticket": lambda a, b: Keys.again_ticket(a),
        "again_offer": lambda a, b: Keys.again_offer(a, b, 0),
        "again_go": Keys.again_go,
        "again_ack": Keys.again_ack,
        "plan": lambda a, b: Keys.plan(f"p{a}"),
    }
    meaning: dict[str, tuple] = {Keys.ASK_AGAIN_COUNT: ("count",), Keys.NEXT_ROUND: ("next",)}
    for (kind, build), a, b in itertools.product(builders.items(), range(3), range(3)):
        key = build(a, b)
        want = (
            (kind, a)
            if kind
            in ("round", "abort", "transport", "probe", "again_count", "again_ticket", "plan")
            else (kind, a, b)
        )
        assert meaning.setdefault(key, want) == want, (key, meaning[key], want)
