"""Each bad input fails with an error naming what is at fault, and nothing half-done is
left looking committed."""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading
import time

import pytest
import torch
from checkpoint_states import small_state
from dist_utils import run_workers
from fault_storage import FaultStorage
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.format.names import METADATA_FILE, SPARE_DIR
from slipstream.checkpoint.format.safe_pickle import load_metadata
from slipstream.checkpoint.storage import LocalStorage, resolve_storage


def _state() -> dict:
    """A small state with a note, the value whose bytes a test corrupts."""
    return small_state(shape=(300, 200), note="hello")


def _blank() -> dict:
    return {"model": {"w": torch.zeros(300, 200), "b": torch.zeros(7)}, "step": 0, "note": ""}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ck"
    ss.save(_state(), path)
    return path


def _index(path) -> dict:
    return json.loads((path / ".slipstream.json").read_text())


def _flip(file, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_missing_key_is_named(saved):
    target = _blank()
    target["model"]["extra"] = torch.zeros(2)
    with pytest.raises(ss.CheckpointError, match=r"missing from the checkpoint: \['model.extra'\]"):
        ss.load(target, saved)


def test_unexpected_key_is_named_when_strict_and_skipped_otherwise(saved):
    target = _blank()
    del target["model"]["b"]
    with pytest.raises(ss.CheckpointError, match=r"unexpected keys .*\['model.b'\]"):
        ss.load(target, saved)
    ss.load(target, saved, strict=False)
    assert torch.equal(target["model"]["w"], _state()["model"]["w"])


def test_shape_mismatch_names_key_and_both_shapes(saved):
    target = _blank()
    target["model"]["w"] = torch.zeros(200, 300)
    with pytest.raises(ss.CheckpointError, match=r"shape mismatch for 'model.w'.*\[300, 200\]"):
        ss.load(target, saved)


def test_dtype_mismatch_names_key_and_both_dtypes(saved):
    target = _blank()
    target["model"]["b"] = torch.zeros(7, dtype=torch.float16)
    with pytest.raises(ss.CheckpointError, match=r"dtype mismatch for 'model.b'.*float32.*float16"):
        ss.load(target, saved)


def test_checkpoint_of_a_different_layout_is_refused_before_any_byte_lands(saved):
    target = {"model": {"w": torch.full((300, 100), 5.0), "b": torch.full((7,), 5.0)}}
    target.update(step=0, note="")
    with pytest.raises(ss.CheckpointError, match="shape mismatch for 'model.w'"):
        ss.load(target, saved)
    assert torch.equal(target["model"]["b"], torch.full((7,), 5.0))


def test_tensor_whose_saved_chunks_leave_a_gap_is_refused_before_any_byte_lands(saved):
    path = saved / ".metadata"
    metadata = load_metadata(path.read_bytes(), str(path))
    entry = metadata.state_dict_metadata["model.w"]
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([150, 200]))]
    path.write_bytes(pickle.dumps(metadata))
    target = _blank()
    target["model"]["w"].fill_(5.0)
    with pytest.raises(ss.CorruptCheckpointError, match=r"'model.w' hold 30000 of the 60000"):
        ss.load(target, saved)
    assert torch.equal(target["model"]["w"], torch.full((300, 200), 5.0))


def test_tensor_where_checkpoint_has_a_value_is_named(saved):
    target = _blank()
    target["step"] = torch.zeros(1)
    with pytest.raises(ss.CheckpointError, match="'step' is a tensor in the state dict"):
        ss.load(target, saved)


def test_corrupted_tensor_bytes_name_file_key_and_offset(saved):
    entry = _index(saved)["records"]["__0_0.distcp"]["model.w@0,0"]
    offset = entry["data_offset"] + 1000
    _flip(saved / "__0_0.distcp", offset)
    with pytest.raises(ss.CorruptCheckpointError) as info:
        ss.load(_blank(), saved)
    message = str(info.value)
    assert "__0_0.distcp" in message and "'model.w'" in message
    assert f"bytes {entry['data_offset']}-" in message


def test_corrupted_value_bytes_name_file_key_and_offset(saved):
    entry = _index(saved)["values"]["note"]
    _flip(saved / entry["file"], entry["offset"] + entry["length"] - 30)
    with pytest.raises(
        ss.CorruptCheckpointError, match=rf"value 'note' at offset {entry['offset']}"
    ):
        ss.load(_blank(), saved)


