"""Saves larger than ``SaveOptions.staging_budget_bytes``: they stream through the budget's
part-sized slots (save/part_ring.py) instead of being refused.

The budget here is 256 KiB, so parts are 64 KiB and the state (about 1.6 MB) takes some
25 parts: records larger than a part (split across several, one of them strided), records
smaller than one, frames and padding across part ends. Checkpoints are read back by
``ss.load`` and by DCP's own ``dcp.load`` and compared with the state as it was saved; the
data file is compared byte for byte with an unbudgeted save's. Orderings are forced with
gated or failing writes (:class:`FaultStorage`), never with sleeps.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import copy_state
from dist_utils import run_workers
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.save.options import STREAM_SLOTS
from slipstream.checkpoint.save.part_ring import part_bytes
from slipstream.checkpoint.save.record_copy import flat_range
from slipstream.checkpoint.storage import DataWriter, LocalStorage, MemoryStorage
from slipstream.core.checksum import BlockChecksums, block_checksums
from slipstream.errors import CheckpointError

GATE_TIMEOUT = 10.0
BUDGET = 256 * 1024
PART = part_bytes(BUDGET)
DATA_FILE = "__0_0.distcp"


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300_000, generator=g),  # 1.2 MB: many parts
        "m": torch.randn(300, 200, generator=g).t(),  # strided, split across parts
        "h": torch.randn(1000, generator=g).to(torch.bfloat16),
        "c": torch.randn(5000, dtype=torch.complex64, generator=g),
        "n": torch.arange(10),
        "e": torch.empty(0),
        "step": 3,
        "opt": {"lr": 0.5},
    }


def _blank(state: dict) -> dict:
    return {
        k: (torch.zeros_like(v) if torch.is_tensor(v) else {"lr": 0.0} if k == "opt" else 0)
        for k, v in state.items()
    }


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if torch.is_tensor(v):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _image_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))


@pytest.fixture
def saver():
    s = CheckpointSaver(options=SaveOptions(staging_budget_bytes=BUDGET))
    yield s
    s.close()


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_a_save_over_the_budget_streams_and_loads_back_exactly(tmp_path, saver, backend):
    state = _state()
    assert _image_bytes(state) > 5 * BUDGET  # many parts
    where = (
        str(tmp_path / "ck")
        if backend == "local"
        else MemoryStorage(f"memory://budget-{uuid.uuid4().hex[:8]}/ck")
    )
    saver.save(state, where).upload_completion.result(60)
    assert 0 < saver.staging_peak_bytes <= BUDGET  # within the budget, not one part over
    got = _blank(state)
    ss.load(got, where)
    _assert_same(got, state)
    if backend == "local":
        by_dcp = _blank(state)
        dcp.load(by_dcp, checkpoint_id=str(tmp_path / "ck"))
        _assert_same(by_dcp, state)


def test_the_streamed_file_is_the_unbudgeted_one_byte_for_byte(tmp_path, saver):
    state = _state()
    saver.save(state, tmp_path / "streamed").upload_completion.result(60)
    whole = CheckpointSaver()
    try:
        whole.save(state, tmp_path / "whole").upload_completion.result(60)
        assert whole.staging_peak_bytes > _image_bytes(state)  # held whole
    finally:
        whole.close()
    streamed = (tmp_path / "streamed" / DATA_FILE).read_bytes()
    assert streamed == (tmp_path / "whole" / DATA_FILE).read_bytes()
    # the block checksums hashed part by part are the ones hashed over the whole image
    index = [
        json.loads((tmp_path / n / ".slipstream.json").read_text()) for n in ("streamed", "whole")
    ]
    assert index[0]["records"] == index[1]["records"]
    assert index[0]["values"] == index[1]["values"]


def test_saves_of_one_layout_reuse_one_buffer_of_the_budget(tmp_path, saver):
    state = _state()
    for i in range(3):
        state["w"].add_(1)
        state["step"] = i
        saver.save(state, tmp_path / f"s{i}").upload_completion.result(60)
    assert saver.staging_allocations == 1
    assert saver.staging_peak_bytes == saver.staging_bytes == STREAM_SLOTS * PART
    got = _blank(state)
    ss.load(got, tmp_path / "s2")
    _assert_same(got, state)


def test_staging_completion_waits_for_the_last_part_and_the_state_is_free_after_it(tmp_path):
    """With writes held, staging stops once every slot holds a part (the rest of the state
    is still unread), so ``staging_completion`` is not resolved; once writes go on it
    resolves, and a mutation right after it does not reach the checkpoint."""
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))
    slots_full = threading.Event()
    writes: list[int] = []

    def count(_writer, _name, start, _end) -> None:
        writes.append(start)
        if len(writes) == STREAM_SLOTS:
            slots_full.set()

    storage.faults.hook("write", count)
    gate = storage.faults.gate("write")
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=BUDGET, io_threads=8))
    try:
        state = _state()
        want = copy_state(state)
        response = saver.save(state, storage)
        assert slots_full.wait(GATE_TIMEOUT), "the first parts were never written"
        assert not response.staging_completion.done()  # parts beyond the slots unstaged
        gate.set()
        response.staging_completion.result(60)
        for v in state.values():
            if torch.is_tensor(v):
                v.zero_()
        response.upload_completion.result(60)
    finally:
        saver.close()
    got = _blank(want)
    ss.load(got, tmp_path / "ck")
    _assert_same(got, want)


def test_a_save_within_the_budget_stages_whole_as_before(tmp_path):
    """Within the budget: one buffer the size of the image, and ``staging_completion``
    resolves while every write is still held."""
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))
    gate = storage.faults.gate("write")
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=64 * BUDGET))
    try:
        state = _state()
        response = saver.save(state, storage)
        response.staging_completion.result(60)
        assert not response.upload_completion.done()
        gate.set()
        response.upload_completion.result(60)
        assert _image_bytes(state) < saver.staging_bytes < 2 * _image_bytes(state)
    finally:
        saver.close()
    got = _blank(state)
    ss.load(got, tmp_path / "ck")
    _assert_same(got, state)


def test_a_failed_part_write_fails_the_save_naming_the_file_and_commits_nothing(tmp_path):
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))

    def disk_full(_writer, _name, start, _end) -> None:
        if start == 3 * PART:
            raise OSError(28, "No space left on device")

    storage.faults.hook("write", disk_full)
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=BUDGET))
    try:
        response = saver.save(_state(), storage)
        # the first of the pieces part 3 is written in (each io thread writes a share)
        named = rf"bytes \[{3 * PART}, {3 * PART + PART // 4}\) of .*ck/{DATA_FILE}.*No space left"
        with pytest.raises(CheckpointError, match=named):
            response.upload_completion.result(60)
        with pytest.raises(CheckpointError, match="No space left"):
            response.staging_completion.result(60)  # the part's slot never came back
        assert not (tmp_path / "ck" / ".metadata").exists()
        assert not (tmp_path / "ck" / DATA_FILE).exists()
        storage.faults.clear()
        state = _state(1)
        saver.save(state, tmp_path / "next").upload_completion.result(60)
    finally:
        saver.close()
    got = _blank(state)
    ss.load(got, tmp_path / "next")
    _assert_same(got, state)


def test_a_budget_under_one_page_per_slot_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"SaveOptions.staging_budget_bytes=8192: .*16384"):
        SaveOptions(staging_budget_bytes=8192)
    SaveOptions(staging_budget_bytes=STREAM_SLOTS * 4096)


def test_a_snapshot_in_host_memory_is_no_larger_than_the_budget_by_default(tmp_path, caplog):
    """On CPU a device snapshot is host memory: over the budget there is none (the save
    streams from the state) unless ``device_snapshot_bytes`` allows it; within the budget
    the snapshot is taken as before."""
    state = _state()
    over = CheckpointSaver(options=SaveOptions(device_snapshot=True, staging_budget_bytes=BUDGET))
    try:
        with caplog.at_level("WARNING", logger="slipstream"):
            over.save(state, tmp_path / "over").upload_completion.result(60)
        assert over.snapshot_allocations == 0
        assert over.staging_peak_bytes <= BUDGET
        assert "in host memory, by default, staging_budget_bytes" in caplog.text
    finally:
        over.close()
    within = CheckpointSaver(
        options=SaveOptions(device_snapshot=True, staging_budget_bytes=64 * BUDGET)
    )
    try:
        within.save(state, tmp_path / "within").upload_completion.result(60)
        assert within.snapshot_allocations == 1
    finally:
        within.close()
    for name in ("over", "within"):
        got = _blank(state)
        ss.load(got, tmp_path / name)
        _assert_same(got, state)


def test_a_device_snapshot_over_the_budget_drains_through_its_slots(tmp_path):
    """A snapshot larger than the budget (allowed by ``device_snapshot_bytes``) still
    completes staging at the call, with every write held; it then drains part by part
    into the budget's slots, and a mutation right after the call never reaches the file."""
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))
    gate = storage.faults.gate("write")
    options = SaveOptions(
        device_snapshot=True, device_snapshot_bytes=64 * BUDGET, staging_budget_bytes=BUDGET
    )
    saver = CheckpointSaver(options=options)
    try:
        state = _state()
        want = copy_state(state)
        response = saver.save(state, storage)
        response.staging_completion.result(60)  # resolved by the gather, writes still held
        assert not response.upload_completion.done()
        for v in state.values():
            if torch.is_tensor(v):
                v.mul_(-3).add_(1)
        gate.set()
        response.upload_completion.result(60)
        assert saver.snapshot_allocations == 1
        assert 0 < saver.staging_peak_bytes <= BUDGET
    finally:
        saver.close()
    got = _blank(want)
    ss.load(got, tmp_path / "ck")
    _assert_same(got, want)
    by_dcp = _blank(want)
    dcp.load(by_dcp, checkpoint_id=str(tmp_path / "ck"))
    _assert_same(by_dcp, want)


