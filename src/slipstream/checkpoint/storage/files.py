"""Small, careful file operations: whole reads and writes, fsync, atomic publish."""

from __future__ import annotations

import os

from ...errors import CheckpointError, CorruptCheckpointError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make ``path``'s bytes durable (the file only; :func:`fsync_dir` makes its name so)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either nothing or all of it."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise CheckpointError(f"could not write {path}: {exc}") from exc
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    """``os.pwrite`` until every byte is written; errors name the file."""
    done = 0
    while done < len(data):
        try:
            n = os.pwrite(fd, data[done:], offset + done)
        except OSError as exc:
            raise CheckpointError(
                f"writing {path} at offset {offset + done} failed: {exc}"
            ) from exc
        if n <= 0:
            raise CheckpointError(f"writing {path} at offset {offset + done} wrote nothing")
        done += n


def pread_into(fd: int, out: memoryview, offset: int, path: str) -> None:
    """Fill ``out`` from ``offset``; a short file raises :class:`CorruptCheckpointError`."""
    done = 0
    while done < len(out):
        try:
            n = os.preadv(fd, [out[done:]], offset + done)
        except OSError as exc:
            raise CheckpointError(
                f"reading {path} at offset {offset + done} failed: {exc}"
            ) from exc
        if n <= 0:
            raise CorruptCheckpointError(
                f"{path} is truncated: needed bytes up to offset {offset + len(out)}, "
                f"file ends at {offset + done}"
            )
        done += n
