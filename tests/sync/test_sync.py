"""Weight sync: trainers publish, rollouts receive, over a sync group of their own.

Every multi-process test spawns fresh processes that join only the sync group (no default
process group, except the trainers of the DTensor test, which need one for their mesh).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from dist_utils import wait_for_key
from sync_procs import remote_reads_allowed, spawn
from torch import nn

import slipstream as ss
from slipstream.errors import PeerTimeoutError, SyncError

BUCKET = 64 * 1024
# slices of 4 KiB and up cross a relay or broadcast on their own: both paths run in every
# delivery test
SEPARATE = 4096
DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float16, torch.uint8]
# sizes in elements: empty, scalar-like, odd, around and well above a 64 KiB bucket
SIZES = [0, 1, 7, 1000, 16 * 1024, 40_000, 100_003]
# whether rollouts may read a trainer's memory here (transport "cma")
REMOTE_READS = remote_reads_allowed()


def weights(version: int, changed_every: int = 1) -> dict[str, torch.Tensor]:
    """Deterministic weights; from version 2 on only every ``changed_every``-th tensor moves."""
    out = {}
    i = 0
    for size in SIZES:
        for dtype in DTYPES:
            name = f"layer{i}.{str(dtype)[6:]}"
            moved = version if i % changed_every == 0 else 1
            g = torch.Generator().manual_seed(1000 * i + moved)
            if dtype == torch.bool:
                t = torch.rand(size, generator=g) > 0.5
            elif dtype.is_floating_point:
                t = torch.randn(size, generator=g).to(dtype)
            else:
                t = torch.randint(0, 200, (size,), generator=g).to(dtype)
            out[name] = t.reshape(size, 1) if i % 3 == 0 else t
            i += 1
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.contiguous().view(-1).view(torch.uint8).numpy())
        == bytes(b.contiguous().view(-1).view(torch.uint8).numpy())
    )


class Holder(nn.Module):
    """A module whose buffers mirror the published tensors, under ``model.`` names."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model = nn.Module()
        for name, t in named.items():
            self.model.register_buffer(name.replace(".", "_"), torch.zeros_like(t))


def module_name(name: str) -> str:
    return "model." + name.replace(".", "_")


def record_store_writes(group) -> list[str]:
    """Wrap ``group.post`` (how every protocol message is written) so every key written
    through it is listed."""
    written: list[str] = []
    post = group.post

    def recording(key: str, text: str) -> None:
        written.append(key)
        post(key, text)

    group.post = recording
    return written


def test_a_process_that_exited_counts_as_gone_even_before_it_is_reaped():
    from slipstream.sync.group import process_alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_alive(child.pid)
    finally:
        child.kill()
    deadline = time.monotonic() + 5
    while process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not process_alive(child.pid)  # a zombie: killed, not yet reaped
    with open(f"/proc/{child.pid}/stat") as f:
        assert f.read().rpartition(")")[2].split()[0] == "Z"
    child.wait()
    assert not process_alive(child.pid)
    assert process_alive(os.getpid())


# --------------------------------------------------------------------------- delivery
TRANSPORTS = ["relay", "broadcast", "shm", "ipc", *(["cma"] if REMOTE_READS else [])]
CONFIGS = [(mode, transport) for transport in TRANSPORTS for mode in ("direct", "cached")]