@pytest.mark.parametrize("nbytes", [0, 1, 5000, (1 << 20) * 3 + 17])
def test_block_checksums_fed_in_pieces_equal_the_one_shot_ones(nbytes):
    data = memoryview(random.Random(nbytes).randbytes(nbytes))
    rng = random.Random(1)
    cuts = sorted({0, nbytes, *(rng.randrange(nbytes + 1) for _ in range(6))})
    sums = BlockChecksums(nbytes)
    for a, b in zip(cuts, cuts[1:], strict=False):
        sums.update(data[a:b])
    assert sums.result() == block_checksums(data)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24 * 5 * 7).reshape(24, 5, 7).permute(2, 0, 1),
        torch.arange(300).reshape(20, 15)[:, ::2],
        torch.arange(100)[::3],
        torch.arange(60).reshape(3, 4, 5),
    ],
)
def test_flat_range_views_are_the_flattened_elements(tensor):
    n = tensor.numel()
    for lo, hi in [(0, n), (1, n - 1), (3, 4), (n // 3, 2 * n // 3), (5, 5)]:
        views = flat_range(tensor, lo, hi)
        got = torch.cat([v.reshape(-1) for v in views]) if views else torch.empty(0)
        assert torch.equal(got, tensor.flatten()[lo:hi].to(got.dtype)), (lo, hi)


def test_an_upload_failing_before_its_first_write_stops_a_streaming_stage(tmp_path):
    """The upload fails (its storage cannot be prepared) once the stager holds its slots:
    the stager, which only the writer could free, fails with it instead of waiting for
    slots until the save's timeout (600 s here)."""
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=BUDGET))

    def fail_once_staging_holds_its_slots(*_args) -> None:
        for _ in range(1000):  # the stager allocates its ring as it starts
            if saver.staging_bytes:
                break
            time.sleep(0.01)
        raise OSError("the bucket is gone")

    storage.faults.hook("prepare", fail_once_staging_holds_its_slots)
    try:
        response = saver.save(_state(), storage)
        with pytest.raises(CheckpointError, match="the bucket is gone"):
            response.upload_completion.result(60)
        with pytest.raises(CheckpointError):
            response.staging_completion.result(60)
        assert saver.staging_bytes == STREAM_SLOTS * PART
    finally:
        saver.close()
    assert not (tmp_path / "ck" / ".metadata").exists()


