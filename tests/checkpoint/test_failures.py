"""A save that fails, at any point and on any backend, never costs the last good checkpoint
and leaves nothing of its own behind.

Backends: the local disk with faults raised by the operating system calls themselves
(``os.pwrite``/``os.fsync`` patched to fail for one file), so that ``LocalStorage``'s own
error handling runs; the local disk through the storage seam (:class:`FaultStorage`);
``s3://`` on moto's S3 server; ``memory://``. Every check compares against the tensors
saved and lists what is really at the location (directory entries, bucket objects,
unfinished multipart uploads).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from checkpoint_states import small_state
from dist_utils import run_workers, wait_for_key
from fault_storage import Faults, FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.format.names import METADATA_FILE, SPARE_DIR
from slipstream.checkpoint.storage import LocalStorage, MemoryStorage, Storage, resolve_storage

OLD_FILES = [".metadata", ".slipstream.json", "__0_0.distcp"]
"""A checkpoint saved into an empty location (generation 0)."""
NEXT_FILES = [".metadata", ".slipstream.g1.json", "__0_0.g1.distcp"]
"""The same location after one more save over it (generation 1)."""


def _state(step: int) -> dict:
    """The step's small state with a note naming the step: a value that is not a tensor."""
    return small_state(step, note=f"step {step}")


def _blank() -> dict:
    return {"model": {"w": torch.zeros(96, 64), "b": torch.zeros(7)}, "step": -1, "note": ""}


def _assert_state(got: dict, step: int) -> None:
    want = _state(step)
    assert got["step"] == step and got["note"] == want["note"], (got["step"], step)
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), (step, name)


def _loads_as(location, step: int) -> None:
    got = _blank()
    ss.load(got, location)
    _assert_state(got, step)


def _enospc(where: str) -> ss.CheckpointError:
    """A full disk, as a backend reports it: a ``CheckpointError`` naming the object, caused
    by ``OSError(ENOSPC)``."""
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    error = ss.CheckpointError(f"could not write {where}: {cause}")
    error.__cause__ = cause
    return error


# -- where checkpoints go -----------------------------------------------------------------

FAULT_POINTS = ["write", "finish", "put-index", "put-metadata"]
"""Where a save fails: a data write, making the data file durable, the atomic put of
slipstream's index, the atomic put of ``.metadata`` (the commit point)."""

_SEAM_FAULTS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "write": ("write", lambda name: True),
    "finish": ("finish", lambda name: True),
    "put-index": ("put", lambda name: name.startswith(".slipstream")),
    "put-metadata": ("put", lambda name: name == METADATA_FILE),
}


def _fail_through_the_seam(faults: Faults, point: str, url: str) -> None:
    operation, when = _SEAM_FAULTS[point]

    def raise_enospc(target, name, *args) -> None:
        raise _enospc(f"{url}/{name}")

    faults.hook(operation, raise_enospc, when=when)


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@contextlib.contextmanager
def _fail_in_the_os(point: str, directory: str) -> Iterator[None]:
    """Make the system call behind ``point`` fail with ENOSPC for the files in ``directory``
    that ``point`` concerns, as a full disk would; the backend's own code handles it.

    Deliberately below the storage seam: this tests ``LocalStorage``'s handling of the
    operating system's errors, which a :class:`FaultStorage` wrapped around it would skip."""

    def hit(fd: int) -> bool:
        path = _fd_path(fd)
        name = os.path.basename(path)
        if os.path.dirname(path) != directory:
            return False
        return {
            "write": name.endswith(".distcp"),
            "finish": name.endswith(".distcp"),
            "put-index": name.startswith(".slipstream") and name.endswith(".tmp"),
            "put-metadata": name == METADATA_FILE + ".tmp",
        }[point]

    def full() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.MonkeyPatch.context() as patch:
        if point == "write":
            real_pwrite = os.pwrite

            def pwrite(fd, data, offset):
                if hit(fd):
                    raise full()
                return real_pwrite(fd, data, offset)

            patch.setattr(os, "pwrite", pwrite)
        else:
            real_fsync = os.fsync

            def fsync(fd):
                if hit(fd):
                    raise full()
                return real_fsync(fd)

            patch.setattr(os, "fsync", fsync)
        yield


def _object_names(storage: Storage) -> list[str]:
    """Every object under an object store location's prefix, relative to it (listed with
    boto3, a client of its own, for S3; from the bucket itself for memory://)."""
    inner = storage.inner if isinstance(storage, FaultStorage) else storage
    cut = len(inner.prefix) + 1
    if isinstance(inner, MemoryStorage):
        return inner.object_names()
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2")
    listing = pages.paginate(Bucket=inner.bucket, Prefix=inner.prefix + "/")
    keys = [o["Key"] for page in listing for o in page.get("Contents", [])]
    return sorted(k[cut:] for k in keys if k.startswith(inner.prefix + "/"))


