"""``memory://name/prefix``: an object store in this process's memory.

Every location naming the same ``name`` shares one :class:`_Bucket`, so a save and a later
load in one process see the same objects; nothing is installed for it and nothing leaves
the process. It behaves as an object store: objects appear whole when their writer
finishes or their put returns, and a location is a key prefix.

Invariants:

* A data object's bytes are copied from the staging image as its pieces are written (in
  parallel, without the GIL); the image is not referenced once ``finish`` returns.
* The buffer of a deleted or replaced data object goes to its bucket's pool and is
  written over by a later writer of the same size, instead of fresh memory being faulted
  in for every save. A reader that raced with the deletion and read a recycled buffer
  fails its checksum check (slipstream verifies every byte it loads) and is told that the
  checkpoint was deleted meanwhile; it never loads wrong bytes silently.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ...core.copy import copy_bytes
from ...errors import CheckpointError, CorruptCheckpointError
from .base import DataWriter, Storage

POOLED_BUFFERS = 8
"""Freed data buffers a bucket keeps for reuse, at most."""


@dataclass
class _Object:
    """An object's bytes: a head buffer (a data object's image) and a tail appended to it."""

    head: bytearray
    tail: bytes = b""

    @property
    def size(self) -> int:
        return len(self.head) + len(self.tail)

    def read(self, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)``, without a copy where they lie in one part."""
        split = len(self.head)
        if offset + length <= split:
            return memoryview(self.head)[offset : offset + length]
        if offset >= split:
            return memoryview(self.tail)[offset - split : offset - split + length]
        whole = bytes(self.head[offset:]) + self.tail[: offset + length - split]
        return memoryview(whole)


@dataclass
class _Bucket:
    objects: dict[str, _Object] = field(default_factory=dict)
    pool: list[bytearray] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def buffer(self, nbytes: int) -> bytearray:
        """A buffer of ``nbytes``: a pooled one of that size, else a new one."""
        with self.lock:
            for i, buf in enumerate(self.pool):
                if len(buf) == nbytes:
                    return self.pool.pop(i)
        return bytearray(nbytes)

    def recycle(self, buf: bytearray) -> None:
        if len(buf):
            with self.lock:
                self.pool.append(buf)
                del self.pool[:-POOLED_BUFFERS]

    def put(self, key: str, obj: _Object) -> None:
        with self.lock:
            old = self.objects.get(key)
            self.objects[key] = obj
        if old is not None and old.head is not obj.head:
            self.recycle(old.head)

    def remove(self, keys: list[str]) -> None:
        with self.lock:
            gone = [self.objects.pop(k) for k in keys if k in self.objects]
        for obj in gone:
            self.recycle(obj.head)


_buckets: dict[str, _Bucket] = {}
_buckets_lock = threading.Lock()


def _bucket(name: str) -> _Bucket:
    with _buckets_lock:
        return _buckets.setdefault(name, _Bucket())


