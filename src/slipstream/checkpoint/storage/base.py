"""The storage seam: what checkpoint code needs of a store, and nothing more.

A :class:`Storage` is one location (a local directory, or a prefix in an object store).
Names passed to its methods are ``/``-separated and relative to that location. The
checkpoint code above it (staging, writer, reader, commit, the ``Checkpointer``) never
touches a file or a client itself, so a new store is one class (see docs/storage.md).

Invariants every backend keeps:

* :meth:`Storage.put_atomic` makes an object appear whole or not at all: a reader sees
  the old object (or none) until the new one is complete.
* A :class:`DataWriter`'s bytes are visible under their name only once :meth:`DataWriter.finish`
  has returned (object stores) or are never read before the commit that follows it
  (the local disk, where the checkpoint is uncommitted while it is written).
* :meth:`Storage.read_into` fills the whole buffer or raises
  :class:`~slipstream.CorruptCheckpointError` naming the object and the offset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ...errors import CheckpointError


class DataWriter(ABC):
    """One rank's data object being written from a staging image, in pieces, in parallel.

    ``write`` may be called from several threads at once, each for a different piece of
    :meth:`pieces` (``write_at`` instead, for each part of an image not held whole);
    ``append`` is called from one thread after every piece is queued; then ``finish``
    once every write has returned. ``abort`` undoes a writer that will not
    finish (nothing of it stays visible); ``close`` releases what it holds either way.
    """

    path: str
    """Where the data goes, for messages."""

    @abstractmethod
    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges of the image, about ``piece_bytes`` each, that cover it in order."""

    @abstractmethod
    def write(self, start: int, end: int) -> None:
        """Write the image's bytes ``[start, end)`` (one range of :meth:`pieces`)."""

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` inside the image's span: for an image staged a part at
        a time through a bounded buffer rather than held whole (``open_writer`` given its
        size only). ``data`` may be reused as soon as this returns; parts may come from
        several threads at once, in any order. A backend without it cannot take a save
        larger than ``SaveOptions.staging_budget_bytes``."""
        raise CheckpointError(
            f"{self.path}: {type(self).__name__} cannot write an image a part at a time "
            "(DataWriter.write_at), so it cannot take a save larger than "
            "SaveOptions.staging_budget_bytes"
        )

    @abstractmethod
    def append(self, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset``, at or past the end of the image."""

    @abstractmethod
    def finish(self) -> None:
        """Make everything written durable; the object ends where the last byte written does."""

    def abort(self) -> None:
        """Give up on this object: whatever it wrote is removed (best effort)."""
        return None

    def close(self) -> None:
        """Release the writer's resources (after ``finish`` or ``abort``)."""
        return None

    def __enter__(self) -> DataWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Storage(ABC):
    """A place checkpoints live in; see the module docstring for the invariants."""

    url: str
    """This location as the user would write it (a path or ``scheme://...``), for messages."""

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The location ``name`` under this one (a step of a ``Checkpointer``)."""

    @abstractmethod
    def prepare(self) -> None:
        """Make this location ready to write into (create a directory; check a bucket)."""

    @abstractmethod
    def open_writer(self, name: str, image: memoryview | int) -> DataWriter:
        """A writer of the data object ``name`` whose head is ``image``; given a size
        instead, the head is that many bytes, each written through :meth:`DataWriter.write_at`."""

    @abstractmethod
    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``name`` from ``offset`` on."""

    def read(self, name: str, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)`` of ``name``, as a (possibly read-only)
        view the backend may hand over without a copy; same errors as :meth:`read_into`."""
        out = memoryview(bytearray(length))
        self.read_into(name, offset, out)
        return out

    @abstractmethod
    def size(self, name: str) -> int:
        """The size of object ``name`` in bytes; raises ``CorruptCheckpointError`` if absent."""

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """The whole object ``name``, or ``None`` where it does not exist."""

    @abstractmethod
    def put_atomic(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name``, whole or not at all, durably."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists."""

    @abstractmethod
    def list_children(self) -> list[str]:
        """Names of the locations directly under this one (sub-directories, prefixes)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove object ``name``; a missing one is not an error."""

    @abstractmethod
    def delete_all(self) -> None:
        """Remove this location and everything under it; a missing one is not an error."""

    small_reads_are_cheap: bool = True
    """Whether a read of one checksum block costs about its bytes (a local file) rather than
    a round trip (an object store): the reader then verifies block by block as it reads."""

    splits_shared_reads: bool = True
    """Whether replicas loading from here split the bytes they share, each reading its part
    once and passing it on (read-once loads, docs/read-once.md): where every read is a
    request and a bill (an object store). A local file system says no unless told it is
    shared by hosts (:class:`.local.LocalStorage`'s ``read_once``): one host's ranks read it
    through one page cache, which serves each byte from the disk once anyway."""

    def cleanup_incomplete(self, keep: str | None = None) -> None:
        """Remove what writes cut short left behind under this location (unfinished
        multipart uploads), except under its child ``keep`` (a save may be writing there)."""
        return None

    def discard_spares(self) -> None:
        """Delete bytes kept for later writes to reuse (only the local disk keeps any)."""
        return None

    def close(self) -> None:
        """Release clients and open handles."""
        return None