def _s3_uploads(bucket: str) -> list[str]:
    import boto3

    listing = boto3.client("s3").list_multipart_uploads(Bucket=bucket)
    return [upload["Key"] for upload in listing.get("Uploads", [])]


@dataclass
class Where:
    """A checkpoint location on one backend, with its faults and what is stored there."""

    kind: str
    target: object
    """What ``ss.save``/``ss.load`` are given: a path, or a :class:`FaultStorage`."""
    names: Callable[[], list[str]]
    """The files or objects at the location, sorted."""
    uploads: Callable[[], list[str]] = list
    """Unfinished multipart uploads (S3 only)."""
    directory: str | None = None

    def faulty(self, point: str) -> contextlib.AbstractContextManager:
        if self.kind == "local":
            return _fail_in_the_os(point, self.directory)
        return self._seam(point)

    @contextlib.contextmanager
    def _seam(self, point: str) -> Iterator[None]:
        _fail_through_the_seam(self.target.faults, point, self.target.url)
        try:
            yield
        finally:
            self.target.faults.clear()


@pytest.fixture(params=["local", "seam", "s3", "memory"])
def where(request, tmp_path) -> Where:
    kind = request.param
    if kind in ("local", "seam"):
        directory = str(tmp_path / "ck")

        def names() -> list[str]:
            return sorted(os.listdir(directory)) if os.path.isdir(directory) else []

        target = directory if kind == "local" else FaultStorage(LocalStorage(directory))
        return Where(kind, target, names, directory=directory)
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        storage = FaultStorage(resolve_storage(f"s3://{bucket}/ck"))
        return Where(kind, storage, lambda: _object_names(storage), lambda: _s3_uploads(bucket))
    storage = FaultStorage(resolve_storage(f"memory://test-{uuid.uuid4().hex[:8]}/ck"))
    return Where(kind, storage, lambda: _object_names(storage))


# -- a failed save over a committed checkpoint --------------------------------------------


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_nothing_of_its_own(where, point):
    ss.save(_state(1), where.target)
    assert where.names() == OLD_FILES

    with where.faulty(point), pytest.raises(ss.CheckpointError, match="No space left"):
        ss.save(_state(2), where.target)

    assert where.names() == OLD_FILES, "the failed save left files behind or took old ones"
    assert where.uploads() == [], "the failed save left a multipart upload behind"
    _loads_as(where.target, 1)
    # the location still takes saves: the next one replaces the old checkpoint whole
    ss.save(_state(3), where.target)
    _loads_as(where.target, 3)
    assert where.names() == NEXT_FILES


@pytest.mark.parametrize("point", ["write", "put-metadata"])
def test_a_failed_save_beside_a_generation_1_checkpoint_removes_only_its_own_files(tmp_path, point):
    """The committed checkpoint uses generation 1's names; the failed save writes (and
    must remove) generation 0's, and must not touch the committed ones."""
    storage = FaultStorage(LocalStorage(tmp_path / "ck"))
    ss.save(_state(1), storage)
    ss.save(_state(2), storage)
    assert sorted(os.listdir(tmp_path / "ck")) == NEXT_FILES
    _fail_through_the_seam(storage.faults, point, storage.url)
    with pytest.raises(ss.CheckpointError, match="No space left"):
        ss.save(_state(3), storage)
    storage.faults.clear()
    written = {"write": ["open"], "put-metadata": ["open", "put"]}[point]
    assert set(written) <= {op for op, _, _ in storage.faults.calls}
    assert "__0_0.distcp" in storage.faults.names("open")
    assert sorted(os.listdir(tmp_path / "ck")) == NEXT_FILES
    _loads_as(storage, 2)


def _save_then_die_mid_write(rank: int, world: int, url: str) -> None:
    storage = FaultStorage(resolve_storage(url))

    def write_then_die(writer, name, start, end) -> None:
        writer.write(start, end)  # some of the new save's bytes reach the store
        os.kill(os.getpid(), signal.SIGKILL)

    storage.faults.hook("write", write_then_die)
    ss.save(_state(2), storage)
    raise AssertionError("the saving process survived its own SIGKILL")


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigkill_mid_write_over_a_checkpoint_keeps_it_loadable(tmp_path, backend, request):
    if backend == "local":
        url = str(tmp_path / "ck")
        names = lambda: sorted(os.listdir(url))  # noqa: E731
    else:
        url = f"s3://{request.getfixturevalue('s3_bucket')}/ck"
        storage = resolve_storage(url)
        names = lambda: _object_names(storage)  # noqa: E731
    ss.save(_state(1), url)
    metadata = resolve_storage(url).get(METADATA_FILE)
    run_workers(_save_then_die_mid_write, 1, url, timeout=60, killed=(0,))
    assert resolve_storage(url).get(METADATA_FILE) == metadata
    if backend == "local":  # the kill did land mid-save: its data file is there, uncommitted
        assert names() == sorted(OLD_FILES + ["__0_0.g1.distcp"])
    _loads_as(url, 1)
    ss.save(_state(3), url)
    _loads_as(url, 3)
    assert names() == NEXT_FILES


