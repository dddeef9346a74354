"""Read-once loads: ranks that need the same saved bytes read them from storage once.

4 ranks (gloo on 127.0.0.1) load one checkpoint through a storage wrapper that counts the
tensor bytes each rank reads from storage (:class:`fault_storage.FaultStorage`'s read
hook): as DDP replicas (every rank loads every tensor whole), through ``ss.load``,
``slipstream.dcp.load`` and ``Checkpointer.load``, on the local disk and on moto's S3;
and HSDP-like (a 2 x 2 mesh, ``Replicate()`` across replica groups, ``Shard(0)`` within
one). Every rank's tensors are compared with the state saved (``torch.equal``), and the
bytes read summed over the ranks are compared with the checkpoint's data files' sizes.
A rank whose read fails (a corrupt block, a failing storage on one rank) makes the load
raise on every rank, naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from fault_storage import Faults, FaultStorage
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import slipstream as ss
import slipstream.dcp
from slipstream.checkpoint.format.names import step_dir
from slipstream.checkpoint.storage import LocalStorage, Storage, resolve_storage
from slipstream.errors import CheckpointError, CorruptCheckpointError

WORLD = 4
STEP = 7
LOADS = ("ss.load", "slipstream.dcp.load", "Checkpointer.load")


def _state() -> dict:
    """What the checkpoints hold: tensors of several sizes and dtypes, and plain values."""
    g = torch.Generator().manual_seed(56)
    model = {
        "w1": torch.randn(2048, 1024, generator=g),
        "w2": torch.randn(700, 1000, generator=g).to(torch.bfloat16),
        "b": torch.randn(1000, generator=g),
        "emb": torch.randint(0, 1 << 40, (4000, 1000), generator=g),
    }
    return {"model": model, "step": STEP, "extra": {"lr": 0.1}}


def _blank() -> dict:
    state = _state()
    for name, t in state["model"].items():
        state["model"][name] = torch.full_like(t, -1)
    state["step"], state["extra"] = -1, {"lr": -1.0}
    return state


class _Counted:
    """The bytes read through a :class:`FaultStorage`'s read hook, from any thread."""

    def __init__(self, faults: Faults) -> None:
        self.nbytes = 0
        self._lock = threading.Lock()
        faults.hook("read", self._add)

    def _add(self, target: object, name: str, offset: int, out: memoryview) -> None:
        with self._lock:
            self.nbytes += len(out)

    def take(self) -> int:
        with self._lock:
            n, self.nbytes = self.nbytes, 0
        return n


def _dump(out: str, rank: int, value: object) -> None:
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(value, f)


def _results(out: Path) -> list:
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(WORLD)]


def _located(root: str, read_once: bool = True) -> Storage:
    """The storage at ``root``: a local directory as one on a file system the hosts share
    (``read_once``), where replicas split their reads as they do on object stores."""
    return resolve_storage(root) if "://" in root else LocalStorage(root, read_once=read_once)


def _replicas(rank: int, world: int, root: str, out: str, read_once: bool = True) -> None:
    """Every rank loads the whole state, three ways; reports what it got and read."""
    faults = Faults()
    counted = _Counted(faults)
    storage = FaultStorage(_located(root, read_once), faults)
    step = storage.child(step_dir(STEP))
    got = {}
    for how in LOADS:
        target = _blank()
        if how == "ss.load":
            ss.load(target, step)
        elif how == "slipstream.dcp.load":
            slipstream.dcp.load(target, checkpoint_id=step)
        else:
            ckpt = ss.Checkpointer(storage)
            try:
                assert ckpt.load(target) == STEP
            finally:
                ckpt.close()
        got[how] = (target, counted.take())
    _dump(out, rank, got)


def _save_replicated(root: str) -> None:
    ckpt = ss.Checkpointer(root)
    try:
        ckpt.save(STEP, _state()).metadata()
    finally:
        ckpt.close()


def _assert_exact(got: dict, want: dict, what: str) -> None:
    assert got["step"] == want["step"] and got["extra"] == want["extra"], what
    for name, t in want["model"].items():
        assert got["model"][name].dtype == t.dtype, (what, name)
        assert torch.equal(got["model"][name], t), (what, name)


def _read_alone(location: str, target: dict) -> int:
    """The tensor bytes one process loading ``target`` alone reads from ``location``: the
    checkpoint's size, as the shares below count it."""
    faults = Faults()
    counted = _Counted(faults)
    ss.load(target, FaultStorage(resolve_storage(location), faults), no_dist=True)
    return counted.take()


def _assert_read_once(per_rank: list[int], size: int, what: str) -> None:
    assert size <= sum(per_rank) <= 1.05 * size, (what, per_rank, size)
    for n in per_rank:
        assert 0.2 * size <= n <= 0.3 * size, (what, per_rank, size)


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory) -> tuple[list, int]:
    root = tmp_path_factory.mktemp("replicas")
    _save_replicated(str(root / "ckpt"))
    out = root / "got"
    out.mkdir()
    run_workers(_replicas, WORLD, str(root / "ckpt"), str(out), timeout=120)
    return _results(out), _read_alone(str(root / "ckpt" / step_dir(STEP)), _blank())