def test_truncated_data_file_names_the_file_and_the_first_key_cut_off(saved):
    entry = _index(saved)["records"]["__0_0.distcp"]["model.w@0,0"]
    os.truncate(saved / "__0_0.distcp", entry["offset"] + entry["length"] - 100)
    with pytest.raises(ss.CorruptCheckpointError) as info:
        ss.load(_blank(), saved)
    message = str(info.value)
    assert "__0_0.distcp is truncated" in message
    assert f"'model.w' is stored at offset {entry['offset']}" in message


def test_missing_data_file_is_named(saved):
    (saved / "__0_0.distcp").unlink()
    with pytest.raises(ss.CorruptCheckpointError, match=r"cannot open .*__0_0\.distcp"):
        ss.load(_blank(), saved)


def test_unreadable_metadata_is_reported_as_corrupt(saved):
    (saved / ".metadata").write_bytes(b"not a pickle at all")
    with pytest.raises(
        ss.CorruptCheckpointError, match=r"\.metadata: unreadable checkpoint metadata"
    ):
        ss.load(_blank(), saved)


def test_directory_without_metadata_is_not_a_committed_checkpoint(saved):
    (saved / ".metadata").unlink()
    with pytest.raises(
        ss.CheckpointError, match=r"not a committed checkpoint: it has no .metadata"
    ):
        ss.load(_blank(), saved)
    with pytest.raises(ss.CheckpointError, match="not a committed checkpoint"):
        ss.load(_blank(), saved.parent / "never_saved")


