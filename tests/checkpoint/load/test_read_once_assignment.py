"""The read-once assignment (:mod:`slipstream.checkpoint.load.read_once`) on its own.

Every byte each rank wants must reach it exactly once (read by itself, received or copied),
every send must meet a receive with the same tag, and bytes several ranks want must be read
by one of them, split about evenly. Checked on the plans of DDP replicas, of HSDP replica
groups, and on random overlapping plans against a byte-by-byte model of who wants what.
"""

from __future__ import annotations

import random

from slipstream.checkpoint.load.read_once import Want, assign, share_of

MIB = 1 << 20


def _check(wants: list[list[Want]]) -> list[int]:
    """Assert the invariants of the module docstring; return the bytes each rank reads."""
    pieces = assign(wants)
    shares = [share_of(pieces, r) for r in range(len(wants))]
    for rank, own in enumerate(wants):
        for i, w in enumerate(own):
            got = [(o.lo, o.hi) for o in shares[rank].reads if o.want == i]
            got += [
                (t.lo, t.hi) for t in shares[rank].receives + shares[rank].copies if t.dest == i
            ]
            pos = w.lo
            for lo, hi in sorted(got):
                assert lo == pos, (rank, i, w, sorted(got))
                pos = hi
            assert pos == max(w.lo, w.hi), (rank, i, w, sorted(got))
    sent = sorted(
        (t.tag, r, t.peer, t.file, t.lo, t.hi) for r, s in enumerate(shares) for t in s.sends
    )
    got = sorted(
        (t.tag, t.peer, r, t.file, t.lo, t.hi) for r, s in enumerate(shares) for t in s.receives
    )
    assert sent == got
    for p in pieces:
        assert p.reader in {r for r, _ in p.takers}, p
    return [sum(o.hi - o.lo for o in s.reads) for s in shares]


def test_replicas_each_read_a_quarter():
    plan = [Want("a", lo, lo + 64 * MIB, 0, MIB) for lo in range(0, 512 * MIB, 64 * MIB)]
    assert _check([plan] * 4) == [128 * MIB] * 4


def test_replica_groups_split_each_shard_between_its_replicas():
    first = [Want("a", 0, 100 * MIB, 0, MIB)]
    second = [Want("a", 100 * MIB, 200 * MIB, 0, MIB)]
    assert _check([first, second, first, second]) == [50 * MIB] * 4


def test_a_record_smaller_than_a_block_is_read_whole_by_one_rank():
    plan = [Want("a", 10, 1000, 10, MIB)]
    assert sorted(_check([plan] * 4)) == [0, 0, 0, 990]


def test_bytes_no_one_shares_are_read_by_the_rank_that_wants_them():
    assert _check([[Want("a", 0, 100, 0, 0)], [Want("b", 0, 50, 0, 0)]]) == [100, 50]


def test_random_overlapping_plans_reach_every_rank_once():
    rng = random.Random(56)
    for _ in range(500):
        wants = []
        for _ in range(rng.randint(1, 5)):
            own = []
            for _ in range(rng.randint(0, 6)):
                lo = rng.randint(0, 1000)
                own.append(
                    Want(rng.choice("ab"), lo, lo + rng.randint(0, 300), 0, rng.choice([0, 64]))
                )
            wants.append(own)
        read = _check(wants)
        wanted = {(w.file, b) for own in wants for w in own for b in range(w.lo, w.hi)}
        assert sum(read) == len(wanted)  # each wanted byte read once, by someone
