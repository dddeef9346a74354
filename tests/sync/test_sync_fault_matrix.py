"""Every transport and mode names a dead rollout within seconds, wherever it sits in a
relay chain (issue 47).

One run per (transport, mode) reuses its five processes (trainer 0, rollouts 1-4, chained
in that order over relay) for three deaths: the tail (4) during version 2, then the middle
(2) during version 4, then the head (1) during version 6, each SIGKILLed inside its third
``load_weights`` call of that version (mid-transfer). The survivors receive atomically.
After each death the trainer's publish and every survivor whose receive broke must fail
with :class:`~slipstream.errors.PeerDiedError` naming exactly the dead rank, measured from
the moment the victim posted its time of death; the next version then reaches every
survivor. The group's timeout is 60 s, so a death noticed only by a timeout shows.

The bound asserted is :data:`NAMED_WITHIN`, the issue's 5 s, measured from the victim's
recorded time of death; the measured times are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from sync_procs import held_version as held
from sync_procs import long_transfer as weights
from sync_procs import remote_reads_allowed, spawn, zeros_module
from torch import nn

import slipstream as ss
from slipstream.errors import PeerDiedError

BUCKET = 64 * 1024
SEPARATE = 4096
GROUP_TIMEOUT = 60.0
NAMED_WITHIN = 5.0
TRANSPORTS = ["relay", "broadcast", "shm", "ipc", *(["cma"] if remote_reads_allowed() else [])]
ROLLOUTS = [1, 2, 3, 4]
#: version -> the rollout killed during it (tail, middle, head of the relay chain)
DEATHS = {2: 4, 4: 2, 6: 1}
LAST = 7
DIES_AT_CALL = 3
#: How long the victim's forked child outlives it: past :data:`NAMED_WITHIN`, so a death
#: noticed only once the child lets go of the victim's sockets fails the bound.
CHILD_OUTLIVES = NAMED_WITHIN + 5.0


def holder() -> nn.Module:
    return zeros_module(weights(0))


def held_version(m: nn.Module) -> int | None:
    return held(m, weights, LAST)


def _since_death(group, version: int) -> float:
    died = group.get_json(f"test/died_at/{version}", 0, "the victim's time of death", 30)
    return time.time() - died


def _trainer(group, mode, transport):
    pub = ss.WeightPublisher(
        group,
        [0],
        ROLLOUTS,
        bucket_bytes=BUCKET,
        mode=mode,
        transport=transport,
        separate_min_bytes=SEPARATE,
    )
    named = {}
    for version in range(1, LAST + 1):
        victim = DEATHS.get(version)
        if victim is None:
            handle = pub.publish(weights(version), version=version)
            assert handle.delivered.result(timeout=GROUP_TIMEOUT) == version
            continue
        try:  # direct: the break may come while publish() still sends
            pub.publish(weights(version), version=version).delivered.result(
                timeout=2 * GROUP_TIMEOUT
            )
            error: BaseException | None = None
        except PeerDiedError as exc:
            error = exc
        took = _since_death(group, version)
        assert isinstance(error, PeerDiedError), f"version {version}: {error!r}"
        assert error.ranks == [victim], str(error)
        named[version] = took
    pub.close()
    survivors = {}  # what each survivor of each death posted
    for version in DEATHS:
        for r in _alive_during(version):
            key = f"test/outcome/{version}/{r}"
            survivors[(version, r)] = group.get_json(key, r, "a survivor's outcome", 30)
    group.close()
    return named, survivors


def _alive_during(version: int) -> list[int]:
    """The rollouts alive when ``version`` is published, less its victim."""
    gone = {r for v, r in DEATHS.items() if v <= version}
    return [r for r in ROLLOUTS if r not in gone]


def _rollout(group, rank):
    sub = ss.WeightSubscriber(group, [0], ROLLOUTS)
    target = holder()
    out: dict[int, object] = {}
    for version in range(1, LAST + 1):
        if DEATHS.get(version) == rank:
            calls = [0]

            def die(batch, version=version, calls=calls):
                calls[0] += 1
                if calls[0] == DIES_AT_CALL:
                    group.set_json(f"test/died_at/{version}", time.time())
                    os.kill(os.getpid(), signal.SIGKILL)

            sub.receive(die)
            raise AssertionError("the victim outlived its receive")
        try:
            got = sub.receive(target, atomic=True)
            out[version] = ["received", got, held_version(target)]
        except PeerDiedError as exc:
            took = _since_death(group, version)
            out[version] = ["named", exc.ranks, held_version(target), took]
        if version in DEATHS:
            group.set_json(f"test/outcome/{version}/{rank}", out[version])
    sub.close()
    group.close()
    return out


def _run(rank, port, transport, mode):
    group = ss.sync.init_group("127.0.0.1", port, 5, rank, timeout=GROUP_TIMEOUT)
    if rank == 0:
        return _trainer(group, mode, transport)
    return _rollout(group, rank)


@pytest.mark.parametrize("mode", ["direct", "cached"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_rollout_is_named_within_seconds_by_the_trainer_and_every_survivor(transport, mode):
    started = time.monotonic()
    out = spawn(_run, 5, transport, mode, timeout=200, may_die=tuple(DEATHS.values()))
    named, survivors = out[0]
    times = {f"trainer v{v}": t for v, t in named.items()}
    times.update({f"rollout {r} v{v}": o[3] for (v, r), o in survivors.items() if o[0] == "named"})
    print(f"\n{transport}/{mode}: " + ", ".join(f"{k} {t:.2f} s" for k, t in times.items()))
    print(f"{transport}/{mode}: run took {time.monotonic() - started:.1f} s")
    assert set(named) == set(DEATHS), named
    for (version, r), outcome in survivors.items():
        if outcome[0] == "received":  # it had every byte before the victim died
            assert outcome[1:] == [version, version], (r, version, outcome)
        else:
            _, ranks, holds, _took = outcome
            assert ranks == [DEATHS[version]], (r, version, outcome)
            assert holds == version - 1, (r, version, outcome)  # atomic: left as it was
    slow = {k: t for k, t in times.items() if t >= NAMED_WITHIN}
    assert not slow, slow
    assert out[3][LAST] == ["received", LAST, LAST]
    assert [r for r in ROLLOUTS if r in out] == [3]


def _forked_then_killed(rank, port, transport):
    """The reported shape (direct mode, two rollouts): rollout 2 (the relay's tail) forks a
    child that outlives it (as an engine starting
    its workers does) and is SIGKILLed inside its third ``load_weights`` of version 2; the
    child holds every descriptor it inherited. Rollout 1 receives atomically."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=GROUP_TIMEOUT)
    if rank == 0:
        pub = ss.WeightPublisher(
            group,
            [0],
            [1, 2],
            bucket_bytes=BUCKET,
            transport=transport,
            separate_min_bytes=SEPARATE,
        )
        assert pub.publish(weights(1), version=1).delivered.result(timeout=GROUP_TIMEOUT) == 1
        try:
            pub.publish(weights(2), version=2).delivered.result(timeout=2 * GROUP_TIMEOUT)
            error: BaseException | None = None
        except PeerDiedError as exc:
            error = exc
        took = _since_death(group, 2)
        assert isinstance(error, PeerDiedError) and error.ranks == [2], repr(error)
        assert pub.publish(weights(3), version=3).delivered.result(timeout=GROUP_TIMEOUT) == 3
        pub.close()
        group.close()
        return took
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = holder()
    assert sub.receive(target, atomic=True) == 1
    if rank == 2:
        parent = os.getpid()
        if os.fork() == 0:  # the child: lives while its parent does, then a while more
            _keep_only_sockets()  # no pipe of the runner's: its reader would wait for it
            while os.getppid() == parent:
                time.sleep(0.05)
            time.sleep(CHILD_OUTLIVES)  # holding what it inherited, as a worker would
            os._exit(0)
        calls = [0]

        def die(batch):
            calls[0] += 1
            if calls[0] == DIES_AT_CALL:
                group.set_json("test/died_at/2", time.time())
                os.kill(os.getpid(), signal.SIGKILL)

        sub.receive(die)
        raise AssertionError("the victim outlived its receive")
    try:
        out = ["received", sub.receive(target, atomic=True)]
    except PeerDiedError as exc:
        out = ["named", exc.ranks, held_version(target), _since_death(group, 2)]
    assert sub.receive(target, atomic=True) == 3
    sub.close()
    group.close()
    return out


def _keep_only_sockets() -> None:
    """Close every inherited descriptor but the sockets (what the test is about)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                os.close(int(name))
        except OSError:
            continue


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rollout_killed_while_a_forked_child_holds_its_sockets_is_named_within_seconds(
    transport,
):
    out = spawn(_forked_then_killed, 3, transport, timeout=200, may_die=(2,))
    print(f"\n{transport}, forked child: trainer {out[0]:.2f} s, rollout 1 {out[1]}")
    assert out[0] < NAMED_WITHIN, out[0]
    if out[1][0] == "named":
        assert out[1][1] == [2] and out[1][2] == 1, out[1]
        assert out[1][3] < NAMED_WITHIN, out[1]
    else:
        assert out[1] == ["received", 2], out[1]


TAIL_TENSORS = 64
TAIL_ELEMENTS = 1 << 20  # 4 MiB of fp32 each: 256 MiB in all
TAIL_BUCKET = 16 * 1024 * 1024


def _large(version: int) -> dict:
    import torch

    return {f"t{i}": torch.full((TAIL_ELEMENTS,), float(version)) for i in range(TAIL_TENSORS)}


def _tail_dies(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=GROUP_TIMEOUT)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1, 2], bucket_bytes=TAIL_BUCKET, transport="relay")
        assert pub.publish(_large(1), version=1).delivered.result(timeout=GROUP_TIMEOUT) == 1
        with pytest.raises(PeerDiedError) as err:
            pub.publish(_large(2), version=2).delivered.result(timeout=2 * GROUP_TIMEOUT)
        took = _since_death(group, 2)
        pub.close()
        group.close()
        return err.value.ranks, took
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = zeros_module(_large(0))
    assert sub.receive(target) == 1
    if rank == 2:
        calls = [0]

        def die(batch):
            calls[0] += 1
            if calls[0] == DIES_AT_CALL:
                group.set_json("test/died_at/2", time.time())
                os.kill(os.getpid(), signal.SIGKILL)

        sub.receive(die)
        raise AssertionError("the victim outlived its receive")
    with pytest.raises(PeerDiedError) as err:
        sub.receive(target, atomic=True)
    took = _since_death(group, 2)
    sub.close()
    group.close()
    return err.value.ranks, took


def test_the_dead_tail_of_a_relay_chain_of_large_buckets_is_named_within_seconds():
    """The shape the matrix missed: 256 MiB in 4 MiB tensors and 16 MiB buckets (each tensor
    crosses alone), direct mode, the survivor receiving atomically."""
    out = spawn(_tail_dies, 3, timeout=200, may_die=(2,))
    times = f"trainer {out[0][1]:.2f} s, rollout 1 {out[1][1]:.2f} s"
    print(f"\nrelay, large buckets, tail killed: {times}")
    for rank in (0, 1):
        ranks, took = out[rank]
        assert ranks == [2] and took < NAMED_WITHIN, (rank, out[rank])