def _delivery(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=30)
    report = {}
    for mode, transport in CONFIGS:
        channel = f"{mode}-{transport}"
        if rank == 0:
            pub = ss.WeightPublisher(
                group,
                [0],
                [1, 2],
                bucket_bytes=BUCKET,
                mode=mode,
                transport=transport,
                channel=channel,
                separate_min_bytes=SEPARATE,
            )
            assert pub.transport == transport
            written = record_store_writes(pub.group)
            sent = []
            with pub:
                for version in (1, 2, 3):
                    before = pub.bytes_sent
                    h = pub.publish(weights(min(version, 2), changed_every=3), version=version)
                    assert h.staged.done()
                    assert h.delivered.result(timeout=20) == version
                    sent.append(pub.bytes_sent - before)
                    assert h.timings.nbytes == sent[-1]
                    assert 0 < h.timings.staged <= h.timings.delivered
                    assert pub.rollout_versions == {1: version, 2: version}
            # the layout crossed the store once; later publishes only name the plan
            assert len([k for k in written if k.startswith("plan/")]) == 1, written
            assert len([k for k in written if re.fullmatch(r"round/\d+", k)]) == 3, written
            report[channel] = sent
        else:
            sub = ss.WeightSubscriber(group, [0], [1, 2], channel=channel)
            with sub:
                if rank == 1:
                    target = Holder(weights(1))
                    for version in (1, 2, 3):
                        assert sub.receive(target, name_map=module_name) == version
                        want = weights(min(version, 2), changed_every=3)
                        for name, t in want.items():
                            got = target.get_buffer(module_name(name))
                            assert same_bytes(got, t), (channel, version, name)
                else:
                    held: dict[str, torch.Tensor] = {}
                    calls: list[int] = []

                    def load_weights(batch, held=held, calls=calls):
                        calls.append(len(batch))
                        for name, t in batch:
                            held[name] = t.clone()

                    for version in (1, 2, 3):
                        calls.clear()
                        assert sub.receive(load_weights) == version
                        assert sub.version == version and sub.complete
                        want = weights(min(version, 2), changed_every=3)
                        assert held.keys() == want.keys()
                        for name, t in want.items():
                            assert same_bytes(held[name], t), (channel, version, name)
                        if version == 3:
                            assert calls == []  # nothing changed: nothing resent, nothing loaded
                        else:
                            assert len(calls) > 1  # several calls per version, whole tensors
    group.close()
    return report


def test_bit_exact_delivery_in_both_modes_and_transports_with_unchanged_tensors_skipped():
    report = spawn(_delivery, 3, timeout=90)[0]
    total = sum(t.numel() * t.element_size() for t in weights(1).values())
    for channel, (first, second, third) in report.items():
        assert first >= total, channel  # first publish: every byte
        assert 0 < second < total / 2, channel  # a third of the tensors changed
        assert third == 0, channel  # nothing changed


# --------------------------------------------------------------------------- asking again
def _refetch_run(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=30)
    total = sum(t.numel() * t.element_size() for t in weights(1).values())
    for transport in TRANSPORTS:
        channel = f"again-{transport}"
        atomic = transport == "shm"
        if rank == 0:
            with ss.WeightPublisher(
                group,
                [0],
                [1, 2],
                bucket_bytes=BUCKET,
                mode="cached",
                transport=transport,
                channel=channel,
                separate_min_bytes=SEPARATE,
            ) as pub:
                live = weights(1)
                pub.publish(live, version=1).delivered.result(timeout=20)
                for t in live.values():
                    t.zero_()  # training goes on: only the cache still holds version 1
                group.wait_keys({1: f"test/{channel}/refetched"}, "rollout 1's refetch", 20)
                assert pub.rollout_versions == {1: 1, 2: 1}
                before = pub.bytes_sent
                pub.publish(weights(2, changed_every=3), version=2).delivered.result(timeout=20)
                if (
                    not atomic
                ):  # rollout 1 is known to hold version 1 again: nothing unchanged resent
                    assert 0 < pub.bytes_sent - before < total / 2
            continue
        with ss.WeightSubscriber(group, [0], [1, 2], channel=channel) as sub:
            target = Holder(weights(1))
            assert sub.receive(target, name_map=module_name) == 1
            if rank == 1:
                held: dict[str, torch.Tensor] = {}  # whole tensors handed over, not in place
                sub.refetch(lambda batch, held=held: held.update((n, t.clone()) for n, t in batch))
                for name, t in weights(1).items():
                    assert same_bytes(held[name], t), (channel, name)
                for b in target.buffers():
                    b.zero_()  # the engine lost its weights
                assert sub.refetch(target, name_map=module_name, atomic=atomic) == 1
                assert sub.version == 1 and sub.complete
                for name, t in weights(1).items():
                    assert same_bytes(target.get_buffer(module_name(name)), t), (channel, name)
                group.set_json(f"test/{channel}/refetched", True)
            assert sub.receive(target, name_map=module_name) == 2
            for name, t in weights(2, changed_every=3).items():
                assert same_bytes(target.get_buffer(module_name(name)), t), (channel, name)
    _refetch_refused(group, rank)
    group.close()