# -- clean-up at failure ------------------------------------------------------------------


@pytest.mark.parametrize("fail_at", ["write", "finish"])
def test_a_failed_save_removes_its_partial_data_file_before_returning(tmp_path, fail_at):
    directory = tmp_path / "ck"
    ss.save(_state(1), directory)
    state = dict(_state(2), big=torch.randn(256 * 1024))  # 1 MiB: 16 pieces
    data_file = directory / "__0_0.g1.distcp"
    seen: list[int] = []

    def fail_late(writer, name, *args) -> None:
        if fail_at == "write" and args[0] < 512 * 1024:
            return  # earlier pieces land
        time.sleep(0.05)
        seen.append(os.path.getsize(data_file))
        raise _enospc(writer.path)

    storage = FaultStorage(LocalStorage(directory))
    storage.faults.hook(fail_at, fail_late)
    saver = CheckpointSaver(options=SaveOptions(write_piece_bytes=64 * 1024))
    try:
        with pytest.raises(ss.CheckpointError, match="No space left"):
            saver.save(state, storage).result(60)
    finally:
        saver.close()
    assert seen and max(seen) > 0, "the failed save had written nothing"
    assert not data_file.exists(), "the failed save's partial data file is still there"
    assert sorted(os.listdir(directory)) == OLD_FILES
    _loads_as(directory, 1)


