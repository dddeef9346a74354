"""One step of the local tier as a read-only :class:`Storage`: each file from this node
when it holds it, otherwise from a peer rank whose node holds a replica.

Invariant: only files named by the step's committed manifest are served, each with the
manifest's size. A small file (contents digest, :mod:`.sealing`) is served only once its
whole contents hash to the manifest's digest (this node's copy hashed in place, a peer's
fetched whole and hashed before any byte of it is used); a copy that does not match is
logged (the file, the peer's rank and address, why) and the next holder tried. A data
file is served as it is read, range by range, from this node or a peer: the loader
verifies every byte against the index's checksums, which the manifest binds, and
:meth:`PeerStepStorage.sources` names the peers that served each file for its errors. A
peer that fails is replaced by the next rank holding the file, and the error where none
is left names every rank tried.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...core.peer_link import PeerClient
from ...errors import CheckpointError, CorruptCheckpointError, SlipstreamError
from ..storage import DataWriter, Storage
from .sealing import CONTENT, bytes_digest, digest_kind, file_digest

logger = logging.getLogger(__name__)


class PeerStepStorage(Storage):
    """Reads of one local step (``step_name``), local files first, the rest from peers."""

    def __init__(
        self,
        local: Storage,
        step_name: str,
        manifest: dict[str, int],
        digests: dict[str, str],
        holders: dict[str, list[int]],
        rank: int,
        client: Callable[[int], PeerClient],
    ) -> None:
        self.local = local
        self.step_name = step_name
        self.manifest = manifest
        self.digests = digests
        self.holders = holders
        self.rank = rank
        self._client = client
        self.url = f"{local.url} (local tier, with peer replicas)"
        self.remote = sorted(f for f in manifest if rank not in holders.get(f, []))
        """The files this rank reads from peers."""
        self.small_reads_are_cheap = not self.remote
        self._fetched: dict[str, memoryview] = {}
        self._verified: set[str] = set()
        self._served: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {name: threading.Lock() for name in manifest}

    def _known(self, name: str) -> None:
        if name not in self.manifest:
            raise CorruptCheckpointError(f"{self.url}: {name} is not in the step's manifest")

    def sources(self) -> str:
        """Which peers served which files (for an error's end; empty where none did)."""
        with self._lock:
            served = {name: sorted(who) for name, who in sorted(self._served.items())}
        if not served:
            return ""
        return (
            " (read from peers: "
            + "; ".join(
                f"{self.step_name}/{name} from {', '.join(who)}" for name, who in served.items()
            )
            + ")"
        )

    def _note(self, name: str, who: str) -> None:
        with self._lock:
            self._served.setdefault(name, set()).add(who)

    def _verified_copy(self, name: str) -> memoryview | None:
        """Where a small file's verified bytes are: ``None`` for this node's file, else a
        peer's copy fetched whole."""
        with self._locks[name]:
            if name in self._verified:
                return self._fetched.get(name)
            refused = []
            size, want = self.manifest[name], self.digests[name]
            if self.rank in self.holders.get(name, []):
                try:
                    found = file_digest(self.local, name, size)
                except (OSError, SlipstreamError, ValueError) as exc:
                    found = f"unreadable ({type(exc).__name__}: {exc})"
                if found == want:
                    self._verified.add(name)
                    return None
                refused.append(self._refuse(name, "this node's copy", self.local.url, found))
            for rank in self.holders.get(name, []):
                if rank == self.rank:
                    continue
                client = self._client(rank)
                data = memoryview(bytearray(size))
                try:
                    client.read_into(f"{self.step_name}/{name}", 0, data)
                except SlipstreamError as exc:
                    refused.append(f"{client.who}: {exc}")
                    logger.warning(
                        "could not read %s/%s from %s: %s", self.step_name, name, client.who, exc
                    )
                    continue
                found = bytes_digest(data)
                if found == want:
                    self._fetched[name] = data
                    self._verified.add(name)
                    self._note(name, client.who)
                    return data
                refused.append(self._refuse(name, "the replica", client.who, found))
            raise CorruptCheckpointError(
                f"{self.url}: no copy of {name} matches the manifest's digest: "
                + ("; ".join(refused) or "none holds it")
            )

    def _refuse(self, name: str, copy: str, where: str, found: str) -> str:
        why = f"its digest is {found[:23]}..., the manifest's {self.digests[name][:23]}..."
        logger.warning("refused %s of %s/%s on %s: %s", copy, self.step_name, name, where, why)
        return f"{copy} on {where}: {why}"

    def _read_remote(self, name: str, offset: int, out: memoryview) -> None:
        """Read a data file's range from the first peer holding it that answers."""
        tried = []
        for rank in self.holders.get(name, []):
            if rank == self.rank:
                continue
            client = self._client(rank)
            try:
                client.read_into(f"{self.step_name}/{name}", offset, out)
            except SlipstreamError as exc:
                tried.append(f"{client.who}: {exc}")
                logger.warning(
                    "could not read %s/%s from %s: %s", self.step_name, name, client.who, exc
                )
                continue
            self._note(name, client.who)
            return
        raise CheckpointError(
            f"{self.url}: no peer could serve a read of {name}: "
            + ("; ".join(tried) or "none holds it")
        )

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._known(name)
        size = self.manifest[name]
        if offset < 0 or offset + len(out) > size:
            raise CorruptCheckpointError(
                f"{self.url}: [{offset}, {offset + len(out)}) is past the end of {name} "
                f"({size} bytes)"
            )
        if digest_kind(self.digests[name]) == CONTENT:
            source = self._verified_copy(name)
            if source is not None:
                out.cast("B")[:] = source[offset : offset + len(out)]
                return
        elif name in self.remote:
            self._read_remote(name, offset, out)
            return
        self.local.read_into(name, offset, out)

    def size(self, name: str) -> int:
        self._known(name)
        return self.manifest[name]

    def get(self, name: str) -> bytes | None:
        if name not in self.manifest:
            return None
        out = memoryview(bytearray(self.manifest[name]))
        self.read_into(name, 0, out)
        return bytes(out)

    def exists(self, name: str) -> bool:
        return name in self.manifest

    def list_children(self) -> list[str]:
        return []

    def child(self, name: str) -> Storage:
        raise CheckpointError(f"{self.url} is one step: it has no locations under it")

    def prepare(self) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def open_writer(self, name: str, image: memoryview | int) -> DataWriter:
        raise CheckpointError(f"{self.url} is read-only")

    def put_atomic(self, name: str, data: bytes) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def delete(self, name: str) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def delete_all(self) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def close(self) -> None:
        self.local.close()