def _refetch_refused(group, rank):
    """A direct-mode trainer keeps no copy: the refetch fails clearly and applies nothing."""
    named = {"w": torch.arange(10, dtype=torch.float32)}
    if rank == 0:
        with ss.WeightPublisher(group, [0], [1, 2], channel="again-direct") as pub:
            pub.publish(named, version=3).delivered.result(timeout=20)
            group.wait_keys({1: "test/again-direct/refused"}, "rollout 1's refetch", 20)
        return
    target = nn.Module()
    target.register_buffer("w", torch.zeros(10))
    with ss.WeightSubscriber(group, [0], [1, 2], channel="again-direct") as sub:
        assert sub.receive(target) == 3
        if rank == 1:
            target.w.fill_(-1.0)
            with pytest.raises(SyncError, match=r"trainer rank\(s\) \[0\] publish in direct mode"):
                sub.refetch(target)
            assert torch.equal(target.w, torch.full((10,), -1.0)) and sub.version == 3
            group.set_json("test/again-direct/refused", True)


def test_refetch_serves_the_cached_version_again_without_a_publish_and_refuses_in_direct_mode():
    spawn(_refetch_run, 3, timeout=90)


# --------------------------------------------------------------------------- two trainers
def _dtensor_run(rank, port, mesh_port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    group = ss.sync.init_group("127.0.0.1", port, 4, rank, timeout=30)
    base = {
        f"w{i}": torch.randn(64 * (i % 4 + 1), 33, generator=torch.Generator().manual_seed(i))
        for i in range(24)
    }
    base["bias"] = torch.arange(10, dtype=torch.float32)
    out = {}
    for mode, transport in (("direct", "relay"), ("cached", TRANSPORTS[-1])):
        channel = f"two-{mode}"
        if rank in (0, 1):
            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group(
                    "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=2
                )
            mesh = init_device_mesh("cpu", (2,))
            named = {
                n: (distribute_tensor(t, mesh, [Shard(0)]) if n != "bias" else t)
                for n, t in base.items()
            }
            with ss.WeightPublisher(
                group,
                [0, 1],
                [2, 3],
                bucket_bytes=BUCKET,
                mode=mode,
                transport=transport,
                channel=channel,
                separate_min_bytes=SEPARATE,
            ) as pub:
                pub.publish(named, version=7).delivered.result(timeout=20)
                sent_by_shard = (pub.bytes_sent, pub.peak_gathered_bytes)
                if mode == "cached":  # serve the rollouts' refetches from both caches
                    keys = {r: f"test/{channel}/refetched/{r}" for r in (2, 3)}
                    group.wait_keys(keys, "the rollouts' refetches", 20)
                doubled = (  # streamed: each DTensor made, then gathered, as it is yielded
                    (n, distribute_tensor(t * 2, mesh, [Shard(0)]) if n != "bias" else t * 2)
                    for n, t in base.items()
                )
                pub.publish(doubled, version=8).delivered.result(timeout=20)
                out[mode] = (*sent_by_shard, pub.peak_gathered_bytes)
        else:
            target = nn.Module()
            for n, t in base.items():
                target.register_buffer(n, torch.zeros_like(t))
            with ss.WeightSubscriber(group, [0, 1], [2, 3], channel=channel) as sub:
                assert sub.receive(target) == 7
                for n, t in base.items():
                    assert same_bytes(target.get_buffer(n), t), (mode, n)
                if mode == "cached":
                    for b in target.buffers():
                        b.zero_()
                    assert sub.refetch(target) == 7  # each trainer sends the buckets it owns
                    group.set_json(f"test/{channel}/refetched/{rank}", True)
                    for n, t in base.items():
                        assert same_bytes(target.get_buffer(n), t), (mode, n)
                assert sub.receive(target) == 8
            for n, t in base.items():
                assert same_bytes(target.get_buffer(n), t * 2), (mode, n)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    group.close()
    return out


def test_two_trainers_send_dtensors_by_shard_and_gather_streamed_ones_bucket_by_bucket():
    from dist_utils import free_port

    out = spawn(_dtensor_run, 4, free_port(), timeout=90)
    sizes = [64 * (i % 4 + 1) * 33 * 4 for i in range(24)]
    dtensor_bytes = sum(sizes)
    total = dtensor_bytes + 40
    for mode in ("direct", "cached"):
        sent0, mapped0, streamed0 = out[0][mode]
        sent1, mapped1, streamed1 = out[1][mode]
        assert sent0 > 0 and sent1 > 0 and sent0 + sent1 == total  # each sends its own shards
        assert mapped0 == mapped1 == 0  # nothing gathered: every byte came from a local shard
        # DTensors yielded by a generator are gathered as they come, bucket by bucket
        assert 0 < max(streamed0, streamed1) <= BUCKET + 2 * max(sizes) < dtensor_bytes / 2


# --------------------------------------------------------------------------- versions, cache
def _versions_run(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=30)
    _versions(group, rank)
    _mismatch(group, rank)
    group.close()


def _versions(group, rank):
    if rank == 0:
        live = {"w": torch.full((1000,), 1.0), "b": torch.zeros(3)}
        with ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, mode="cached") as pub:
            h = pub.publish(live, version=1)
            h.staged.result(timeout=5)
            live["w"].fill_(99.0)  # the rollout asks later: served from the snapshot
            assert h.delivered.result(timeout=20) == 1
            with pytest.raises(ValueError, match="versions must increase"):
                pub.publish(live, version=1)
            pub.publish(live, version=5)
            h6 = pub.publish(live, version=6)  # waits until the rollout holds 5
            assert pub.rollout_versions[1] == 5
            h6.delivered.result(timeout=20)
            assert pub.rollout_versions == {1: 6} and pub.staleness() == {1: 0}
        return
    target = nn.Module()
    target.register_buffer("w", torch.zeros(1000))
    target.register_buffer("b", torch.ones(3))
    with ss.WeightSubscriber(group, [0], [1]) as sub:
        assert sub.version is None
        time.sleep(1.0)  # joins late
        assert sub.receive(target) == 1
        assert torch.equal(target.w, torch.full((1000,), 1.0)) and sub.version == 1
        seen = []
        for _ in range(2):
            seen.append(sub.receive(target))
            time.sleep(0.3)  # still "applying" when the next publish arrives
        assert seen == [5, 6] and torch.equal(target.w, torch.full((1000,), 99.0))


