"""What makes a local step the job's own: each node's key, the files' digests, and the MAC
over a step's manifest that its ``.local_commit`` carries.

A node's key (:data:`KEY_FILE`, 256 random bits, mode 0600 in the node's local-tier root)
is created by the first job that uses the root and read by every later one on that node
(a root given as another :class:`Storage` keeps it as that backend keeps any object).
A marker's MAC is HMAC-SHA256 with that key over the step, the world size, and every
file's name, size and digest (:func:`manifest_mac`).

A file's digest is one of two kinds. A small file (``.metadata``, the index, anything not
a data file) has the SHA-256 of its contents (:data:`CONTENT`, :func:`file_digest`): it
is taken only where its bytes hash to it. A data file has the SHA-256 of what the step's
index holds for it, its records' places and xxh3 block checksums and its values' places
and checksums (:data:`BLOCKS`, :func:`blocks_digests`): the save computed those already,
and the loader verifies every byte it reads against them, so the data bytes are bound
through the index, whose own contents digest is under the MAC, without a pass over them.

Invariants: the key never leaves the node (no message, log or ``repr`` carries it); a
marker whose MAC does not verify under the node's key is refused as a corrupt one is;
a contents digest is over a file's whole contents, in order; a blocks digest depends on
the index's entries for that file only, in a canonical order.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os

from ...errors import CheckpointError, CorruptCheckpointError
from ..format.index import CheckpointIndex
from ..storage import LocalStorage, Storage

KEY_FILE = ".tier_key"
KEY_BYTES = 32
_CHUNK = 8 * 1024 * 1024
CONTENT = "sha256"
"""A digest of a file's whole contents."""
BLOCKS = "xxh3-blocks"
"""A digest of the index's entries (xxh3 block checksums) for a data file."""
KINDS = (CONTENT, BLOCKS)


def node_key(root: Storage, create: bool) -> bytes | None:
    """The key of the node whose local tier is ``root``: read, or (``create``) made first
    where there is none. ``None``: there is none and ``create`` is false."""
    if isinstance(root, LocalStorage):
        return _file_key(os.fspath(root.path), create)
    data = root.get(KEY_FILE)
    if data is None and create:
        root.put_atomic(KEY_FILE, os.urandom(KEY_BYTES))
        data = root.get(KEY_FILE)
    return _checked(data, f"{root.url}/{KEY_FILE}")


def _file_key(directory: str, create: bool) -> bytes | None:
    """Created as a whole by a hard link of a private temporary file, so two processes
    making it at once agree on one key and no reader sees it half written."""
    path = os.path.join(directory, KEY_FILE)
    if create and not os.path.exists(path):
        temp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
        finally:
            os.remove(temp)
    try:
        with open(path, "rb") as f:
            return _checked(f.read(KEY_BYTES + 1), path)
    except FileNotFoundError:
        return None


def _checked(data: bytes | None, where: str) -> bytes | None:
    if data is not None and len(data) != KEY_BYTES:
        raise CheckpointError(f"{where}: a local-tier key must be {KEY_BYTES} bytes")
    return data


def manifest_mac(
    key: bytes, step: int, world_size: int, files: dict[str, int], digests: dict[str, str]
) -> str:
    """The MAC of a step's manifest (hex)."""
    body = json.dumps(
        {"step": step, "world_size": world_size, "files": files, "digests": digests},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hmac.new(key, b"slipstream-local-step\0" + body.encode(), hashlib.sha256).hexdigest()


def mac_matches(mac: str, want: str) -> bool:
    return hmac.compare_digest(mac.encode(), want.encode())


def digest_kind(digest: str) -> str:
    """The kind of ``digest`` (one of :data:`KINDS`); ``""`` where it is none of them."""
    kind, _, hexed = digest.partition(":")
    ok = kind in KINDS and len(hexed) == 64 and all(c in "0123456789abcdef" for c in hexed)
    return kind if ok else ""


def file_digest(location: Storage, name: str, size: int) -> str:
    """The :data:`CONTENT` digest of the first ``size`` bytes of ``name`` at ``location``;
    a local file is hashed from its pages without a copy (the hash runs without the GIL)."""
    digest = hashlib.sha256()
    if isinstance(location, LocalStorage):
        with open(os.path.join(location.path, name), "rb") as f:
            if size:
                with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
                    view = memoryview(mapped)
                    try:
                        for start in range(0, size, _CHUNK):
                            digest.update(view[start : start + _CHUNK])
                    finally:
                        view.release()
        return f"{CONTENT}:{digest.hexdigest()}"
    buf = memoryview(bytearray(min(_CHUNK, max(size, 1))))
    for start in range(0, size, _CHUNK):
        part = buf[: min(_CHUNK, size - start)]
        location.read_into(name, start, part)
        digest.update(part)
    return f"{CONTENT}:{digest.hexdigest()}"


def bytes_digest(data: bytes | memoryview) -> str:
    """The :data:`CONTENT` digest of ``data``."""
    return f"{CONTENT}:{hashlib.sha256(data).hexdigest()}"


def blocks_digests(index: CheckpointIndex, files: list[str]) -> dict[str, str]:
    """The :data:`BLOCKS` digest of each of ``files`` under ``index``: the SHA-256 of the
    index's checksum algorithm and block size, and of the file's records and values (each
    one's place and checksums), in key order. A file the index names nothing in has the
    digest of no entries, which binds no byte: the loader reads nothing from it."""
    values: dict[str, dict[str, object]] = {}
    for fqn, value in index.values.items():
        values.setdefault(value.file, {})[fqn] = value.to_dict()
    found = {}
    for file in files:
        records = index.records.get(file, {})
        body = json.dumps(
            {
                "checksum": index.checksum,
                "block_bytes": index.block_bytes,
                "records": {key: records[key].to_dict() for key in records},
                "values": values.get(file, {}),
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        found[file] = f"{BLOCKS}:{hashlib.sha256(body.encode()).hexdigest()}"
    return found


def check_blocks(index: CheckpointIndex | None, digests: dict[str, str], where: str) -> None:
    """Raise unless ``index`` gives every data file of ``digests`` its :data:`BLOCKS`
    digest (so that every byte the loader reads of it is verified against checksums the
    manifest binds)."""
    data = sorted(f for f, d in digests.items() if digest_kind(d) == BLOCKS)
    if not data:
        return
    if index is None:
        raise CorruptCheckpointError(
            f"{where}: refused, the step has no index to verify its data files {data} with"
        )
    for file, found in blocks_digests(index, data).items():
        if not mac_matches(found, digests[file]):
            raise CorruptCheckpointError(
                f"{where}: refused, the index's checksums of {file} are not the ones the "
                "step's manifest holds"
            )