def _sharded_over_the_budget(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(5)
    full = torch.randn(1000, 300, generator=g)  # 600 KB a shard: several parts each
    replicated = [torch.randn(20_000, generator=g) for _ in range(6)]
    state = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        **{f"r{i}": t for i, t in enumerate(replicated)},
        "step": 9,
    }
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=BUDGET))
    try:
        saver.save(state, f"{root}/ck").result(timeout=60)
        assert 0 < saver.staging_peak_bytes <= BUDGET, rank
    finally:
        saver.close()
    want = {"sharded": full, **{f"r{i}": t for i, t in enumerate(replicated)}, "step": 9}
    by_dcp = {k: (torch.zeros_like(v) if torch.is_tensor(v) else 0) for k, v in want.items()}
    dcp.load(by_dcp, checkpoint_id=f"{root}/ck", no_dist=True)
    _assert_same(by_dcp, want)
    into = {
        "sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
        **{f"r{i}": torch.zeros_like(t) for i, t in enumerate(replicated)},
        "step": 0,
    }
    ss.load(into, f"{root}/ck")
    assert torch.equal(into["sharded"].full_tensor(), full), rank
    _assert_same(
        {k: v for k, v in into.items() if k != "sharded"},
        {k: v for k, v in want.items() if k != "sharded"},
    )
    dist.barrier()


