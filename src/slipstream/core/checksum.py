"""Fast checksums of byte ranges, in fixed-size blocks.

xxh3-64 runs faster than a memory copy on one core, so checksumming what is written or
read costs a fraction of the copy itself. Checksums are taken per block of
``BLOCK_BYTES`` of a record's data so that a reader of part of a record can still verify
what it read. Blocks are small (1 MiB) for two reasons: a reader hashes each block right
after reading it, while it is still in the core's cache, and a resharding reader of part
of a record reads at most one extra block at each end.

Inputs over ``GIL_FREE_MIN_BYTES`` are hashed with the GIL released, so read threads hash
in parallel and a saver's hashing never holds up the training thread; smaller ones keep
it, since dropping and retaking the GIL for a few microseconds of work would hand it to
the training thread and back each time. xxhash 4 does this itself; before it, the one-shot
call always kept the GIL and the hasher object's update always dropped it, so the choice
is made here.
"""

from __future__ import annotations

import xxhash

BLOCK_BYTES = 1024 * 1024
ALGORITHM = "xxh3_64"
#: Inputs larger than this are hashed with the GIL released (hashlib's threshold too).
GIL_FREE_MIN_BYTES = 64 * 1024


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of ``data``; the GIL is released for inputs over ``GIL_FREE_MIN_BYTES``."""
    if len(data) > GIL_FREE_MIN_BYTES:
        return xxhash.xxh3_64(data).intdigest()
    return xxhash.xxh3_64_intdigest(data)


def block_checksums(data: memoryview, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """Checksums of consecutive ``block_bytes`` blocks of ``data`` (the last may be short)."""
    n = len(data)
    if n == 0:
        return [checksum(b"")]
    return [checksum(data[i : i + block_bytes]) for i in range(0, n, block_bytes)]


class BlockChecksums:
    """:func:`block_checksums` of ``nbytes`` of data that arrive in consecutive pieces
    (a record staged a part at a time): blocks cut across pieces are hashed incrementally.

    Invariant: once :meth:`update` has been fed every byte in order, :meth:`result` equals
    ``block_checksums`` of the whole data."""

    def __init__(self, nbytes: int, block_bytes: int = BLOCK_BYTES) -> None:
        self.nbytes = nbytes
        self.block_bytes = block_bytes
        self.fed = 0
        self._sums: list[int] = []
        self._partial: xxhash.xxh3_64 | None = None

    def update(self, data: memoryview) -> None:
        """Hash the next ``len(data)`` bytes of the data."""
        if self.fed + len(data) > self.nbytes:
            raise ValueError(f"{self.fed + len(data)} bytes fed to checksums of {self.nbytes}")
        pos = 0
        while pos < len(data):
            in_block = self.fed % self.block_bytes
            take = min(self.block_bytes - in_block, len(data) - pos)
            piece = data[pos : pos + take]
            ends_block = in_block + take == self.block_bytes or self.fed + take == self.nbytes
            if in_block == 0 and ends_block:
                self._sums.append(checksum(piece))
            else:
                if self._partial is None:
                    self._partial = xxhash.xxh3_64()
                self._partial.update(piece)
                if ends_block:
                    self._sums.append(self._partial.intdigest())
                    self._partial = None
            pos += take
            self.fed += take

    def result(self) -> list[int]:
        """The block checksums; every byte must have been fed."""
        if self.fed != self.nbytes:
            raise ValueError(f"checksums of {self.nbytes} bytes taken after {self.fed}")
        return self._sums if self.nbytes else [checksum(b"")]