def test_versions_late_rollout_from_cache_staleness_and_mismatches_rejected_before_any_byte():
    spawn(_versions_run, 2, timeout=60)


# --------------------------------------------------------------------------- bad input
def _mismatch(group, rank):
    named = {
        "a": torch.ones(4, 4),
        "b": torch.ones(8, dtype=torch.bfloat16),
        "c": torch.ones(3),
        "d": torch.ones(2),
    }
    if rank == 0:
        with ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, channel="bad") as pub:
            h = pub.publish(named, version=1)
            with pytest.raises(SyncError, match="rollout rank 1"):
                h.delivered.result(timeout=20)
            pub.publish(named, version=2).delivered.result(timeout=20)
        return None
    target = nn.Module()
    target.register_buffer("a", torch.zeros(4, 5))  # shape
    target.register_buffer("b", torch.zeros(8))  # dtype
    target.register_buffer("d", torch.zeros(2))  # fine, must stay untouched too
    before = {n: t.clone() for n, t in target.named_buffers()}
    with ss.WeightSubscriber(group, [0], [1], channel="bad") as sub:
        with pytest.raises(SyncError) as err:
            sub.receive(target)
        message = str(err.value)
        for name in ("'a: sent [4, 4], target [4, 5]'", "b: sent bfloat16", "'c'"):
            assert name in message, message
        for n, t in target.named_buffers():
            assert torch.equal(t, before[n]), n
        assert sub.version is None
        target.register_buffer("a", torch.zeros(4, 4))
        target.register_buffer("b", torch.zeros(8, dtype=torch.bfloat16))
        target.register_buffer("c", torch.zeros(3))
        assert sub.receive(target) == 2 and torch.equal(target.a, torch.ones(4, 4))


