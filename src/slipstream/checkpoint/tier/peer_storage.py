"""One step of the local tier as a read-only :class:`Storage`: each file from this node
when it holds it, otherwise from a peer rank whose node holds a replica.

Invariant: only files named by the step's committed manifest are served, each with the
manifest's size; a peer that fails is replaced by the next rank holding the file, and
the error names every rank tried; :attr:`PeerStepStorage.served` names the peer (rank and
address) whose bytes each remote file was read from, for an error that refuses them.
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.peer_link import PeerClient
from ...errors import CheckpointError, CorruptCheckpointError, SlipstreamError
from ..storage import DataWriter, Storage


class PeerStepStorage(Storage):
    """``local`` is this node's location of the step; ``holders[file]`` the ranks whose
    nodes hold ``file`` (this rank among them where this node does)."""

    def __init__(
        self,
        local: Storage,
        step_name: str,
        manifest: dict[str, int],
        holders: dict[str, list[int]],
        rank: int,
        client: Callable[[int], PeerClient],
    ) -> None:
        self.local = local
        self.step_name = step_name
        self.manifest = manifest
        self.holders = holders
        self.rank = rank
        self._client = client
        self.url = f"{local.url} (local tier, with peer replicas)"
        self.remote = sorted(f for f in manifest if rank not in holders.get(f, []))
        """The files this rank reads from peers."""
        self.served: dict[str, str] = {}
        """Each remote file read so far: the peer that served it (``rank 2 (host:port)``)."""
        self.small_reads_are_cheap = not self.remote

    def _known(self, name: str) -> None:
        if name not in self.manifest:
            raise CorruptCheckpointError(f"{self.url}: {name} is not in the step's manifest")

    def _remote(self, name: str, what: str, call: Callable[[PeerClient], None]) -> None:
        tried = []
        for rank in self.holders.get(name, []):
            if rank == self.rank:
                continue
            try:
                client = self._client(rank)
                call(client)
                self.served[name] = client.who
                return
            except SlipstreamError as exc:
                tried.append(f"rank {rank}: {exc}")
        raise CheckpointError(
            f"{self.url}: no peer could serve {what} of {name}: "
            + ("; ".join(tried) or "none holds it")
        )

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._known(name)
        if name not in self.remote:
            self.local.read_into(name, offset, out)
        else:
            self._remote(
                name, "a read", lambda c: c.read_into(f"{self.step_name}/{name}", offset, out)
            )

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

    def open_writer(self, name: str, image: memoryview) -> DataWriter:
        raise CheckpointError(f"{self.url} is read-only")

    def put_atomic(self, name: str, data: bytes) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def delete(self, name: str) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def delete_all(self) -> None:
        raise CheckpointError(f"{self.url} is read-only")

    def close(self) -> None:
        self.local.close()