def _commit_fails_on_rank0(rank: int, world: int, root: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    directory = os.path.join(root, "ck")
    state = {"w": torch.full((4096,), float(rank)), f"own{rank}": torch.zeros(3)}
    ss.save(state, directory)
    old = sorted(os.listdir(directory))
    dist.barrier()  # both ranks have listed the old checkpoint before the next save starts
    target = directory
    if rank == 0:
        target = FaultStorage(LocalStorage(directory))
        _fail_through_the_seam(target.faults, "put-metadata", directory)
    state["w"].add_(10)
    with pytest.raises(ss.CheckpointError, match="No space left"):
        ss.save(state, target)
    store.set(f"test/failed/{rank}", "1")
    wait_for_key(store, f"test/failed/{1 - rank}", 30, "the other rank's save to fail")
    # both ranks' saves have failed, and no save has started since
    now = sorted(os.listdir(directory))
    assert now == old == [".metadata", ".slipstream.json", "__0_0.distcp", "__1_0.distcp"], (
        rank,
        old,
        now,
    )
    got = {"w": torch.zeros(4096), "own0": torch.ones(3), "own1": torch.ones(3)}
    ss.load(got, directory)
    assert torch.equal(got["w"], torch.zeros(4096))


def test_a_failed_commit_removes_every_rank_s_data_file_at_once(tmp_path):
    run_workers(_commit_fails_on_rank0, 2, str(tmp_path), timeout=60)


@pytest.mark.parametrize("syscall", ["fsync", "replace"])
def test_a_failed_atomic_put_leaves_no_tmp_file(tmp_path, monkeypatch, syscall):
    """``LocalStorage.put_atomic`` itself, below the storage seam: the system call it
    makes fails, as on a full disk, and its own clean-up must run."""
    storage = LocalStorage(tmp_path)
    storage.put_atomic(METADATA_FILE, b"old")
    real = getattr(os, syscall)

    def fail(*args):
        if syscall == "replace" or _fd_path(args[0]).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(os, syscall, fail)
    with pytest.raises(ss.CheckpointError, match="No space left"):
        storage.put_atomic(METADATA_FILE, b"new")
    monkeypatch.undo()
    assert storage.get(METADATA_FILE) == b"old"
    assert sorted(os.listdir(tmp_path)) == [METADATA_FILE]


# -- the fault matrix ---------------------------------------------------------------------

MATRIX_OPERATIONS = ["write", "finish", "put-metadata", "list", "delete", "read"]


def _matrix_fault(faults: Faults, operation: str, url: str) -> None:
    """Make ``operation`` fail as the local backend would fail it: data and atomic writes
    and reads with a ``CheckpointError`` (EIO), listing and deleting with a raw ``OSError``
    (``LocalStorage`` lets those through)."""

    def raise_eio(target, name, *args) -> None:
        cause = OSError(errno.EIO, os.strerror(errno.EIO))
        if operation in ("list", "delete"):
            raise cause
        error = ss.CheckpointError(f"{operation} of {url}/{name} failed: {cause}")
        error.__cause__ = cause
        raise error

    if operation == "put-metadata":
        faults.hook("put", raise_eio, when=lambda name: name == METADATA_FILE)
    else:
        faults.hook(operation, raise_eio)


def _checkpointer_root(backend: str, tmp_path) -> tuple[str, Storage]:
    if backend == "local":
        root = str(tmp_path / "run")
        return root, resolve_storage(root, spare_dir_name=SPARE_DIR)
    root = f"memory://matrix-{uuid.uuid4().hex[:8]}/run"
    return root, resolve_storage(root)


def _check_committed(root: str, committed: list[int], keep_last: int) -> list[int]:
    """Read ``root`` back without faults: every listed step loads and equals what was saved
    for it, only steps whose save reported success are listed, and the newest
    ``keep_last`` of those are all listed. Returns the listed steps."""
    with ss.Checkpointer(root) as reader:
        steps = reader.steps()
        for step in steps:
            got = _blank()
            reader.load(got, step=step)
            _assert_state(got, step)
    assert set(steps) <= set(committed), f"listed {steps}; saves that succeeded {committed}"
    assert committed[-keep_last:] == steps[-keep_last:], (committed, steps)
    return steps


@pytest.mark.parametrize("backend", ["local", "memory"])
@pytest.mark.parametrize("operation", MATRIX_OPERATIONS)
def test_fault_matrix_commits_nothing_incomplete_and_loses_nothing_committed(
    tmp_path, backend, operation
):
    """Steps 1 and 2 commit; step 3 is saved (and step 2 loaded) while ``operation``
    fails; step 4 is saved after. After step 3 and again after step 4, read back without
    faults: every listed step loads and equals what was saved for it, a step is listed
    only if its save reported success, and the newest ``keep_last`` steps that committed
    are all listed. At the end no location of an unlisted step is left behind."""
    keep_last = 2
    root, inner = _checkpointer_root(backend, tmp_path)
    storage = FaultStorage(inner)
    committed: list[int] = []
    with ss.Checkpointer(storage, keep_last=keep_last) as ck:
        for step in (1, 2):
            ck.save(step, _state(step)).result(30)
            committed.append(step)

        _matrix_fault(storage.faults, operation, root)
        response = ck.save(3, _state(3))  # on_error="log": never raises into the loop
        error = response.upload_completion.exception(30)
        assert error is None or isinstance(error, ss.CheckpointError), repr(error)
        if error is None:
            committed.append(3)
        if operation == "read":
            with pytest.raises(ss.CheckpointError, match="read of"):
                ck.load(_blank(), step=2)
        storage.faults.clear()
        assert error is not None or operation in ("list", "delete", "read"), (
            f"a save whose {operation} failed reported success"
        )
        _check_committed(root, committed, keep_last)

        ck.save(4, _state(4)).result(30)
        committed.append(4)

    steps = _check_committed(root, committed, keep_last)
    assert steps[-1] == 4
    leftovers = {n for n in inner.list_children() if n != SPARE_DIR}
    assert leftovers == {f"step_{s}" for s in steps}, leftovers


def _rank0_dies_right_after_publishing(rank: int, world: int, root: str) -> None:
    """Rank 0 publishes ``.metadata`` and is killed before it can tell rank 1 (the store,
    which rank 0 hosts, dies with it): rank 1's save fails, and it must keep its file."""
    directory = os.path.join(root, "ck")
    saver = CheckpointSaver()
    try:
        state = {f"own{rank}": torch.full((1000,), float(rank + 1))}
        after_commit = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if rank == 0 else None
        response = saver.save(state, directory, after_commit=after_commit)
        with pytest.raises(ss.SlipstreamError):
            response.result(60)
        assert os.path.exists(os.path.join(directory, "__1_0.distcp"))
    finally:
        saver.close()


def test_a_rank_that_cannot_hear_the_commit_keeps_its_committed_file(tmp_path):
    run_workers(_rank0_dies_right_after_publishing, 2, str(tmp_path), timeout=90, killed=(0,))
    target = {"own0": torch.zeros(1000), "own1": torch.zeros(1000)}
    ss.load(target, tmp_path / "ck")
    assert torch.equal(target["own0"], torch.full((1000,), 1.0))
    assert torch.equal(target["own1"], torch.full((1000,), 2.0))
