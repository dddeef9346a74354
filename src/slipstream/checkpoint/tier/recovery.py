"""Loading a local step into every rank, the files a rank's node lacks sent by ranks whose
nodes hold them, over the tier's link (:mod:`.link`).

Every rank runs the same four rounds of the load agreement (:mod:`..agreement`), so a
rank that fails any round fails it on every rank before any rank waits on it in a
transfer:

1. **Small files.** Each rank hashes its node's ``.metadata`` and index (the files the
   manifest gives a contents digest) and says which match the manifest.
2. **Plan.** Each small file a rank lacks (or holds altered) is sent whole by a rank
   whose copy matched, and hashed again on arrival. Then each rank checks the index
   against the manifest and plans its load: the byte ranges of files its node lacks
   are what it wants.
3. **Serve.** Each wanted range is served by one rank whose node holds its file (the
   same choice on every rank): that rank reads it from its node's storage.
4. **Load.** The ranges move, and each rank loads, every byte it reads verified against
   the index's checksums (which the manifest binds), wherever it came from.

Invariant: a rank reads from storage only what it or a rank it serves loads, and moves
only the ranges the rank receiving them reads; a byte from a peer is used only once
verified (a small file by its digest before use, a data range by its blocks as it is
loaded), and a refusal names the file and the rank that served it.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ...core.buffers import byte_view
from ...core.waits import Deadline
from ...errors import CheckpointError, CorruptCheckpointError, SlipstreamError
from ..agreement import LoadAgreement
from ..format.safe_types import Trust, Trusted
from ..load.loader import PlannedLoad, plan_load
from ..load.reader import CheckpointReader
from ..peer_transfers import Move
from ..storage import DataWriter, Storage
from .link import TierLink
from .nodes import NodeMap
from .replication import FileSource
from .sealing import CONTENT, bytes_digest, check_blocks, digest_kind

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class Served:
    """Bytes ``[lo, hi)`` of ``file``, read by ``server`` for ``taker``."""

    file: str
    lo: int
    hi: int
    server: int
    taker: int


def _choose(candidates: Sequence[int], taker: int) -> int:
    """The candidate that serves ``taker`` (spread over them by the taker's rank)."""
    return candidates[taker % len(candidates)]


class RecoveredStep(Storage):
    """One local step as a read-only :class:`Storage` on one rank: the small files from
    their verified copies, the data files this node holds from it, the ranges of the
    others fetched from peers (see the module docstring)."""

    def __init__(
        self,
        local: Storage,
        step_name: str,
        manifest: dict[str, int],
        digests: dict[str, str],
        holders: dict[str, list[int]],
        rank: int,
        nodes: NodeMap,
    ) -> None:
        self.local = local
        self.step_name = step_name
        self.manifest = manifest
        self.digests = digests
        self.holders = holders
        self.rank = rank
        self.nodes = nodes
        self.url = f"{local.url} (local tier, with peer replicas)"
        self.small_reads_are_cheap = True
        self.small_names = sorted(f for f in manifest if digest_kind(digests[f]) == CONTENT)
        self.remote = sorted(
            f for f in manifest if f not in self.small_names and rank not in holders.get(f, [])
        )
        """The data files this rank's node lacks."""
        self._small: dict[str, bytes] = {}
        self._fetched: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._served: dict[str, set[str]] = {}
        self._sources: dict[str, FileSource] = {}

    # -- the rounds ---------------------------------------------------------------------

    def verified_small(self) -> list[str]:
        """Round 1: the small files this node holds whole and matching the manifest."""
        held = []
        for name in self.small_names:
            if self.rank not in self.holders.get(name, []):
                continue
            try:
                data = self.local.get(name)
            except (OSError, SlipstreamError) as exc:
                logger.warning("could not read %s/%s: %s", self.local.url, name, exc)
                continue
            found = "missing" if data is None else bytes_digest(data)
            if data is not None and found == self.digests[name]:
                self._small[name] = data
                held.append(name)
            else:
                self._refuse(name, "this node's copy", self.local.url, found)
        return held

    def fetch_small(
        self, link: TierLink, held: Sequence[Sequence[str]], deadline: Deadline
    ) -> None:
        """Round 2, first part: the small files this rank lacks, from ranks holding them
        verified (``held``: round 1's answers, by rank); every rank makes the same moves."""
        moves, landed = [], {}
        tag = 0
        for taker in range(len(held)):
            for name in self.small_names:
                if name in held[taker]:
                    continue
                holders = [r for r, names in enumerate(held) if name in names]
                if not holders:
                    raise CorruptCheckpointError(
                        f"{self.url}: no node holds a copy of {name} that matches the "
                        f"manifest's digest (rank {taker} needs it)"
                    )
                server = _choose(holders, taker)
                what = f"{self.step_name}/{name} (rank {server} to rank {taker})"
                if server == self.rank:
                    data = torch.frombuffer(bytearray(self._small[name]), dtype=torch.uint8)
                    moves.append(Move(taker, tag, data, True, what))
                elif taker == self.rank:
                    landed[name] = (server, torch.empty(self.manifest[name], dtype=torch.uint8))
                    moves.append(Move(server, tag, landed[name][1], False, what))
                tag += 1
        link.move(moves, deadline)
        for name, (server, data) in landed.items():
            found = bytes_digest(byte_view(data))
            if found != self.digests[name]:
                who = self._who(server)
                self._refuse(name, "the replica", who, found)
                raise CorruptCheckpointError(
                    f"{self.url}: the copy of {name} from {who} does not match the manifest's "
                    "digest"
                )
            self._small[name] = data.numpy().tobytes()
            self._note(name, self._who(server))

    def open_plan(
        self, state_dict: dict[str, Any], strict: bool, trusted: Trusted
    ) -> tuple[PlannedLoad, dict[str, list[list[int]]]]:
        """Round 2, second part: the load planned on this step, and the ranges it reads of
        the data files this node lacks (by file)."""
        reader = CheckpointReader(self, trust=Trust.of(trusted))
        try:
            check_blocks(reader.index, self.digests, reader.path)
            planned = plan_load(reader, state_dict, strict=strict, cast=False)
        except BaseException:
            reader.close()
            raise
        wants = {
            file: [[lo, hi] for lo, hi in spans]
            for file, spans in planned.byte_ranges().items()
            if file in self.remote
        }
        return planned, wants

    def plan_served(self, wants: Sequence[dict[str, list[list[int]]]]) -> list[Served]:
        """Every wanted range and who serves it, the same list on every rank."""
        out = []
        for taker, own in enumerate(wants):
            for file in sorted(own):
                holders = [r for r in self.holders.get(file, []) if r != taker]
                if not holders:
                    raise CheckpointError(f"{self.url}: no other rank's node holds {file}")
                server = _choose(holders, taker)
                out += [Served(file, lo, hi, server, taker) for lo, hi in own[file]]
        return out

    def read_served(self, served: Sequence[Served]) -> list[torch.Tensor]:
        """Round 3: the ranges this rank serves, from its node's files (mapped where they
        are in a local directory, so they are sent from their pages), in ``served`` order."""
        out = []
        for s in served:
            if s.server == self.rank:
                source = self._sources.get(s.file)
                if source is None:
                    source = FileSource.open(self.local, s.file)
                    self._sources[s.file] = source
                out.append(source.data[s.lo : s.hi])
        return out

    def fetch_served(
        self, link: TierLink, served: Sequence[Served], read: list[torch.Tensor], deadline: Deadline
    ) -> int:
        """Round 4, first part: the ranges move; returns the bytes this rank received."""
        moves = []
        mine = iter(read)
        for tag, s in enumerate(served):
            what = (
                f"bytes {s.lo}-{s.hi} of {self.step_name}/{s.file} "
                f"(rank {s.server} to rank {s.taker})"
            )
            if s.server == self.rank:
                moves.append(Move(s.taker, tag, next(mine), True, what))
            elif s.taker == self.rank:
                data = torch.empty(s.hi - s.lo, dtype=torch.uint8)
                self._fetched.setdefault(s.file, []).append((s.lo, data))
                self._note(s.file, self._who(s.server))
                moves.append(Move(s.server, tag, data, False, what))
        for spans in self._fetched.values():
            spans.sort(key=lambda span: span[0])
        return link.move(moves, deadline)

    # -- naming -------------------------------------------------------------------------

    def _who(self, rank: int) -> str:
        return f"rank {rank} (node {self.nodes.node_of[rank]})"

    def _note(self, name: str, who: str) -> None:
        self._served.setdefault(name, set()).add(who)

    def files_from_peers(self) -> int:
        """How many of the step's files peers sent (some of) to this rank."""
        return len(self._served)

    def sources(self) -> str:
        """Which peers served which files (for an error's end; empty where none did)."""
        if not self._served:
            return ""
        return (
            " (read from peers: "
            + "; ".join(
                f"{self.step_name}/{name} from {', '.join(sorted(who))}"
                for name, who in sorted(self._served.items())
            )
            + ")"
        )

    def _refuse(self, name: str, copy: str, where: str, found: str) -> None:
        why = f"its digest is {found[:23]}..., the manifest's {self.digests[name][:23]}..."
        logger.warning("refused %s of %s/%s on %s: %s", copy, self.step_name, name, where, why)

    # -- Storage ------------------------------------------------------------------------

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name not in self.manifest:
            raise CorruptCheckpointError(f"{self.url}: {name} is not in the step's manifest")
        size = self.manifest[name]
        if offset < 0 or offset + len(out) > size:
            raise CorruptCheckpointError(
                f"{self.url}: [{offset}, {offset + len(out)}) is past the end of {name} "
                f"({size} bytes)"
            )
        if name in self._small:
            out.cast("B")[:] = self._small[name][offset : offset + len(out)]
        elif name in self.remote:
            self._read_fetched(name, offset, out)
        else:
            self.local.read_into(name, offset, out)

    def _read_fetched(self, name: str, offset: int, out: memoryview) -> None:
        spans = self._fetched.get(name, [])
        i = bisect.bisect_right([lo for lo, _ in spans], offset) - 1
        if i >= 0:
            lo, data = spans[i]
            if offset + len(out) <= lo + data.numel():
                view = byte_view(data)
                out.cast("B")[:] = view[offset - lo : offset - lo + len(out)]
                return
        raise CheckpointError(
            f"{self.url}: bytes {offset}-{offset + len(out)} of {name} were not fetched from a "
            "peer (the load read past its plan)"
        )

    def size(self, name: str) -> int:
        if name not in self.manifest:
            raise CorruptCheckpointError(f"{self.url}: {name} is not in the step's manifest")
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
        self._fetched.clear()
        for source in self._sources.values():
            source.release()
        self._sources.clear()
        self.local.close()


def _logged(step: RecoveredStep, what: str, work: Callable[[], _T]) -> Callable[[], _T]:
    """``work``, its failure logged on this rank and raised naming the peers that served
    the step's files."""

    def run() -> _T:
        try:
            return work()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}{step.sources()}"
            logger.warning("rank %d could not load %s: %s", step.rank, what, why)
            raise CheckpointError(why) from exc

    return run


def recover(
    agreement: LoadAgreement,
    step: RecoveredStep,
    link: TierLink,
    state_dict: dict[str, Any],
    strict: bool,
    trusted: Trusted,
    what: str,
    timeout: float,
) -> int:
    """Load ``step`` into ``state_dict`` on every rank, in the rounds of the module
    docstring (every rank calls this together); returns the bytes this rank received from
    peers. Every rank raises if any failed, naming it."""
    held = agreement.values(what, step.verified_small, timeout)
    planned: list[PlannedLoad] = []

    def plan() -> dict[str, list[list[int]]]:
        step.fetch_small(link, held, Deadline(timeout))
        own, wants = step.open_plan(state_dict, strict, trusted)
        planned.append(own)
        return wants

    def load() -> int:
        received = step.fetch_served(link, served, read, Deadline(timeout))
        planned[0].read()
        planned[0].finish()
        return received

    try:
        wants = agreement.values(what, _logged(step, what, plan), timeout)
        served = step.plan_served(wants)
        read = agreement.run(what, _logged(step, what, lambda: step.read_served(served)), timeout)
        return agreement.run(what, _logged(step, what, load), timeout)
    finally:
        for own in planned:
            own.reader.close()