# --------------------------------------------------------------------------- failure
def _dies_mid_transfer(group, sub, transfer: str) -> int:
    """On a rollout: receive version 1 whole, then run ``sub.<transfer>`` (``receive`` or
    ``refetch``) into a callable that has the trainer killed once three batches landed. The
    transfer must raise within the group's 8 s timeout and leave no complete version.
    Returns how many batches landed."""
    calls = []
    armed = []

    def load_weights(batch):
        calls.append(batch[0][0])
        if armed and len(calls) == 3:  # the transfer is under way: kill the trainer
            group.store.set("die", "1")
            time.sleep(0.5)

    assert sub.receive(load_weights) == 1
    calls.clear()
    armed.append(True)
    start = time.monotonic()
    with pytest.raises((SyncError, PeerTimeoutError), match="rank 0|trainer") as err:
        getattr(sub, transfer)(load_weights)
    assert time.monotonic() - start < 2 * 8  # the group's timeout, twice
    assert sub.version is None and not sub.complete, (str(err.value), len(calls))
    group.close()
    return len(calls)


def _killed_run(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=8)
    named = {f"t{i}": torch.full((20_000,), float(i)) for i in range(40)}  # ~3 MiB, 49 buckets
    if rank == 0:
        pub = ss.WeightPublisher(
            group,
            [0],
            [1, 2],
            bucket_bytes=BUCKET,
            transport=transport,
            separate_min_bytes=SEPARATE,
        )
        pub.publish(named, version=1).delivered.result(timeout=20)

        def die():  # polls: a blocking wait would hold the store client the publisher uses
            wait_for_key(group.store, "die", 60, "the order to die mid-transfer")
            os._exit(3)

        threading.Thread(target=die, daemon=True).start()
        pub.publish({n: t + 1 for n, t in named.items()}, version=2)
        time.sleep(30)
        return None
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    if rank == 1:
        return _dies_mid_transfer(group, sub, "receive")
    target = nn.Module()
    for n, t in named.items():
        target.register_buffer(n, torch.zeros_like(t))
    assert sub.receive(target, atomic=True) == 1
    with pytest.raises((SyncError, PeerTimeoutError)):
        sub.receive(target, atomic=True)
    assert sub.version == 1  # atomic: the complete old version, untouched
    for n, t in named.items():
        assert torch.equal(target.get_buffer(n), t), n
    group.close()
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_trainer_killed_mid_publish_raises_and_never_reports_a_partial_version(transport):
    out = spawn(_killed_run, 3, transport, timeout=60, may_die=(0,))
    assert out[1] >= 3  # the trainer died after v2 had started landing


def _rollout_killed_run(rank, port, transport, dying=2):
    """Rollout ``dying`` exits once version 2 is under way; the trainer's publish and the
    other rollout's receive must fail within the 8 s timeout, the trainer's naming it.
    Returns the error each surviving rank saw."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=8)
    named = {f"t{i}": torch.full((20_000,), float(i)) for i in range(40)}  # ~3 MiB, 49 buckets
    if rank == 0:
        pub = ss.WeightPublisher(
            group, [0], [1, 2], bucket_bytes=BUCKET, transport=transport, mode="direct"
        )
        pub.publish(named, version=1).delivered.result(timeout=20)
        start = time.monotonic()
        with pytest.raises((SyncError, PeerTimeoutError)) as err:
            pub.publish({n: t + 1 for n, t in named.items()}, version=2).delivered.result(20)
        assert time.monotonic() - start < 2 * 8  # the group's timeout, twice
        # the other rollout may have given up and exited too by then
        named_dead = rf"rank\(s\) \[{dying}\] died"
        assert re.search(named_dead, str(err.value)), str(err.value)
        group.close()  # the store's host stays until the survivor has left
        return str(err.value)
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = nn.Module()
    for n, t in named.items():
        target.register_buffer(n, torch.zeros_like(t))
    assert sub.receive(target) == 1
    if rank == dying:

        def load_weights(batch):  # dies once the transfer of version 2 is under way
            os._exit(3)

        sub.receive(load_weights)
    start = time.monotonic()
    with pytest.raises((SyncError, PeerTimeoutError)) as err:
        sub.receive(target)
    assert time.monotonic() - start < 2 * 8  # the group's timeout, twice
    assert sub.version is None
    group.close()
    return str(err.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rollout_killed_mid_publish_fails_the_publish_naming_it(transport):
    out = spawn(_rollout_killed_run, 3, transport, timeout=60, may_die=(2,))
    assert out[0]


def test_a_relaying_rollout_that_dies_is_named_by_the_rollout_after_it():
    # rollout 1 is the first of the chain: it dies while it passes version 2 on to rollout 2
    out = spawn(_rollout_killed_run, 3, "relay", 1, timeout=60, may_die=(1,))
    assert "rank(s) [1] died" in out[2], out[2]


def _relayer_changes_its_weights_run(rank, port):
    """Rollout 1 passes a 32 MiB tensor (more than a loopback socket buffers) on to rollout
    2, which asks for it late; as soon as its receive returns, rollout 1 overwrites its
    copy. Rollout 2 must still get the trainer's bytes."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=20)
    named = {"big": torch.arange(8 * 2**20, dtype=torch.float32), "small": torch.ones(10)}
    if rank == 0:
        with ss.WeightPublisher(group, [0], [1, 2], transport="relay") as pub:
            pub.publish(named, version=1).delivered.result(timeout=20)
        group.close()
        return None
    target = nn.Module()
    for n, t in named.items():
        target.register_buffer(n, torch.zeros_like(t))
    with ss.WeightSubscriber(group, [0], [1, 2]) as sub:
        if rank == 2:
            time.sleep(0.5)  # rollout 1 has had every byte long before we ask
        assert sub.receive(target) == 1
        if rank == 1:
            for b in target.buffers():
                b.fill_(-1.0)
    group.close()
    return {n: same_bytes(target.get_buffer(n), t) for n, t in named.items()}