@pytest.mark.parametrize("how", LOADS)
def test_replicas_each_load_the_exact_state(replica_run, how):
    results, _ = replica_run
    for rank, got in enumerate(results):
        _assert_exact(got[how][0], _state(), f"{how} on rank {rank}")


@pytest.mark.parametrize("how", LOADS)
def test_replicas_read_each_byte_once_between_them(replica_run, how):
    results, size = replica_run
    _assert_read_once([got[how][1] for got in results], size, how)


def test_replicas_on_a_local_disk_read_through_their_page_cache_by_default(tmp_path):
    """A plain local path: each replica reads all it needs itself (one host's ranks share
    the page cache, which reads each byte from the disk once), and loads exactly."""
    _save_replicated(str(tmp_path / "ckpt"))
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_replicas, WORLD, str(tmp_path / "ckpt"), str(out), False, timeout=120)
    size = _read_alone(str(tmp_path / "ckpt" / step_dir(STEP)), _blank())
    for rank, got in enumerate(_results(out)):
        for how in LOADS:
            _assert_exact(got[how][0], _state(), f"{how} on rank {rank}")
            assert got[how][1] == size, (how, rank, got[how][1], size)


def test_replicas_on_s3_load_exactly_and_read_once(s3_bucket, tmp_path):
    root = f"s3://{s3_bucket}/run"
    _save_replicated(root)
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_replicas, WORLD, root, str(out), timeout=180)
    size = _read_alone(f"{root}/{step_dir(STEP)}", _blank())
    for rank, got in enumerate(_results(out)):
        for how in LOADS:
            _assert_exact(got[how][0], _state(), f"{how} from S3 on rank {rank}")
    results = _results(out)
    for how in LOADS:
        _assert_read_once([got[how][1] for got in results], size, f"{how} from S3")


# Hugging Face safetensors: a directory of two shards and their index, imported by every
# replica through ss.load.


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(4096, 2048, generator=g),
        "layers.0.w": torch.randn(2048, 2048, generator=g).to(torch.bfloat16),
        "layers.1.w": torch.randn(2048, 1024, generator=g),
        "norm.weight": torch.randn(2048, generator=g),
    }


def _write_hf(root: str) -> None:
    from safetensors.torch import save

    storage = resolve_storage(root)
    storage.prepare()
    tensors = _hf_tensors()
    shards = {"model-00001-of-00002.safetensors": ["embed.weight", "norm.weight"],
              "model-00002-of-00002.safetensors": ["layers.0.w", "layers.1.w"]}  # fmt: skip
    weight_map = {}
    for file, names in shards.items():
        storage.put_atomic(file, save({n: tensors[n] for n in names}))
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {}, "weight_map": weight_map}
    storage.put_atomic("model.safetensors.index.json", json.dumps(index).encode())


def _hf_blank() -> dict:
    return {"model": {n: torch.full_like(t, -1) for n, t in _hf_tensors().items()}}


def _hf_replicas(rank: int, world: int, root: str, out: str) -> None:
    faults = Faults()
    counted = _Counted(faults)
    target = _hf_blank()
    ss.load(target, FaultStorage(_located(root), faults))
    _dump(out, rank, (target, counted.take()))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_replicas_import_hf_safetensors_reading_each_byte_once(where, tmp_path, request):
    root = (
        str(tmp_path / "hf")
        if where == "local"
        else f"s3://{request.getfixturevalue('s3_bucket')}/hf"
    )
    _write_hf(root)
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_hf_replicas, WORLD, root, str(out), timeout=180)
    size = _read_alone(root, _hf_blank())
    results = _results(out)
    for rank, (got, _) in enumerate(results):
        for name, t in _hf_tensors().items():
            assert torch.equal(got["model"][name], t), (where, rank, name)
    _assert_read_once([n for _, n in results], size, f"HF import from {where}")


# HSDP: a 2 x 2 mesh, replicated across dim 0 ("replica"), sharded across dim 1 ("shard").
FULL = {"w": (8192, 512), "v": (4096, 256)}


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn(FULL[name], generator=g)


def _hsdp(rank: int, world: int, root: str, out: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    placements = [Replicate(), Shard(0)]
    ss.save({n: distribute_tensor(_full(n), mesh, placements) for n in FULL}, root)
    faults = Faults()
    counted = _Counted(faults)
    groups_before = len(dist.distributed_c10d._world.pg_names)
    target = {n: distribute_tensor(torch.zeros(FULL[n]), mesh, placements) for n in FULL}
    ss.load(target, FaultStorage(_located(root), faults))
    made = len(dist.distributed_c10d._world.pg_names) - groups_before
    local = {}
    for n, t in target.items():
        assert isinstance(t, DTensor)
        local[n] = t.to_local().clone()
    _dump(out, rank, (mesh.get_coordinate(), local, counted.take(), made))


def test_hsdp_replica_groups_read_each_byte_once(tmp_path):
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_hsdp, WORLD, str(tmp_path / "ckpt"), str(out), timeout=120)
    results = _results(out)
    for coordinate, local, _, made in results:
        for n in FULL:
            want = _full(n).chunk(2, dim=0)[coordinate[1]]
            assert torch.equal(local[n], want), (coordinate, n)
        assert made == 1, f"{coordinate}: {made} groups made for one read-once load"
    size = _read_alone(str(tmp_path / "ckpt"), {n: torch.zeros(FULL[n]) for n in FULL})
    _assert_read_once([nbytes for _, _, nbytes, _ in results], size, "HSDP")


