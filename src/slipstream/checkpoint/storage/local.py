"""The local filesystem as a :class:`Storage`: ``O_DIRECT`` writes, file reuse, fsync.

A location is a directory. Data files are written in place with ``pwrite`` from the
staging image (see :class:`LocalDataWriter`); small objects are written to a temporary
name, fsync'd and renamed, and the directory fsync'd after, so that they appear whole.
Retired data files may be kept aside for later writes to reuse (see :mod:`.recycle`).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

from ...core.buffers import PAGE_BYTES
from ...errors import CheckpointError, CorruptCheckpointError
from .base import DataWriter, Storage
from .files import pread_into, pwrite_all, write_atomic
from .recycle import claim, discard_spares, retire


class LocalStorage(Storage):
    """A directory on a local (or mounted) filesystem.

    ``spare_dir``, when given, is where retired data files wait for reuse: deleting a
    location moves its data files there (where nothing else has them open), and a writer
    whose file does not exist yet writes over the spare of the same name.

    ``read_once``: the file system is shared by the job's hosts (NFS, Lustre, a parallel
    file system), so replicas on different hosts split the bytes they share
    (:attr:`~.base.Storage.splits_shared_reads`); by default each rank reads what it needs,
    and one host's ranks share the page cache.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        spare_dir: Path | None = None,
        direct_io: bool = True,
        read_once: bool = False,
    ) -> None:
        self.path = Path(path)
        self.url = os.fspath(path)
        self.spare_dir = spare_dir
        self.direct_io = direct_io
        self.splits_shared_reads = read_once
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(
            self.path / name,
            spare_dir=self.spare_dir,
            direct_io=self.direct_io,
            read_once=self.splits_shared_reads,
        )

    def prepare(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {self.url}: {exc}") from exc

    def open_writer(self, name: str, image: memoryview | int) -> LocalDataWriter:
        path = self._file(name)
        if self.spare_dir is not None:
            claim(self.spare_dir, name, path)
        return LocalDataWriter(path, image, self.direct_io)

    def _fd(self, name: str) -> int:
        with self._fds_lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self._file(name)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise CorruptCheckpointError(f"cannot open {path}: {exc}") from exc
                self._fds[name] = fd
            return fd

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        pread_into(self._fd(name), out, offset, self._file(name))

    def size(self, name: str) -> int:
        return os.fstat(self._fd(name)).st_size

    def get(self, name: str) -> bytes | None:
        try:
            with open(self._file(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put_atomic(self, name: str, data: bytes) -> None:
        write_atomic(self._file(name), data)

    def exists(self, name: str) -> bool:
        return os.path.isfile(self._file(name))

    def list_children(self) -> list[str]:
        try:
            return [e.name for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def delete(self, name: str) -> None:
        try:
            os.remove(self._file(name))
        except FileNotFoundError:
            pass

    def delete_all(self) -> None:
        if not self.path.exists():
            return
        if self.spare_dir is None:
            shutil.rmtree(self.path)
        else:
            retire(self.path, self.spare_dir)

    def discard_spares(self) -> None:
        if self.spare_dir is not None:
            discard_spares(self.spare_dir)

    def close(self) -> None:
        with self._fds_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class LocalDataWriter(DataWriter):
    """One rank's data file being written from a page-aligned staging image.

    With ``direct`` the page-aligned bulk of the image goes through an ``O_DIRECT``
    descriptor: the disk reads the staging buffer itself, so the CPU neither copies the
    bytes into the page cache nor flushes them later (the training loop keeps its cores).
    The unaligned tail and the appended records go through an ordinary descriptor. Where
    the filesystem refuses ``O_DIRECT``, everything is written the ordinary way and handed
    to write-back piece by piece.

    A file left by an older save is written over in place, and cut to its new length only
    in :meth:`finish`: writing into blocks the file already holds spares the filesystem
    freeing and allocating them again (see docs/save-cost.md). The older bytes are never
    readable as part of a checkpoint: the location is uncommitted before the first write.
    """

    def __init__(self, path: str, image: memoryview | int, direct: bool) -> None:
        self.path = path
        self.image = memoryview(b"") if isinstance(image, int) else image
        self.size = image if isinstance(image, int) else len(image)
        self.end = self.size
        """Where this save's bytes end: the image, then whatever was appended after it."""
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CheckpointError(f"cannot create {path}: {exc}") from exc
        self.direct_fd = -1
        self.direct_end = 0
        if direct and hasattr(os, "O_DIRECT") and self.size >= PAGE_BYTES:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
                self.direct_end = self.size // PAGE_BYTES * PAGE_BYTES
            except OSError:
                self.direct_fd = -1

    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges of the image to write in parallel (page-aligned where direct).

        A rank with no tensor records (everything it holds is written by others) has an
        empty image and no pieces.
        """
        if not self.size:
            return []
        cuts = list(range(0, self.size, piece_bytes))
        if self.direct_end and self.direct_end not in cuts:
            cuts.append(self.direct_end)
        cuts = sorted(set(cuts))
        return [(a, b) for a, b in zip(cuts, cuts[1:] + [self.size], strict=True) if b > a]

    def write(self, start: int, end: int) -> None:
        self.write_at(start, self.image[start:end])

    def write_at(self, offset: int, data: memoryview) -> None:
        """``pwrite`` of ``data``, through the ``O_DIRECT`` descriptor where it lies in the
        image's page-aligned bulk (``data`` then starts on a page: staging buffers do)."""
        end = offset + len(data)
        if end <= self.direct_end and offset % PAGE_BYTES == 0:
            try:
                pwrite_all(self.direct_fd, data, offset, self.path)
                return
            except CheckpointError as exc:
                if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno != errno.EINVAL:
                    raise
        pwrite_all(self.fd, data, offset, self.path)
        os.posix_fadvise(self.fd, offset, len(data), os.POSIX_FADV_DONTNEED)

    def append(self, data: memoryview, offset: int) -> None:
        pwrite_all(self.fd, data, offset, self.path)
        self.end = max(self.end, offset + len(data))

    def finish(self) -> None:
        """Cut the file where this save's bytes end (what an older, longer file leaves past
        them goes) and make it durable."""
        try:
            os.ftruncate(self.fd, self.end)
            os.fsync(self.fd)
        except OSError as exc:
            raise CheckpointError(f"finishing {self.path} failed: {exc}") from exc

    def abort(self) -> None:
        """Delete the partial file, giving its space back at once."""
        try:
            os.remove(self.path)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
