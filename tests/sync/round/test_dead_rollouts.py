"""A process that dies is noticed within seconds by every party waiting on it, whatever the
group's timeout (120 s here): a rollout SIGKILLed mid-receive fails the trainer's publish and
the surviving rollout's receive by liveness (a silence period and a look, bounded here with
a 2x margin, far below the timeout), both naming the dead rank; the surviving
rollout, receiving atomically, holds one whole version, never a mix; the next publish goes
on for it alone. A rollout that did not ask in time makes one publish time out, and the
channel recovers without rebuilding anything."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from sync_procs import held_version as held
from sync_procs import long_transfer as weights
from sync_procs import remote_reads_allowed, spawn, zeros_module
from torch import nn

import slipstream as ss
from slipstream.errors import MissingRanksError, PeerDiedError
from slipstream.sync.group import SILENT_AFTER_SECONDS

BUCKET = 64 * 1024
SEPARATE = 4096
TRANSPORTS = ["relay", "broadcast", "shm", "ipc", *(["cma"] if remote_reads_allowed() else [])]
NOTICED_WITHIN = 2 * (SILENT_AFTER_SECONDS + 1.0)
"""What noticing a death needs (the silence that marks a rank dead, and one look), twice."""


def holder() -> nn.Module:
    return zeros_module(weights(0))


def held_version(m: nn.Module) -> int | None:
    return held(m, weights, 3)


def _died_at(group) -> float:
    return group.get_json("test/died_at", 0, "the dying rollout's time of death", 30)


def _receive_atomically(sub, target, via):
    """Version 2 into ``target`` atomically through ``via``: ``receive``, or copying what
    ``receive_iter`` / ``areceive_iter`` yield (counted in ``target.items_seen``)."""
    if via == "receive":
        return sub.receive(target, atomic=True)

    def keep(name, t):
        target.get_buffer(name).copy_(t)
        target.items_seen += 1

    if via == "receive_iter":
        for name, t in sub.receive_iter(atomic=True):
            keep(name, t)
    else:

        async def pull():
            async for name, t in sub.areceive_iter(atomic=True):
                keep(name, t)

        asyncio.run(pull())
    return sub.version


def _killed_mid_receive(rank, port, transport, mode, dying, via, separate):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=120)
    survivor = 3 - dying
    if rank == 0:
        pub = ss.WeightPublisher(
            group,
            [0],
            [1, 2],
            bucket_bytes=BUCKET,
            mode=mode,
            transport=transport,
            separate_min_bytes=separate,
        )
        assert pub.publish(weights(1), version=1).delivered.result(timeout=30) == 1
        with pytest.raises(PeerDiedError) as err:
            pub.publish(weights(2), version=2).delivered.result(timeout=60)
        noticed = time.time() - _died_at(group)
        assert err.value.ranks == [dying], str(err.value)
        assert str(err.value).startswith(f"rank(s) [{dying}] died"), str(err.value)
        handle = pub.publish(weights(3), version=3)  # goes on for the survivor alone
        assert handle.delivered.result(timeout=30) == 3
        assert list(handle.absent) == [dying]
        assert pub.rollout_versions[survivor] == 3
        pub.close()
        group.close()
        return noticed
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = holder()
    assert sub.receive(target, atomic=True) == 1
    if rank == dying:

        def die(batch):  # the transfer of version 2 is under way
            group.set_json("test/died_at", time.time())
            os.kill(os.getpid(), signal.SIGKILL)

        sub.receive(die)
    out = {}
    target.items_seen = 0
    try:
        out["received"] = _receive_atomically(sub, target, via)
    except PeerDiedError as exc:
        out["noticed"] = time.time() - _died_at(group)
        out["ranks"] = exc.ranks
        out["version"] = sub.version
        out["items_seen"] = target.items_seen  # atomic: the break comes before any item
    out["holds"] = held_version(target)  # never a mix, whatever happened
    assert sub.receive(target, atomic=True) == 3
    out["then"] = held_version(target)
    sub.close()
    group.close()
    return out


#: (transport, mode, dying rollout, how the survivor receives, separate_min_bytes): both
#: rollouts dying in direct mode, the tail (the end of a relay) in cached mode, the survivor
#: pulling with receive_iter in cached mode, and, over relay, a case with the default
#: separate_min (nothing sent on its own) and the survivor pulling from asyncio.
CASES = [
    *[(t, "direct", d, "receive", SEPARATE) for t in TRANSPORTS for d in (1, 2)],
    *[(t, "cached", 2, "receive_iter", SEPARATE) for t in TRANSPORTS],
    ("relay", "direct", 2, "areceive_iter", "auto"),
]


@pytest.mark.parametrize(("transport", "mode", "dying", "via", "separate"), CASES)
def test_a_rollout_killed_mid_receive_is_noticed_within_seconds_by_everyone(
    transport, mode, dying, via, separate
):
    out = spawn(
        _killed_mid_receive,
        3,
        transport,
        mode,
        dying,
        via,
        separate,
        timeout=90,
        may_die=(dying,),
    )
    assert out[0] < NOTICED_WITHIN, out[0]
    survivor = out[3 - dying]
    if "received" in survivor:  # it had every byte of version 2 before the other died
        assert survivor["received"] == 2 and survivor["holds"] == 2, survivor
    else:
        assert survivor["noticed"] < NOTICED_WITHIN, survivor
        assert survivor["ranks"] == [dying], survivor
        assert survivor["version"] == 1 and survivor["holds"] == 1, survivor  # atomic
        assert survivor["items_seen"] == 0, survivor
    assert survivor["then"] == 3


def _late_rollout(rank, port, transport):
    """Rollout 1 asks for version 1 only after the trainer gave up on it (publisher timeout
    2 s, group timeout 120 s): that publish fails naming it; the next one reaches it."""
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=120)
    if rank == 0:
        pub = ss.WeightPublisher(
            group, [0], [1], bucket_bytes=BUCKET, transport=transport, timeout=2
        )
        started = time.monotonic()
        with pytest.raises(MissingRanksError) as err:
            pub.publish(weights(1), version=1).delivered.result(timeout=30)
        waited = time.monotonic() - started
        assert err.value.ranks == [1] and not isinstance(err.value, PeerDiedError)
        group.set_json("test/gave-up", True)
        assert pub.publish(weights(2), version=2).delivered.result(timeout=30) == 2
        pub.close()
        group.close()
        return waited
    sub = ss.WeightSubscriber(group, [0], [1])
    group.get_json("test/gave-up", 0, "the trainer to give up", 30)
    target = holder()
    version = sub.receive(target)
    ok = held_version(target) == version
    sub.close()
    group.close()
    return version, ok


@pytest.mark.parametrize("transport", ["broadcast", "shm"])
def test_a_channel_that_timed_out_recovers_without_rebuilding_anything(transport):
    out = spawn(_late_rollout, 2, transport, timeout=60)
    assert 2 <= out[0] < 5
    assert out[1] == (2, True)


def test_a_rank_that_never_joins_is_named_and_no_heartbeat_is_left_running():
    import threading

    from dist_utils import free_port

    started = time.monotonic()
    with pytest.raises(MissingRanksError) as err:
        ss.sync.init_group("127.0.0.1", free_port(), 3, 0, timeout=1.0)
    assert 1.0 <= time.monotonic() - started < 4
    assert err.value.ranks == [1, 2] and "every rank to join" in str(err.value)
    assert not isinstance(err.value, PeerDiedError)  # never joined: not judged dead
    assert not [t for t in threading.enumerate() if t.name == "slipstream-heartbeat"]


def _target_fails(rank, port, transport):
    """Rollout 2's target raises mid-receive of version 2: rollout 2 gets its own error, not
    a dead rank; the trainer's publish fails naming rollout 2; version 3 reaches everyone."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=120)
    if rank == 0:
        pub = ss.WeightPublisher(
            group,
            [0],
            [1, 2],
            bucket_bytes=BUCKET,
            transport=transport,
            separate_min_bytes=SEPARATE,
        )
        assert pub.publish(weights(1), version=1).delivered.result(timeout=30) == 1
        try:  # direct: the break may come while publish() still sends
            error = pub.publish(weights(2), version=2).delivered.exception(timeout=60)
        except ss.SyncError as exc:
            error = exc
        assert isinstance(error, ss.SyncError) and not isinstance(error, PeerDiedError)
        assert "rollout rank 2: the engine refused the weights" in str(error), str(error)
        assert pub.publish(weights(3), version=3).delivered.result(timeout=30) == 3
        assert pub.rollout_versions == {1: 3, 2: 3}
        pub.close()
        group.close()
        return None
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = holder()
    assert sub.receive(target, atomic=True) == 1
    out = {}
    if rank == 2:

        def fails(batch):
            raise ValueError("the engine refused the weights")

        with pytest.raises(ValueError, match="the engine refused"):
            sub.receive(fails)
    else:
        try:
            out["second"] = sub.receive(target, atomic=True)
        except ss.SyncError:
            out["second"] = sub.version
    assert sub.receive(target, atomic=True, full=True) == 3
    out["then"] = held_version(target)
    sub.close()
    group.close()
    return out


@pytest.mark.parametrize("transport", ["relay", "shm"])
def test_a_target_that_fails_mid_receive_raises_its_own_error_and_the_next_publish_reaches_all(
    transport,
):
    out = spawn(_target_fails, 3, transport, timeout=90)
    assert out[1]["second"] in (1, 2) and out[1]["then"] == 3
    assert out[2] == {"then": 3}
