"""The knobs of a checkpoint save, in one place: every default a save uses is here."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.buffers import PAGE_BYTES

STREAM_SLOTS = 4
"""The part-sized slots a save larger than ``SaveOptions.staging_budget_bytes`` streams
through (see :mod:`.part_ring`): each a quarter of the budget, cut to whole pages."""


@dataclass
class SaveOptions:
    """Knobs of :class:`CheckpointSaver`; the defaults suit most jobs."""

    timeout: float = 600.0
    """Seconds any wait on another rank may take before failing with the rank's name."""
    io_threads: int = 4
    """Parallel writes per rank."""
    write_piece_bytes: int = 64 * 1024 * 1024
    """Size of the pieces a data file is cut into for ``io_threads`` to write in parallel;
    a positive multiple of the page (4096 bytes), so that ``O_DIRECT`` writes stay page-aligned."""
    staging_budget_bytes: int | None = None
    """Upper bound on host staging memory; ``None`` means the size of one save. A save that
    fits stages into one buffer reused by every save of its layout; a larger one streams
    through :data:`STREAM_SLOTS` part-sized slots of the budget, each written and given back
    before it takes the next part: memory traded for time, since ``staging_completion`` (the
    moment the caller may change its state) then waits for the writes of all but the last
    few parts. At least ``STREAM_SLOTS`` pages (4096 bytes each). A device snapshot drains
    through the slots too (on an accelerator ``staging_completion`` still comes at the
    call); one in host memory (on CPU) is no larger than the budget unless
    ``device_snapshot_bytes`` says otherwise. docs/save-cost.md, "Staging under a memory
    budget"."""
    pin_memory: bool | None = None
    """Pin staging buffers; ``None`` pins when the state lives on an accelerator."""
    device_snapshot: bool | None = None
    """Take each save first as a snapshot on the state's own device: the call gathers the
    tensors into one reused buffer there in a few fused copies and ``staging_completion``
    resolves at once (work queued after the call on the caller's stream runs after the
    gather); the snapshot then drains to the host staging buffer in a few large copies on a
    side stream. ``None``: on accelerators; ``True`` also on CPU, where the snapshot is host
    memory and the call makes the copy; ``False``: stage straight to the host buffer, one
    copy per tensor. docs/save-cost.md, "Saving from a GPU", says more."""
    device_snapshot_bytes: int | None = None
    """Most bytes the device snapshot may take; a save it does not fit stages straight to
    the host buffer, and the saver logs that once. ``None``: half of the memory the device
    has free when a layout is first saved (for a snapshot in host memory,
    ``staging_budget_bytes``, or no limit without one)."""
    keep_device_snapshot: bool = False
    """Keep the device snapshot's buffer between saves, for the next save of the layout to
    gather into (no allocation per save). ``False`` (the default): the buffer goes back to
    the device's caching allocator as soon as the save's drain ends, so between saves the
    snapshot holds no device memory and the training step can use it all; each save then
    takes it again (from the allocator's cache, usually without a device allocation)."""
    direct_io: bool = True
    """On the local disk, write data files with ``O_DIRECT`` where the filesystem allows it
    (see :class:`~..storage.local.LocalDataWriter`)."""
    split_copy: bool = False
    """Experimental, off by default: stage CPU tensors with two threads, the staging thread
    copying the first half of the bytes front to back (so writes start at once) while a
    second thread copies the rest. Staging finishes sooner, but where every core trains the
    second thread takes CPU from the training loop; docs/save-cost.md has the measurements."""
    thread_nice: int = 5
    """Nice increment of the saver's own threads (Linux), so that on oversubscribed cores
    staging and upload give way to the training thread; 0 keeps the caller's priority."""
    idle_threads: bool = False
    """Experimental, off by default: run the saver's threads under Linux's ``SCHED_IDLE``
    policy instead (``thread_nice`` where it is refused): they use only time no other thread
    wants, and a training thread that wakes takes its core back at once. Where the cores are
    all busy, a save then makes progress only once the training loop waits for it, and a
    saver that falls behind stalls the next save call; docs/benchmark-history.md has
    the measurements."""

    def __post_init__(self) -> None:
        if self.device_snapshot_bytes is not None and self.device_snapshot_bytes < 0:
            raise ValueError(
                f"SaveOptions.device_snapshot_bytes={self.device_snapshot_bytes}: must be >= 0 "
                "(0 turns the device snapshot off) or None"
            )
        if (
            self.staging_budget_bytes is not None
            and self.staging_budget_bytes < STREAM_SLOTS * PAGE_BYTES
        ):
            raise ValueError(
                f"SaveOptions.staging_budget_bytes={self.staging_budget_bytes}: must be at "
                f"least {STREAM_SLOTS * PAGE_BYTES} ({STREAM_SLOTS} parts of one "
                f"{PAGE_BYTES}-byte page each, the least a save can stream through) or None"
            )
        if self.write_piece_bytes <= 0 or self.write_piece_bytes % PAGE_BYTES:
            raise ValueError(
                f"SaveOptions.write_piece_bytes={self.write_piece_bytes}: must be a positive "
                f"multiple of {PAGE_BYTES}"
            )
