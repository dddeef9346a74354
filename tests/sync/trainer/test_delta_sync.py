"""Delta publishes end to end: trainers send the changed words, rollouts apply them in place.

Every version is checked bit for bit on every rollout against the trainer's tensors
recomputed independently (a deterministic replay of the updates), and the bytes each
publish sent against what its changes allow.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from dist_utils import wait_for_key
from sync_procs import life, remote_reads_allowed, spawn, wait_root_key, zeros_module
from torch import nn

import slipstream as ss
from slipstream.errors import SyncError

BUCKET = 64 * 1024
SEPARATE = 4096
CONFIGS = [
    ("direct", "relay"),
    ("cached", "relay"),
    ("direct", "broadcast"),
    ("cached", "shm"),
    *([("direct", "cma"), ("cached", "cma")] if remote_reads_allowed() else []),
]
#: what each version does to the weights of the version before
PATTERN = {2: "sparse", 3: "none", 4: "sparse", 5: "sparse", 6: "all", 7: "sparse"}
VERSIONS = [1, *PATTERN]


def initial() -> dict[str, torch.Tensor]:
    """Mixed dtypes: bf16 tensors larger than a 64 KiB bucket, fp16 and uint8 whose bytes
    end inside an 8-byte word, fp32 and int64."""
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(100_003, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "f32": torch.randn(33, 5, generator=g),
        "ids": torch.randint(0, 1000, (1000,), generator=g),
        "u8": torch.randint(0, 200, (13,), generator=g, dtype=torch.uint8),
        "w": torch.randn(40_000, generator=g).to(torch.bfloat16),
    }


def step(named: dict[str, torch.Tensor], version: int) -> None:
    """Apply version ``version``'s change in place: about 1% of the elements moved by one
    unit in the last place, all of them, or none."""
    how = PATTERN[version]
    if how == "none":
        return
    g = torch.Generator().manual_seed(version)
    for t in named.values():
        ints = t.view(-1).view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        )
        hit = torch.rand(ints.numel(), generator=g) < (1.0 if how == "all" else 0.01)
        ints[hit] += 1


def weights(version: int) -> dict[str, torch.Tensor]:
    named = initial()
    for v in range(2, version + 1):
        step(named, v)
    return named


def holder() -> nn.Module:
    return zeros_module(initial())


def exact(m: nn.Module, version: int) -> bool:
    return all(
        torch.equal(m.get_buffer(n).view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
        for n, t in weights(version).items()
    )


DENSE = sum(t.numel() * t.element_size() for t in initial().values())


def _many_versions(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=60)
    report = {}
    for mode, transport in CONFIGS:
        channel = f"{mode}-{transport}"
        if rank == 0:
            named = initial()
            with ss.WeightPublisher(
                group,
                [0],
                [1, 2],
                bucket_bytes=BUCKET,
                mode=mode,
                transport=transport,
                channel=channel,
                separate_min_bytes=SEPARATE,
                delta=True,
            ) as pub:
                assert pub.transport == transport and pub.delta
                sent = {}
                for version in VERSIONS:
                    if version > 1:
                        step(named, version)
                    h = pub.publish(named, version=version)
                    assert h.delivered.result(timeout=30) == version
                    t = h.timings
                    sent[version] = (t.nbytes, t.dense_bytes, t.changed_fraction)
                report[channel] = (sent, pub.base_bytes)
        else:
            with ss.WeightSubscriber(group, [0], [1, 2], channel=channel) as sub:
                target = holder()
                for version in VERSIONS:
                    assert sub.receive(target) == version
                    assert exact(target, version), (channel, version)
    group.close()
    return report


def test_many_versions_of_deltas_stay_exact_on_every_transport_and_send_little():
    report = spawn(_many_versions, 3, timeout=240)[0]
    for channel, (sent, base_bytes) in report.items():
        assert base_bytes >= DENSE, channel  # the kept base (direct) or the cache
        for version, (nbytes, dense, changed) in sent.items():
            what = (channel, version, nbytes, dense, changed)
            assert dense >= DENSE
            if version == 1:
                assert nbytes >= DENSE and changed is None, what  # nothing to diff against
            elif version == 7:
                # the diff of version 6 gained nothing: the next publishes are not diffed
                # (every tensor but a tiny one that the 1% step left alone changed)
                assert nbytes > 0.99 * DENSE and changed is None, what
            elif PATTERN[version] == "sparse":
                assert 0 < changed < 0.1, what
                assert 0 < nbytes < dense / 4, what
            elif PATTERN[version] == "all":
                assert changed > 0.5 and nbytes >= DENSE, what  # dense is smaller
            else:
                assert changed == 0 and nbytes < 64 * (dense // BUCKET + 1), what


def _restart_run(rank, port, mode, transport):
    """Rollout 2 dies after version 2 and comes back for version 4: version 3 goes as a
    delta to rollout 1 alone, version 4 dense to both (the new process holds no base),
    version 5 as a delta to both again."""
    if rank == 2 and life() == 2:
        wait_root_key(port, "test/published-without-2")
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=60)
    if rank == 0:
        named = initial()
        sent = {}
        with ss.WeightPublisher(
            group, [0], [1, 2], bucket_bytes=BUCKET, mode=mode, transport=transport, delta=True
        ) as pub:
            for version in (1, 2, 3, 4, 5):
                if version > 1:
                    step_sparse(named, version)
                if version == 4:
                    group.set_json("test/published-without-2", True)
                    wait_for_key(group.store, "test/rejoined", 60, "rollout 2 to come back")
                h = pub.publish(named, version=version)
                assert h.delivered.result(timeout=30) == version
                sent[version] = (h.timings.nbytes, sorted(h.absent))
        group.close()
        return sent
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    target = holder()
    versions = (1, 2, 3, 4, 5) if rank == 1 else ((1, 2) if life() == 1 else (4, 5))
    if rank == 2 and life() == 2:
        group.set_json("test/rejoined", True)
    for version in versions:
        assert sub.receive(target) == version
        assert exact_sparse(target, version), (rank, version)
    if rank == 2 and life() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    sub.close()
    group.close()
    return "ok"


def step_sparse(named: dict[str, torch.Tensor], version: int) -> None:
    g = torch.Generator().manual_seed(100 + version)
    for t in named.values():
        ints = t.view(-1).view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        )
        ints[torch.rand(ints.numel(), generator=g) < 0.01] += 1


def exact_sparse(m: nn.Module, version: int) -> bool:
    named = initial()
    for v in range(2, version + 1):
        step_sparse(named, v)
    return all(torch.equal(m.get_buffer(n), t) for n, t in named.items())


@pytest.mark.parametrize("mode,transport", [("direct", "relay"), ("cached", "shm")])
def test_a_restarted_rollout_gets_dense_bytes_then_deltas_again(mode, transport):
    out = spawn(_restart_run, 3, mode, transport, timeout=120, restart=(2,))
    sent = out[0]
    assert sent[3][1] == [2]  # rollout 2 was away for version 3
    assert sent[3][0] < DENSE / 4  # a delta to rollout 1
    assert sent[4][0] >= DENSE  # the new rollout 2 holds no base: every byte
    assert sent[5][0] < DENSE / 4  # both hold version 4's tokens: a delta again


def _refused_run(rank, port):
    """Rollout 1's recorded base is corrupted: it refuses the delta (applying nothing of
    it), the publish names it, and its next receive gets dense bytes and ends exact."""
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        named = initial()
        out = {}
        with ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, delta=True) as pub:
            for version in (1, 2, 3, 4):
                if version > 1:
                    step_sparse(named, version)
                h = pub.publish(named, version=version)
                try:
                    h.delivered.result(timeout=30)
                    out[version] = h.timings.nbytes
                except SyncError as exc:
                    out[version] = str(exc)
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1])
    target = holder()
    for version in (1, 2):
        assert sub.receive(target) == version
    sub._tokens[1] ^= 1  # as if bucket 1 held other bytes than the trainer's base
    with pytest.raises(SyncError, match="bucket 1 from trainer rank 0.*does not apply"):
        sub.receive(target)
    assert sub.version is None
    for version in (4,):
        assert sub.receive(target) == version
        assert exact_sparse(target, version)
    sub.close()
    group.close()
    return "ok"


def test_a_delta_for_another_base_is_refused_and_dense_bytes_follow():
    sent = spawn(_refused_run, 2, timeout=90)[0]
    assert sent[2] < DENSE / 4
    assert "rollout rank 1" in sent[3] and "does not apply" in sent[3]
    assert sent[4] >= DENSE


def _dtensor_run(rank, port, mesh_port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    group = ss.sync.init_group("127.0.0.1", port, 4, rank, timeout=60)
    base = {
        f"w{i}": torch.randn(64 * (i % 4 + 1), 33, generator=torch.Generator().manual_seed(i)).to(
            torch.bfloat16
        )
        for i in range(12)
    }
    out = {}
    if rank in (0, 1):
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        full = {n: t.clone() for n, t in base.items()}
        with ss.WeightPublisher(group, [0, 1], [2, 3], bucket_bytes=BUCKET, delta=True) as pub:
            for version in (1, 2, 3, 4):
                if version > 1:
                    step_sparse(full, version)
                named = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
                h = pub.publish(named, version=version)
                assert h.delivered.result(timeout=30) == version
                out[version] = (h.timings.nbytes, h.timings.dense_bytes)
        torch.distributed.destroy_process_group()
    else:
        target = nn.Module()
        for n, t in base.items():
            target.register_buffer(n, torch.zeros_like(t))
        with ss.WeightSubscriber(group, [0, 1], [2, 3]) as sub:
            expect = {n: t.clone() for n, t in base.items()}
            for version in (1, 2, 3, 4):
                if version > 1:
                    step_sparse(expect, version)
                assert sub.receive(target) == version
                for n, t in expect.items():
                    assert torch.equal(target.get_buffer(n), t), (version, n)
    group.close()
    return out


def test_dtensor_shards_from_two_trainers_go_as_deltas_and_stay_exact():
    from dist_utils import free_port

    out = spawn(_dtensor_run, 4, free_port(), timeout=120)
    for trainer in (0, 1):
        first, dense = out[trainer][1]
        assert first >= dense > 0  # each trainer sends the buckets it owns
        for version in (2, 3, 4):
            nbytes, dense = out[trainer][version]
            assert 0 < nbytes < dense / 4, (trainer, version, nbytes, dense)


def _default_delta(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    out = {}
    for mode in ("direct", "cached"):
        if rank == 0:
            with ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, mode=mode) as pub:
                pub.publish(initial(), version=1).delivered.result(timeout=30)
                out[mode] = {"delta": pub.delta, "base_bytes": pub.base_bytes}
        else:
            target = nn.Module()
            for name, t in initial().items():
                target.register_buffer(name, torch.zeros_like(t))
            with ss.WeightSubscriber(group, [0], [1]) as sub:
                sub.receive(target)
            out[mode] = all(torch.equal(getattr(target, n), t) for n, t in initial().items())
    group.close()
    return out


def test_deltas_are_on_by_default_in_cached_mode_only_and_direct_keeps_no_copy():
    out = spawn(_default_delta, 2, timeout=90)
    assert out[0]["direct"] == {"delta": False, "base_bytes": 0}
    assert out[0]["cached"]["delta"] is True
    assert out[0]["cached"]["base_bytes"] >= sum(t.nbytes for t in initial().values())
    assert out[1] == {"direct": True, "cached": True}
