"""Copies of a local step's files on peer ranks, over the tier's gloo group (:mod:`.link`).

Every rank derives the same :class:`Copy` list from the node map: each rank's data file
goes to its replica ranks, rank 0's ``.metadata`` and index also to one rank of every
other node. One step's copies run on the tier's replication thread of every rank, in four
exchanges, each posted at once in both directions (a rank sends and receives together, so
no two ranks wait on each other's send):

1. **offer**: each sender tells each receiver the file's size, or that nothing comes (its
   part of the step failed);
2. **room**: each receiver makes room for the file in its node's step directory (its
   space allocated, so a full file system fails here, not mid-transfer) and answers yes
   or no;
3. **data**: the file's bytes, straight from the sender's file pages into the receiver's
   (both memory-mapped where the tier is a local directory);
4. **stored**: each receiver answers once the file is whole on its storage, or that it
   could not store it.

Invariant: a rank reports its part of the step done only once every file it receives is
whole under its name on its node (written and flushed) and every rank it sends to has
answered; a file a receiver could not store is removed and named in that receiver's own
report. A sender waits for the answer so that a receiver dying before it has stored the
file is seen at once, by its connection dropping. A copy cut short fails the step (rank
0's decision, :mod:`.local_tier`) and never leaves a file a later step would take for
whole.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...core.buffers import byte_view
from ...core.waits import Deadline
from ...errors import SlipstreamError
from ..format.names import METADATA_FILE, data_file_name, index_file
from ..peer_transfers import Move
from ..storage import LocalStorage, Storage
from ..storage.recycle import claim
from .link import TierLink
from .nodes import NodeMap

NOTHING = -1
"""An offer, room or stored answer that says no."""


@dataclass(frozen=True)
class Copy:
    """``file`` of a step, sent by rank ``sender`` to rank ``receiver``."""

    file: str
    sender: int
    receiver: int


def step_copies(nodes: NodeMap, replicas: int) -> list[Copy]:
    """Every copy one local step makes, in the same order on every rank."""
    copies = [
        Copy(data_file_name(rank), rank, peer)
        for rank in range(nodes.world_size)
        for peer in nodes.replica_ranks(rank, replicas)
    ]
    if replicas:
        own = nodes.node_of[0]
        leaders = [nodes.leader(n) for n in range(nodes.nodes) if n != own]
        targets = sorted(set(nodes.replica_ranks(0, replicas)) | set(leaders))
        copies += [Copy(f, 0, r) for f in (METADATA_FILE, index_file(0)) for r in targets]
    return copies


class TierFiles:
    """This node's local tier by step: step locations are opened once and kept until
    :meth:`forget` (retention) or :meth:`close`, so their file handles are too."""

    def __init__(self, root: Storage) -> None:
        self.root = root
        self._steps: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def step(self, step_name: str) -> Storage:
        with self._lock:
            location = self._steps.get(step_name)
            if location is None:
                location = self._steps[step_name] = self.root.child(step_name)
            return location

    def forget(self, step_name: str) -> None:
        with self._lock:
            location = self._steps.pop(step_name, None)
        if location is not None:
            location.close()

    def close(self) -> None:
        with self._lock:
            steps, self._steps = list(self._steps.values()), {}
        for location in steps:
            location.close()


def _word(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


class StepReplication:
    """One step's copies on one rank (see the module docstring); :meth:`run` once."""

    def __init__(
        self,
        link: TierLink,
        copies: Sequence[Copy],
        rank: int,
        location: Storage,
        step_name: str,
        failed: str | None,
    ) -> None:
        self.link = link
        self.rank = rank
        self.location = location
        self.step_name = step_name
        self.failed = failed
        """Why this rank sends nothing of the step (its part failed), or ``None``."""
        indexed = list(enumerate(copies))
        self.sends = [(i, c) for i, c in indexed if c.sender == rank]
        self.receives = [(i, c) for i, c in indexed if c.receiver == rank]
        self._phases = len(copies)

    def _tag(self, phase: int, index: int) -> int:
        return phase * self._phases + index

    def run(self, deadline: Deadline) -> list[str]:
        """Make this rank's copies of the step (sent and received); returns why any failed
        (empty where all were stored), its own failure first. Whatever can fail on this
        rank (opening a file to send, making room for one) fails before the exchange that
        would wait on it, and turns into a no in that exchange, never a silence."""
        errors = [] if self.failed is None else [self.failed]
        sources: dict[int, FileSource] = {}
        landings: dict[int, _Landing] = {}
        try:
            sizes = self._offer(sources, deadline, errors)
            self._room(sizes, landings, deadline, errors)
            self._data(sizes, sources, landings, deadline)
            self._stored(landings, deadline, errors)
        except BaseException:
            for landing in landings.values():
                landing.abort()
            raise
        finally:
            for source in sources.values():
                source.release()
            for landing in landings.values():
                landing.release()
        return errors

    def _offer(
        self, sources: dict[int, FileSource], deadline: Deadline, errors: list[str]
    ) -> dict[int, int]:
        """Open each file to send and exchange sizes; returns each copy's (by index),
        ``NOTHING`` where none comes."""
        sizes: dict[int, int] = {}
        opened: dict[str, FileSource] = {}
        for i, c in self.sends:
            sizes[i] = NOTHING
            if self.failed is not None:
                continue
            try:
                source = opened.get(c.file) or FileSource.open(self.location, c.file)
            except (OSError, SlipstreamError, ValueError) as exc:
                error = f"{self.location.url}/{c.file}: this rank cannot send it: {exc}"
                if error not in errors:
                    errors.append(error)
                continue
            opened[c.file] = sources[i] = source
            sizes[i] = source.size
        words = {i: _word(sizes[i]) for i, _ in self.sends}
        words.update({i: _word(NOTHING) for i, _ in self.receives})
        moves = [self._move(0, i, c, words[i], "offer") for i, c in self.sends + self.receives]
        self.link.move(moves, deadline)
        sizes.update({i: int(words[i].item()) for i, _ in self.receives})
        return sizes

    def _room(
        self,
        sizes: dict[int, int],
        landings: dict[int, _Landing],
        deadline: Deadline,
        errors: list[str],
    ) -> None:
        """Make room for each file offered and exchange the answers; a copy either end
        said no to is ``NOTHING`` from here on."""
        answers: dict[int, torch.Tensor] = {}
        for i, c in self.receives:
            answers[i] = _word(NOTHING)
            if sizes[i] == NOTHING:
                continue
            try:
                landings[i] = _Landing.open(self.location, c.file, sizes[i])
                answers[i] = _word(1)
            except (OSError, SlipstreamError, ValueError) as exc:
                errors.append(self._failed_to_store(c, exc))
                sizes[i] = NOTHING
        words = {i: _word(NOTHING) for i, _ in self.sends}
        words.update(answers)
        moves = [self._move(1, i, c, words[i], "room") for i, c in self.receives + self.sends]
        self.link.move(moves, deadline)
        for i, _ in self.sends:
            if int(words[i].item()) == NOTHING:
                sizes[i] = NOTHING

    def _data(
        self,
        sizes: dict[int, int],
        sources: dict[int, FileSource],
        landings: dict[int, _Landing],
        deadline: Deadline,
    ) -> None:
        moves = [
            self._move(2, i, c, sources[i].data, "data") for i, c in self.sends if sizes[i] > 0
        ]
        moves += [
            self._move(2, i, c, landings[i].data, "data") for i, c in self.receives if sizes[i] > 0
        ]
        self.link.move(moves, deadline)

    def _stored(self, landings: dict[int, _Landing], deadline: Deadline, errors: list[str]) -> None:
        answers: dict[int, torch.Tensor] = {}
        for i, c in self.receives:
            landing = landings.get(i)
            if landing is None:
                answers[i] = _word(NOTHING)
                continue
            try:
                landing.finish()
                answers[i] = _word(1)
            except (OSError, SlipstreamError) as exc:
                landing.abort()
                errors.append(self._failed_to_store(c, exc))
                answers[i] = _word(NOTHING)
        words = {i: _word(NOTHING) for i, _ in self.sends}
        words.update(answers)
        moves = [self._move(3, i, c, words[i], "stored") for i, c in self.receives + self.sends]
        self.link.move(moves, deadline)

    def _failed_to_store(self, c: Copy, exc: BaseException) -> str:
        return (
            f"rank {self.rank} could not store rank {c.sender}'s {self.step_name}/{c.file} "
            f"in {self.location.url}: {type(exc).__name__}: {exc}"
        )

    def _move(self, phase: int, i: int, c: Copy, data: torch.Tensor, word: str) -> Move:
        """This rank's end of exchange ``phase`` for copy ``i``: the offer and the data go
        from sender to receiver, the room and stored answers back."""
        sending = self.rank == c.sender
        peer = c.receiver if sending else c.sender
        outgoing = sending == (phase in (0, 2))
        what = f"the {word} of {self.step_name}/{c.file} (rank {c.sender} to rank {c.receiver})"
        return Move(peer, self._tag(phase, i), data, outgoing, what)


