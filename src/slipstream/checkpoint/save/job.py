"""One save as its stages see it: the job the saver hands to staging, writing and commit,
and the response the caller holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ...core.gather import FlatGather
from ...core.handles import Watermark
from ...errors import CheckpointError
from ..format.names import data_file
from ..storage import Storage
from .commit import CommitTemplate
from .layout import LocalLayout
from .plan import SavePlan

if TYPE_CHECKING:
    from .part_ring import PartRing
    from .snapshot import StagedState


@dataclass
class SaveTimings:
    """Where one save's time went on this rank, in seconds from the call; each field is
    filled in when its phase ends (``None`` until then, or if the save failed)."""

    nbytes: int = 0
    """Tensor bytes this rank staged and wrote."""
    blocked: float | None = None
    """Time the caller's thread spent in the call (waiting for the previous save included)."""
    staged: float | None = None
    """Until ``staging_completion``: the state may be mutated from then on."""
    durable: float | None = None
    """Until ``upload_completion``: written, fsync'd and committed on every rank."""


@dataclass
class AsyncSaveResponse:
    """The two phases of a save, as futures (same names as DCP's ``AsyncSaveResponse``),
    and this rank's :class:`SaveTimings` of it."""

    staging_completion: Future[None]
    upload_completion: Future[None]
    timings: SaveTimings = field(default_factory=SaveTimings)
    skipped: bool = False
    """The save was skipped (a ``Checkpointer`` with ``when_busy="skip"``): nothing written."""
    _metadata: Callable[[], Metadata] | None = field(default=None, repr=False)

    def result(self, timeout: float | None = None) -> None:
        """Wait until the save is durable and committed."""
        self.upload_completion.result(timeout)

    def metadata(self, timeout: float | None = None) -> Metadata:
        """The committed checkpoint's DCP ``Metadata`` (what ``dcp.save`` returns), once
        the save is durable; raises the save's error if it failed."""
        self.upload_completion.result(timeout)
        if self._metadata is None:
            raise CheckpointError("this save was skipped: it committed no checkpoint")
        return self._metadata()

    def committed_as(self, source: Callable[[], Metadata]) -> None:
        """Set where :meth:`metadata` comes from (the saver, once the save committed)."""
        self._metadata = source


@dataclass
class DeviceSnapshot:
    """One layout's snapshot buffer on one device, and the gather into it (made and lent
    to saves by :class:`~.device_snapshot.DeviceSnapshots`)."""

    key: tuple[str, torch.device]
    buffer: torch.Tensor
    gather: FlatGather
    record_keys: list[str]
    """The layout's record keys in slot order (this rank's records, in file order)."""
    in_use: bool = False


@dataclass(kw_only=True)
class SaveJob:
    """Everything the stages of one save share; ``progress`` is how far staging got.
    Built by keyword only: its fields are many and several share a type."""

    plan: SavePlan
    templates: dict[int, CommitTemplate]
    """The plan's commit templates by generation, shared by its saves (made on rank 0)."""
    layout: LocalLayout
    values: dict[str, bytes]
    storage: Storage
    seq: int
    fingerprint: str
    ready_event: Any
    device: torch.device | None
    response: AsyncSaveResponse
    after_commit: Callable[[], None] | None
    timeout: float
    """Seconds each of this save's waits (on another rank, or on its own staging) may
    take: the call's, fixed for the save's life."""
    started: float = 0.0
    progress: Watermark = field(default_factory=Watermark)
    buffer: torch.Tensor | None = None
    """The staging buffer holding the whole image; ``None`` for a save that streams."""
    ring: PartRing | None = None
    """The slots a save over the staging budget streams through (:mod:`.part_ring`)."""
    generation: int = 0
    """The generation of file names this save writes (see :mod:`..format.names`)."""
    replaced: set[str] = field(default_factory=set)
    """Data files of the committed checkpoint this save replaces, deleted after its commit."""
    replaced_index: str | None = None
    committed: Metadata | None = None
    """The metadata rank 0 committed (other ranks read it back when asked)."""
    snapshot: StagedState | None = None
    """The snapshot (:func:`~.snapshot.stage`) saved, held until the save's writes are done."""
    snapshot_hold: int | None = None
    device_snapshot: DeviceSnapshot | None = None
    """The device snapshot the call gathered the tensors into (:mod:`.device_snapshot`),
    held until its drain to the host buffer has ended; ``None`` when staging copies from
    the state itself."""
    gathered: Any = None
    """The event recorded after that gather (``None`` on CPU), which the drain waits for."""
    storage_meta: StorageMeta | None = None
    """What the committed metadata records as its ``storage_meta`` (a DCP writer's own)."""
    holders: int = 2
    """The stages that still use the staging buffer (staging and upload; upload alone for a
    snapshot written as it is). The buffer goes back to the pool when the last lets go."""
    holders_lock: threading.Lock = field(default_factory=threading.Lock)
    staging_ended: threading.Event = field(default_factory=threading.Event)
    """Set once staging has finished, failed or been skipped, and has let go of the buffer."""
    abandoned: BaseException | None = None
    """Why the upload gave the save up; staging that has not begun copying skips its copy."""

    @property
    def file(self) -> str:
        """This rank's data file, as this save names it."""
        return data_file(self.plan.file, self.generation)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started