_EIO = OSError(errno.EIO, "Input/output error (injected)", "__0_0.distcp")


def _failing(rank: int, world: int, root: str, out: str, bad_rank: int) -> None:
    """Every rank loads as a replica; ``bad_rank``'s storage (``-1``: none) fails its reads.
    Then, the fault cleared, every rank loads again: what each load gave is reported."""
    faults = Faults()
    if rank == bad_rank:
        faults.fail("read", _EIO, when=lambda name: name.endswith(".distcp"))
    storage = FaultStorage(_located(root), faults)
    outcomes = []
    for _ in range(2):
        target = _blank()
        try:
            ss.load(target, storage)
        except CheckpointError as exc:
            outcomes.append((type(exc).__name__, str(exc)))
        else:
            outcomes.append(target)
        faults.clear()
    _dump(out, rank, outcomes)


def _saved_alone(root: Path) -> Path:
    ss.save(_state(), root)
    return root


def test_a_corrupt_file_fails_the_load_on_every_rank_naming_it(tmp_path):
    ckpt = _saved_alone(tmp_path / "ckpt")
    (data,) = ckpt.glob("*.distcp")
    with open(data, "r+b") as f:  # one byte in the middle of the biggest tensors
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_failing, WORLD, str(ckpt), str(out), -1, timeout=60)
    for rank, outcomes in enumerate(_results(out)):
        for got in outcomes:  # the second load fails the same way, without hanging
            assert isinstance(got, tuple), f"rank {rank} loaded a corrupt checkpoint"
            kind, message = got
            assert kind == CorruptCheckpointError.__name__, (rank, message)
            assert data.name in message and "checksum mismatch" in message, (rank, message)


def test_a_rank_whose_storage_fails_fails_the_load_on_every_rank_and_the_next_loads(tmp_path):
    ckpt = _saved_alone(tmp_path / "ckpt")
    (data,) = ckpt.glob("*.distcp")
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_failing, WORLD, str(ckpt), str(out), 2, timeout=60)
    for rank, (failed, again) in enumerate(_results(out)):
        assert isinstance(failed, tuple), f"rank {rank} returned from a load rank 2 failed"
        _, message = failed
        assert "rank 2" in message and "Input/output error" in message, (rank, message)
        assert data.name in message, (rank, message)
        _assert_exact(again, _state(), f"rank {rank}, loading again once rank 2 reads")


def _sharded(rank: int, world: int, root: str, out: str) -> None:
    """FSDP-like: every rank loads only its own rows, which no other rank wants."""
    mesh = init_device_mesh("cpu", (world,))
    ss.save({n: distribute_tensor(_full(n), mesh, [Shard(0)]) for n in FULL}, root)
    groups_before = len(dist.distributed_c10d._world.pg_names)
    target = {n: distribute_tensor(torch.zeros(FULL[n]), mesh, [Shard(0)]) for n in FULL}
    ss.load(target, root)
    local = {n: t.to_local().clone() for n, t in target.items() if isinstance(t, DTensor)}
    made = len(dist.distributed_c10d._world.pg_names) - groups_before
    _dump(out, rank, (local, made))


def test_a_load_whose_ranks_share_no_bytes_makes_no_group(tmp_path):
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_sharded, WORLD, str(tmp_path / "ckpt"), str(out), timeout=120)
    for rank, (local, made) in enumerate(_results(out)):
        for n in FULL:
            assert torch.equal(local[n], _full(n).chunk(WORLD, dim=0)[rank]), (rank, n)
        assert made == 0, f"rank {rank} made {made} process group(s) for a load sharing nothing"


def _subgroups(rank: int, world: int, root: str, out: str) -> None:
    """Ranks {0, 1} and {2, 3}, each a group of the job's own, load as two replica pairs."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    faults = Faults()
    counted = _Counted(faults)
    target = _blank()
    ss.load(target, FaultStorage(_located(root), faults), process_group=pairs[rank // 2])
    _dump(out, rank, (target, counted.take()))


def test_replicas_in_a_group_of_their_own_read_once_between_them(tmp_path):
    ckpt = _saved_alone(tmp_path / "ckpt")
    out = tmp_path / "got"
    out.mkdir()
    run_workers(_subgroups, WORLD, str(ckpt), str(out), timeout=120)
    results = _results(out)
    size = _read_alone(str(ckpt), _blank())
    for rank, (target, _) in enumerate(results):
        _assert_exact(target, _state(), f"rank {rank}")
    for pair in ((0, 1), (2, 3)):
        read = [results[r][1] for r in pair]
        assert size <= sum(read) <= 1.05 * size, (pair, read, size)
        assert all(0.4 * size <= n <= 0.6 * size for n in read), (pair, read, size)