def test_a_relaying_rollout_may_change_its_weights_once_its_receive_returns():
    out = spawn(_relayer_changes_its_weights_run, 3, timeout=60)
    assert out[2] == {"big": True, "small": True}


def _killed_refetch_run(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=8)
    named = {f"t{i}": torch.full((20_000,), float(i)) for i in range(40)}  # ~3 MiB, 49 buckets
    if rank == 0:
        pub = ss.WeightPublisher(
            group, [0], [1], bucket_bytes=BUCKET, mode="cached", transport=transport
        )
        pub.publish(named, version=1).delivered.result(timeout=20)
        # the worker thread serves the refetch meanwhile
        wait_for_key(group.store, "die", 60, "the order to die mid-refetch")
        os._exit(3)
    return _dies_mid_transfer(group, ss.WeightSubscriber(group, [0], [1]), "refetch")


@pytest.mark.parametrize("transport", ["broadcast", TRANSPORTS[-1]])
def test_trainer_killed_mid_refetch_raises_and_leaves_no_complete_version(transport):
    out = spawn(_killed_refetch_run, 2, transport, timeout=60, may_die=(0,))
    assert out[1] >= 3  # the trainer died after the refetch had started landing


# ------------------------------------------------------------------ cross-memory reads
def _local_transport_run(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=10)
    named = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(5)}
    chosen = {}
    for transport in ("auto", "cma"):
        channel = f"local-{transport}"
        if rank == 0:
            try:
                with ss.WeightPublisher(
                    group, [0], [1], transport=transport, channel=channel
                ) as pub:
                    pub.publish(named, version=1).delivered.result(timeout=10)
                    chosen[transport] = pub.transport
            except SyncError as exc:
                chosen[transport] = str(exc)
        else:
            try:
                with ss.WeightSubscriber(group, [0], [1], channel=channel) as sub:
                    got = {}
                    sub.receive(lambda batch, got=got: got.update((n, t.clone()) for n, t in batch))
                    assert all(torch.equal(got[n], t) for n, t in named.items())
            except SyncError as exc:
                chosen[transport] = str(exc)
    group.close()
    return chosen


def test_colocated_rollouts_read_the_trainers_memory_where_the_kernel_allows_it():
    """auto picks torch's tensor sharing on one host; cma reads the trainer's memory where
    the kernel lets the rollouts, and fails on both sides, clearly, where it does not."""
    out = spawn(_local_transport_run, 2, timeout=60)
    if REMOTE_READS:
        assert out[0] == {"auto": "ipc", "cma": "cma"}
        assert out[1] == {}
    else:
        assert out[0]["auto"] == "ipc"
        assert "cannot read trainer rank 0's memory" in out[0]["cma"]
        assert "ptrace" in out[1]["cma"]