def test_unpicklable_value_is_named_and_nothing_is_written(tmp_path):
    state = _state()
    state["callback"] = lambda: None
    with pytest.raises(ss.CheckpointError, match=r"value 'callback' of type function"):
        ss.async_save(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _checkpointer_with_faults(root, **kwargs) -> tuple[ss.Checkpointer, FaultStorage]:
    """A ``Checkpointer`` on the local backend it would make for ``root`` itself
    (``reuse_files`` on), with faults injectable through the returned storage."""
    storage = FaultStorage(resolve_storage(root, spare_dir_name=SPARE_DIR))
    return ss.Checkpointer(storage, **kwargs), storage


def _full_disk_write(writer, name, start, end) -> None:
    """A data write failing on a full disk, raised as ``LocalDataWriter`` raises it."""
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    raise ss.CheckpointError(f"writing {writer.path} at offset {start} failed: {cause}") from cause


def _full_disk_put(storage, name, data) -> None:
    """An atomic put failing on a full disk, raised as ``LocalStorage`` raises it."""
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    path = os.path.join(storage.url, name)
    raise ss.CheckpointError(f"could not write {path}: {cause}") from cause


def test_full_disk_fails_naming_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    ck, storage = _checkpointer_with_faults(tmp_path, keep_last=1)
    with ck:
        ck.save(1, _state()).result(60)
        storage.faults.hook("write", _full_disk_write)
        response = ck.save(2, _state())
        with pytest.raises(ss.CheckpointError, match=r"step_2/__0_0.distcp.*No space left"):
            response.result(60)
        storage.faults.clear()
        assert not (tmp_path / "step_2" / ".metadata").exists()
        assert ck.steps() == [1]
        target = _blank()
        assert ck.load(target) == 1
        assert torch.equal(target["model"]["w"], _state()["model"]["w"])
        ck.save(3, _state()).result(60)
        assert ck.steps() == [3]
        assert not (tmp_path / "step_2").exists()


def test_full_disk_while_publishing_metadata_leaves_the_step_uncommitted(tmp_path):
    ck, storage = _checkpointer_with_faults(tmp_path, keep_last=1)
    with ck:
        ck.save(1, _state()).result(60)
        storage.faults.hook("put", _full_disk_put, when=lambda name: name == METADATA_FILE)
        with pytest.raises(ss.CheckpointError, match=r"could not write .*step_2/\.metadata"):
            ck.save(2, _state()).result(60)
        storage.faults.clear()
        assert ck.steps() == [1] and not (tmp_path / "step_2" / ".metadata").exists()
        assert ck.load(_blank()) == 1


def test_failed_write_waits_for_the_file_s_other_writes_before_closing_it(tmp_path):
    failed = threading.Event()
    fstat_after_failure: list[bool] = []

    def first_piece_fails(writer, name, start, end):
        # ``writer`` is the backend's own LocalDataWriter: its descriptor must stay open
        # (and be this file's) until every write of the file has returned.
        if start == 0:
            failed.set()
            raise ss.CheckpointError(f"writing {writer.path} at offset 0 failed: disk full")
        if failed.wait(10):
            time.sleep(0.05)  # room for a premature close of the file to happen
            try:
                fstat_after_failure.append(os.fstat(writer.fd).st_ino == os.stat(path).st_ino)
            except OSError:
                fstat_after_failure.append(False)

    path = tmp_path / "ck" / "__0_0.distcp"
    storage = FaultStorage(LocalStorage(tmp_path / "ck", direct_io=False))
    storage.faults.hook("write", first_piece_fails)
    saver = CheckpointSaver(options=SaveOptions(direct_io=False, write_piece_bytes=64 * 1024))
    try:
        response = saver.save(_state(), storage)
        with pytest.raises(ss.CheckpointError, match="disk full"):
            response.result(60)
    finally:
        saver.close()
    assert fstat_after_failure and all(fstat_after_failure)
    assert not (tmp_path / "ck" / ".metadata").exists()


def _rank0_disk_full(rank: int, world: int, root: str) -> None:
    """Rank 0's disk is full: ``os.pwrite`` fails there, below the storage seam on purpose,
    so the error every rank must report is the one ``LocalStorage`` itself makes of it
    (naming the file), not one a test backend would invent."""
    saver = CheckpointSaver(options=SaveOptions(timeout=30.0))
    try:
        state = {"w": torch.full((1000,), float(rank)), f"own{rank}": torch.zeros(3)}
        saver.save(state, os.path.join(root, "ok")).result(30)
        real_pwrite = os.pwrite
        if rank == 0:
            os.pwrite = _enospc
        try:
            response = saver.save(state, os.path.join(root, "full"))
            with pytest.raises(ss.CheckpointError) as info:
                response.result(30)
            assert not isinstance(info.value, ss.PeerTimeoutError), str(info.value)
            assert "__0_0.distcp" in str(info.value), str(info.value)
        finally:
            os.pwrite = real_pwrite
        saver.save(state, os.path.join(root, "after")).result(30)
    finally:
        saver.close()


def test_rank0_write_failure_fails_every_rank_at_once_naming_the_file(tmp_path):
    run_workers(_rank0_disk_full, 2, str(tmp_path), timeout=60)
    assert not (tmp_path / "full" / ".metadata").exists()
    target = {"w": torch.ones(1000), "own0": torch.ones(3), "own1": torch.ones(3)}
    ss.load(target, tmp_path / "after")
    assert torch.equal(target["w"], torch.zeros(1000))


def _one_rank_unpicklable_value(rank: int, world: int, root: str, bad_rank: int) -> None:
    # A timeout far beyond the test's own: the other rank must learn of the failure from
    # the failing rank, not by waiting for it.
    saver = CheckpointSaver(options=SaveOptions(timeout=45.0))
    try:
        state = {"w": torch.full((100,), 1.0)}
        saver.save(state, os.path.join(root, "first")).result(30)
        for name, first in (("new-layout", None), ("same-layout", {"hook": None})):
            if first is not None:  # the bad save reuses this save's plan: no planning
                saver.save(dict(state, **first), os.path.join(root, "warm")).result(30)
            bad = dict(state, hook=(lambda: None) if rank == bad_rank else None)
            if rank == bad_rank:
                with pytest.raises(ss.CheckpointError, match="value 'hook' of type function"):
                    saver.save(bad, os.path.join(root, name))
            else:
                with pytest.raises(ss.CheckpointError, match=rf"rank {bad_rank}: .*'hook'"):
                    saver.save(bad, os.path.join(root, name)).result(30)
        state["w"].add_(1)
        saver.save(state, os.path.join(root, "after")).result(30)
    finally:
        saver.close()


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_save_failing_on_one_rank_s_thread_fails_the_others_at_once_and_keeps_them_in_step(
    tmp_path, bad_rank
):
    run_workers(_one_rank_unpicklable_value, 2, str(tmp_path), bad_rank, timeout=40)
    for name in ("new-layout", "same-layout"):
        assert not (tmp_path / name / ".metadata").exists()
    target = {"w": torch.zeros(100)}
    ss.load(target, tmp_path / "after")
    assert torch.equal(target["w"], torch.full((100,), 2.0))
