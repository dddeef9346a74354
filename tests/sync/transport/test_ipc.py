"""The colocated transport on torch's tensor sharing (``ipc``): the shared buffers are the
same memory in every process, ``auto`` picks it for colocated ranks, every version arrives
exact while a slow rollout holds the ring's slots, the trainer's changes after ``staged``
never reach a rollout, and the buffers are shared once and reused."""

from __future__ import annotations

import dataclasses
import json
import time

import torch
from sync_procs import spawn
from torch.multiprocessing import reductions

import slipstream as ss
from slipstream.errors import SyncError
from slipstream.sync.transport.shared_tensors import SharedBuffer, describe, shared_buffer

#: small buckets and the default two slots: every version wraps the ring many times
BUCKET = 16 * 1024
VERSIONS = (1, 2, 3, 4)


def _open_and_write(rank, port, description):
    shared = SharedBuffer(**json.loads(description))
    buf = shared.open()
    seen = buf[:4].tolist()
    buf[:2] = 5
    return seen, buf.numel(), str(buf.device)


def test_a_shared_host_buffer_is_the_same_memory_in_another_process():
    buf = shared_buffer(4096, torch.device("cpu"))
    buf.fill_(9)
    description = json.dumps(dataclasses.asdict(describe(buf)))
    seen, numel, device = spawn(_open_and_write, 1, description, timeout=60)[0]
    assert (seen, numel, device) == ([9, 9, 9, 9], 4096, "cpu")
    assert buf[:4].tolist() == [5, 5, 9, 9]  # the other process's write is seen here


def _open_after_manager_timeouts(rank, port, description, timeouts):
    """Open the buffer in this process, torch's shared-memory manager timing out on the
    first ``timeouts`` tries (as it does on a loaded host)."""
    real = reductions.rebuild_storage_filename
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) <= timeouts:
            raise RuntimeError("Shared memory manager connection has timed out")
        return real(*args)

    reductions.rebuild_storage_filename = flaky
    try:
        buf = SharedBuffer(**json.loads(description)).open()
    except SyncError as exc:
        return {"error": str(exc), "tries": len(calls)}
    buf[:2] = 5
    return {"seen": buf[2:4].tolist(), "tries": len(calls)}


def test_a_host_buffers_open_is_tried_again_when_the_manager_times_out():
    """Two timeouts of torch's shared-memory manager, then an open: the buffer is the
    owner's memory; three in a row fail the open, naming the buffer."""
    buf = shared_buffer(4096, torch.device("cpu"))
    buf.fill_(9)
    twice = json.dumps(dataclasses.asdict(describe(buf)))
    out = spawn(_open_after_manager_timeouts, 1, twice, 2, timeout=60)[0]
    assert out == {"seen": [9, 9], "tries": 3}
    assert buf[:4].tolist() == [5, 5, 9, 9]
    thrice = json.dumps(dataclasses.asdict(describe(buf)))
    out = spawn(_open_after_manager_timeouts, 1, thrice, 3, timeout=60)[0]
    assert out["tries"] == 3 and "could not open a shared cpu buffer of 4096 bytes" in out["error"]


def weights(version: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes, most larger than a bucket, new every version."""
    g = torch.Generator().manual_seed(version)
    out = {}
    for i, (n, dtype) in enumerate(
        [(3000, torch.float32), (17, torch.bfloat16), (9000, torch.bfloat16), (5, torch.int64)] * 3
    ):
        t = torch.randn(n, generator=g) * 100
        out[f"w{i}"] = t.to(dtype)
    return out


def _run(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=30)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1, 2], bucket_bytes=BUCKET)
        out = {"transport": pub.transport, "timings": [], "buffers": []}
        with pub:
            for version in VERSIONS:
                named = weights(version)
                h = pub.publish(named, version=version)
                assert h.staged.done()
                for t in named.values():  # after staged the trainer may change its weights
                    t.fill_(-1)
                assert h.delivered.result(timeout=30) == version
                out["timings"].append(h.timings.transport)
                out["buffers"].append(pub.buffer_bytes)
        group.close()
        return out
    received = {}
    with ss.WeightSubscriber(group, [0], [1, 2]) as sub:
        for version in VERSIONS:
            held: dict[str, torch.Tensor] = {}

            def load(batch, held=held):
                if rank == 2:
                    time.sleep(0.002)  # a slow rollout: the trainer must wait for its slots
                for name, t in batch:
                    held[name] = t.clone()

            assert sub.receive(load) == version
            want = weights(version)
            received[version] = held.keys() == want.keys() and all(
                torch.equal(held[n], t) for n, t in want.items()
            )
    group.close()
    return received


def test_auto_picks_ipc_on_one_host_and_every_version_arrives_exact_in_reused_buffers():
    out = spawn(_run, 3, timeout=120)
    trainer = out[0]
    assert trainer["transport"] == "ipc"
    assert trainer["timings"] == ["ipc"] * len(VERSIONS)  # named in each publish's timings
    # the slots were shared once and reused: the same buffers for every version
    assert len(set(trainer["buffers"])) == 1 and trainer["buffers"][0] >= 2 * BUCKET
    for rank in (1, 2):
        assert out[rank] == dict.fromkeys(VERSIONS, True), (rank, out[rank])


def _unshareable_run(rank, port, transport):
    """Rank 2 cannot open what torch shares (torch's error when its shared-memory manager is
    out of reach, as from another container): ``transport`` settles or fails on every rank."""
    if rank == 2:

        def unreachable(*args, **kwargs):
            raise RuntimeError("error connecting to the torch_shm_manager socket")

        reductions.rebuild_storage_filename = unreachable
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=30)
    try:
        if rank == 0:
            with ss.WeightPublisher(group, [0], [1, 2], transport=transport) as pub:
                pub.publish(weights(1), version=1).delivered.result(timeout=30)
                return pub.transport
        held: dict[str, torch.Tensor] = {}
        with ss.WeightSubscriber(group, [0], [1, 2]) as sub:
            sub.receive(lambda batch: held.update((n, t.clone()) for n, t in batch))
        want = weights(1)
        return held.keys() == want.keys() and all(torch.equal(held[n], want[n]) for n in want)
    except SyncError as exc:
        return f"SyncError: {exc}"
    finally:
        group.close()


def test_auto_falls_back_to_shm_when_a_rollout_cannot_open_torchs_shared_memory():
    out = spawn(_unshareable_run, 3, "auto", timeout=120)
    assert out == {0: "shm", 1: True, 2: True}


def test_ipc_asked_for_fails_on_every_rank_naming_the_rollout_that_cannot_open_it():
    out = spawn(_unshareable_run, 3, "ipc", timeout=120)
    for rank, error in out.items():
        assert error.startswith("SyncError: "), (rank, error)
        assert "rollout rank 2: could not open a shared cpu buffer" in error, (rank, error)
        assert "torch_shm_manager" in error, (rank, error)
        assert "rollout rank 1: could not" not in error, (rank, error)