def test_ranks_each_stream_their_share_and_dcp_reads_the_whole(tmp_path):
    run_workers(_sharded_over_the_budget, 2, str(tmp_path), timeout=120)


def test_a_streamed_save_to_s3_loads_back(s3_bucket):
    """On an object store each part is copied into the upload once the upload reaches it
    (12 MiB in parts of 256 KiB, uploaded in 5 MiB multipart parts)."""
    budget = 1 << 20
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(3_000_000, generator=g), "m": torch.randn(500, 300).t(), "step": 4}
    url = f"s3://{s3_bucket}/budget"
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=budget))
    try:
        saver.save(state, url).upload_completion.result(120)
        assert 0 < saver.staging_peak_bytes <= budget
    finally:
        saver.close()
    got = _blank(state)
    ss.load(got, url)
    _assert_same(got, state)


class _WholeImageOnly(DataWriter):
    """A backend's writer from before ``write_at``: it takes whole images only."""

    def __init__(self, inner: DataWriter) -> None:
        self.inner, self.path = inner, inner.path

    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        return self.inner.pieces(piece_bytes)

    def write(self, start: int, end: int) -> None:
        self.inner.write(start, end)

    def append(self, data: memoryview, offset: int) -> None:
        self.inner.append(data, offset)

    def finish(self) -> None:
        self.inner.finish()

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()


class _WholeImageStorage(LocalStorage):
    def child(self, name: str) -> _WholeImageStorage:
        return _WholeImageStorage(self.path / name)

    def open_writer(self, name: str, image: memoryview | int) -> DataWriter:
        return _WholeImageOnly(super().open_writer(name, image))


def test_a_backend_without_write_at_refuses_a_streamed_save_naming_the_option(tmp_path):
    saver = CheckpointSaver(options=SaveOptions(staging_budget_bytes=BUDGET))
    try:
        storage = _WholeImageStorage(tmp_path / "ck")
        response = saver.save(_state(), storage)
        with pytest.raises(CheckpointError, match="_WholeImageOnly cannot .*staging_budget_bytes"):
            response.upload_completion.result(60)
        assert not (tmp_path / "ck" / ".metadata").exists()
        state = {"w": torch.ones(1000)}  # within the budget: written as a whole image
        saver.save(state, _WholeImageStorage(tmp_path / "small")).upload_completion.result(60)
    finally:
        saver.close()
    got = {"w": torch.zeros(1000)}
    ss.load(got, tmp_path / "small")
    assert torch.equal(got["w"], state["w"])
