"""What makes a local step the job's own: each node's key, the files' digests, and the MAC
over a step's manifest that its ``.local_commit`` carries.

A node's key (:data:`KEY_FILE`, 256 random bits, mode 0600 in the node's local-tier root)
is created by the first job that uses the root and read by every later one on that node
(a root given as another :class:`Storage` keeps it as that backend keeps any object).
A marker's MAC is HMAC-SHA256 with that key over the step, the world size, and every
file's name, size and SHA-256 digest (:func:`manifest_mac`); a file is taken only where
its bytes hash to the manifest's digest (:func:`file_digest`).

Invariants: the key never leaves the node (no message, log or ``repr`` carries it); a
marker whose MAC does not verify under the node's key is refused as a corrupt one is;
a digest is over a file's whole contents, in order.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os

from ...errors import CheckpointError
from ..storage import LocalStorage, Storage

KEY_FILE = ".tier_key"
KEY_BYTES = 32
_CHUNK = 8 * 1024 * 1024


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


def file_digest(location: Storage, name: str, size: int) -> str:
    """SHA-256 (hex) of the first ``size`` bytes of ``name`` at ``location``; a local file
    is hashed from its pages without a copy (the hash runs without the GIL)."""
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
        return digest.hexdigest()
    buf = memoryview(bytearray(min(_CHUNK, max(size, 1))))
    for start in range(0, size, _CHUNK):
        part = buf[: min(_CHUNK, size - start)]
        location.read_into(name, start, part)
        digest.update(part)
    return digest.hexdigest()


def bytes_digest(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