class MemoryStorage(Storage):
    """A prefix of an in-process bucket; see the module docstring."""

    small_reads_are_cheap = False

    def __init__(self, url: str) -> None:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() != "memory":
            raise CheckpointError(f"{url}: not a memory:// URL")
        name, _, prefix = rest.partition("/")
        self.name = name
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.url = f"memory://{name}" + (f"/{self.prefix}" if self.prefix else "")
        self._bucket = _bucket(name)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _object(self, name: str) -> _Object | None:
        with self._bucket.lock:
            return self._bucket.objects.get(self._key(name))

    def child(self, name: str) -> MemoryStorage:
        return MemoryStorage(self._where(name.strip("/")))

    def object_names(self) -> list[str]:
        """Every object under this location, at any depth, relative to it and sorted: what
        a save left in the bucket (an object store's own listing, for memory://)."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        with self._bucket.lock:
            return sorted(k[len(prefix) :] for k in self._bucket.objects if k.startswith(prefix))

    def prepare(self) -> None:
        return None

    def open_writer(self, name: str, image: memoryview | int) -> DataWriter:
        return _MemoryWriter(self, name, image)

    def read(self, name: str, offset: int, length: int) -> memoryview:
        obj = self._object(name)
        end = offset + length
        if obj is None:
            raise CorruptCheckpointError(
                f"{self._where(name)} is missing (reading {offset}..{end})"
            )
        if end > obj.size:
            raise CorruptCheckpointError(
                f"{self._where(name)} is truncated: needed bytes up to offset {end}, object "
                f"ends at {obj.size}"
            )
        return obj.read(offset, length)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        if len(out):
            copy_bytes(out, self.read(name, offset, len(out)))

    def size(self, name: str) -> int:
        obj = self._object(name)
        if obj is None:
            raise CorruptCheckpointError(f"{self._where(name)} does not exist")
        return obj.size

    def get(self, name: str) -> bytes | None:
        obj = self._object(name)
        return None if obj is None else bytes(obj.head) + obj.tail

    def put_atomic(self, name: str, data: bytes) -> None:
        self._bucket.put(self._key(name), _Object(bytearray(data)))

    def exists(self, name: str) -> bool:
        return self._object(name) is not None

    def list_children(self) -> list[str]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        with self._bucket.lock:
            keys = [k[len(prefix) :] for k in self._bucket.objects if k.startswith(prefix)]
        return sorted({k.split("/", 1)[0] for k in keys if "/" in k})

    def delete(self, name: str) -> None:
        self._bucket.remove([self._key(name)])

    def delete_all(self) -> None:
        """Delete every object under this prefix; refuses a location without one."""
        if not self.prefix:
            raise CheckpointError(f"refusing to delete everything in {self.url}: no prefix")
        prefix = f"{self.prefix}/"
        with self._bucket.lock:
            keys = [k for k in self._bucket.objects if k.startswith(prefix)]
        self._bucket.remove(keys)


class _MemoryWriter(DataWriter):
    """Copies the image's pieces into a (pooled) buffer as they are written; the object
    appears, image and appended tail, when :meth:`finish` returns."""

    def __init__(self, storage: MemoryStorage, name: str, image: memoryview | int) -> None:
        self.path = storage._where(name)
        self._storage = storage
        self._name = name
        self._image = memoryview(b"" if isinstance(image, int) else image).cast("B")
        self._size = image if isinstance(image, int) else len(self._image)
        self._buffer: bytearray | None = storage._bucket.buffer(self._size)
        self._written: list[tuple[int, int]] = []
        self._tail: list[bytes] = []
        self._end = self._size
        self._lock = threading.Lock()
        self._published = False

    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        n = self._size
        step = max(1, piece_bytes)
        return [(start, min(start + step, n)) for start in range(0, n, step)]

    def write(self, start: int, end: int) -> None:
        self.write_at(start, self._image[start:end])

    def write_at(self, offset: int, data: memoryview) -> None:
        end = offset + len(data)
        if not 0 <= offset < end <= self._size or self._buffer is None:
            raise CheckpointError(f"{self.path}: write of [{offset}, {end}) outside the image")
        copy_bytes(memoryview(self._buffer)[offset:end], memoryview(data).cast("B"))
        with self._lock:
            self._written.append((offset, end))

    def append(self, data: memoryview, offset: int) -> None:
        if offset != self._end:
            raise CheckpointError(
                f"{self.path}: append at offset {offset}, but the object ends at {self._end}; "
                "an object store writes the tail contiguously"
            )
        self._tail.append(bytes(data))
        self._end += len(data)

    def finish(self) -> None:
        covered = 0
        for start, end in sorted(self._written):
            if start != covered:
                break
            covered = end
        if covered != self._size or self._buffer is None:
            raise CheckpointError(
                f"{self.path}: finished with the bytes at offset {covered} never written"
            )
        obj = _Object(self._buffer, b"".join(self._tail))
        self._storage._bucket.put(self._storage._key(self._name), obj)
        self._buffer = None
        self._published = True

    def abort(self) -> None:
        if self._buffer is not None:
            self._storage._bucket.recycle(self._buffer)
            self._buffer = None
        if self._published:
            self._storage.delete(self._name)
            self._published = False

    def close(self) -> None:
        if not self._published:
            self.abort()
