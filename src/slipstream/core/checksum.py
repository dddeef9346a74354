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