class FileSource:
    """A file's bytes to send (``data``, ``size`` of them): its pages mapped where the
    storage is a local directory, else read into memory."""

    def __init__(self, data: torch.Tensor, mapped: mmap.mmap | None) -> None:
        self.data = data
        self.size = data.numel()
        self._mapped = mapped

    @classmethod
    def open(cls, location: Storage, file: str) -> FileSource:
        size = location.size(file)
        if isinstance(location, LocalStorage) and size:
            with open(os.path.join(location.path, file), "rb") as f:
                mapped = mmap.mmap(
                    f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
            return cls(torch.frombuffer(mapped, dtype=torch.uint8), mapped)
        data = torch.empty(size, dtype=torch.uint8)
        if size:
            location.read_into(file, 0, byte_view(data))
        return cls(data, None)

    def release(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        _unmap(self._mapped)


class _Landing:
    """Where a received file's bytes land: its own pages (space allocated up front) in a
    local directory, else memory written out on :meth:`finish`."""

    def __init__(
        self,
        location: Storage,
        file: str,
        data: torch.Tensor,
        fd: int | None = None,
        mapped: mmap.mmap | None = None,
    ) -> None:
        self.location = location
        self.file = file
        self.data = data
        self._fd = fd
        self._mapped = mapped
        self._path = os.path.join(location.path, file) if fd is not None else None  # type: ignore[attr-defined]

    @classmethod
    def open(cls, location: Storage, file: str, size: int) -> _Landing:
        location.prepare()
        if not isinstance(location, LocalStorage):
            return cls(location, file, torch.empty(size, dtype=torch.uint8))
        path = os.path.join(location.path, file)
        if location.spare_dir is not None:
            claim(location.spare_dir, file, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            if not size:
                return cls(location, file, torch.empty(0, dtype=torch.uint8), fd)
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            _remove(path)
            raise
        return cls(location, file, torch.frombuffer(mapped, dtype=torch.uint8), fd, mapped)

    def finish(self) -> None:
        """Make the received bytes whole under the file's name."""
        if self._fd is None:
            with self.location.open_writer(self.file, memoryview(b"")) as out:
                try:
                    out.append(byte_view(self.data), 0)
                    out.finish()
                except BaseException:
                    out.abort()
                    raise
            return
        if self._mapped is not None:
            self._mapped.flush()
        os.fsync(self._fd)

    def abort(self) -> None:
        """Remove what was written of the file."""
        if self._path is not None:
            _remove(self._path)

    def release(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        _unmap(self._mapped)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _unmap(mapped: mmap.mmap | None) -> None:
    """Unmap now where nothing else holds the pages, else when the last holder goes."""
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:
            pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
