"""One staged copy of a state dict that a checkpoint and a weight publish both read.

:func:`stage` copies every tensor (DTensors: this rank's shards) into one reused host
buffer laid out as this rank's checkpoint image would be: each tensor a framed record,
64-byte aligned, in state-dict order. It returns a :class:`StagedState`, a read-only
mapping shaped like the state dict whose tensors are views of that buffer. Then

- ``Checkpointer.save(step, snap)`` / ``ss.async_save(snap, ...)`` write the buffer as it is
  when the save plan gives this rank the same records (one rank, or every tensor sharded),
  and copy out of it otherwise (plain tensors replicated over several ranks are written by
  one of them);
- ``WeightPublisher.publish(snap["model"], version=step)`` reads its tensors from it.

Lifetime: each movement holds the snapshot while it reads it (a save until its writes are
done, a publish until its bytes have left or been copied) and lets go after. Each state has
a buffer of its own: buffers are keyed by the layout *and* the storage of the state's
tensors, so a policy and its EMA copy (one layout, other tensors) never share one. A later
:func:`stage` of the same state reuses its buffer only once nobody holds it and no other
:func:`stage` is copying into it (it waits, up to ``timeout``, then raises naming the
holders), and from then on the older :class:`StagedState` is *expired*: saving or
publishing it raises. A buffer is freed, once idle, when a tensor of its state was freed
or its state is staged with another layout.

Invariant: a buffer is never written while a save or publish holds a snapshot of it, nor
by two :func:`stage` calls at once; a hold is only ever taken on the generation a buffer
holds whole.
"""

from __future__ import annotations

import copy
import enum
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...core import streams
from ...core.buffers import allocate_host
from ...core.flatten import flatten, resolve_stateful, unflatten
from ...errors import CheckpointError, PeerTimeoutError
from .layout import LayoutSignature, LocalLayout, local_layout
from .messages import LayoutDescription
from .plan import RecordPlan, SavePlan, make_save_plan
from .record_copy import copy_records, record_view

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

#: How long :func:`stage` waits for the readers of the buffer it is about to reuse.
DEFAULT_TIMEOUT = 600.0


class BufferState(enum.Enum):
    """What a buffer's image is now."""

    READY = "ready"
    """Whole: the generation it holds may be held and read."""
    STAGING = "staging"
    """A :func:`stage` is copying a new generation into it."""


_SourceKey = tuple[tuple[str, int], ...]
_BufferKey = tuple[LayoutSignature, _SourceKey]


def _source_key(layout: LocalLayout) -> _SourceKey:
    """Which tensors a state's are: the device and storage address of each."""
    return tuple((str(t.device), t.untyped_storage().data_ptr()) for t in layout.tensors.values())


def _weak(tensor: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``tensor``'s storage (torch's, which sees the storage itself
    freed, not a Python wrapper of it)."""
    return StorageWeakRef(tensor.untyped_storage())  # type: ignore[no-untyped-call]


class _Buffer:
    """One state's host image, who reads it now, how many times it was staged, and
    whether a :func:`stage` is copying into it."""

    def __init__(self, plan: SavePlan, pin: bool, layout: LocalLayout) -> None:
        self.plan = plan
        self.image = allocate_host(max(plan.image_bytes, 1), pin)
        plan.write_frames(self.image)
        self.holders: dict[int, str] = {}
        self.generation = 0
        self.state = BufferState.READY
        self._next_hold = 0
        self.lock = threading.Condition()
        self._watch(layout)

    def _watch(self, layout: LocalLayout) -> None:
        self._refs = [_weak(t) for t in layout.tensors.values()]

    def source_freed(self) -> bool:
        """Whether a tensor of the state this buffer copies was freed."""
        return any(bool(r.expired()) for r in self._refs)  # type: ignore[no-untyped-call]

    def idle(self) -> bool:
        with self.lock:
            return not self.holders and self.state is BufferState.READY

    def claim(self, timeout: float, layout: LocalLayout) -> int:
        """Wait (up to ``timeout``) until nobody holds the buffer and no other
        :func:`stage` copies into it, then take it for a new generation, in one step: no
        hold can land between the wait and the claim. Returns the new generation."""
        with self.lock:
            if not self.lock.wait_for(
                lambda: not self.holders and self.state is BufferState.READY, timeout
            ):
                who = sorted(self.holders.values()) or ["another stage() copying into it"]
                raise PeerTimeoutError(
                    f"stage(): the previous snapshot of this state is still read after "
                    f"{timeout:.1f} s by {who}; its buffer cannot be reused yet"
                )
            self.state = BufferState.STAGING
            self.generation += 1
            self._watch(layout)
            return self.generation

    def ready(self) -> None:
        """The copy of a :meth:`claim` ended (done or failed): others may claim or hold."""
        with self.lock:
            self.state = BufferState.READY
            self.lock.notify_all()

    def hold(self, who: str, generation: int) -> int:
        with self.lock:
            if generation != self.generation:
                raise CheckpointError(
                    f"{who}: this snapshot expired: a later stage() of the same state reused "
                    "its buffer"
                )
            self._next_hold += 1
            self.holders[self._next_hold] = who
            return self._next_hold

    def release(self, hold: int) -> None:
        with self.lock:
            self.holders.pop(hold, None)
            self.lock.notify_all()


_buffers: dict[_BufferKey, _Buffer] = {}
_buffers_lock = threading.Lock()


class StagedState(Mapping[str, Any]):
    """A state dict staged by :func:`stage` (or one of its sub-dicts): read-only, its
    tensors views of the snapshot's host buffer, its plain values copied at staging time.

    Pass it (or ``snap[key]``) wherever the state dict would go: ``Checkpointer.save``,
    ``ss.async_save``, ``WeightPublisher.publish``. It is a
    :class:`~slipstream.core.holds.Holdable`: a reader holds it while it reads.
    """

    def __init__(
        self,
        tree: Mapping[str, Any],
        layout: LocalLayout,
        buffer: _Buffer,
        generation: int,
        path: tuple[str, ...] = (),
        seconds: float = 0.0,
    ) -> None:
        self._tree = tree
        self.layout = layout
        self._buffer = buffer
        self._generation = generation
        self.path = path
        self.seconds = seconds
        """How long :func:`stage` took to copy the state."""

    def __getitem__(self, key: str) -> Any:
        value = self._tree[key]
        if isinstance(value, Mapping):
            path = (*self.path, key)
            return StagedState(value, self.layout, self._buffer, self._generation, path)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._tree)

    def __len__(self) -> int:
        return len(self._tree)

    def __repr__(self) -> str:
        where = ".".join(self.path) or "state"
        return f"StagedState({where}, {len(self)} entries, {self.nbytes} bytes staged)"

    @property
    def nbytes(self) -> int:
        """Host bytes of the whole snapshot's buffer (shared by its sub-dicts)."""
        return int(self._buffer.image.numel())

    @property
    def buffer(self) -> torch.Tensor:
        """The host image (``uint8``): this rank's checkpoint records, framed."""
        if self.expired:
            raise CheckpointError(
                "this snapshot expired: a later stage() of the same state reused its buffer"
            )
        return self._buffer.image

    @property
    def records(self) -> list[RecordPlan]:
        """Where each tensor's record lies in :attr:`buffer`."""
        return self._buffer.plan.records

    @property
    def readers(self) -> list[str]:
        """Who holds the snapshot now (saves, publishes)."""
        with self._buffer.lock:
            return sorted(self._buffer.holders.values())

    @property
    def expired(self) -> bool:
        """True once a later :func:`stage` reused the buffer."""
        return self._buffer.generation != self._generation

    def hold(self, who: str) -> int:
        """Keep the buffer from being reused until :meth:`release`; ``who`` names the
        reader in errors. Raises if the snapshot already expired."""
        return self._buffer.hold(who, self._generation)

    def release(self, hold: int) -> None:
        """Let go of a :meth:`hold`."""
        self._buffer.release(hold)

    def image_matches(self, plan: SavePlan) -> bool:
        """Whether ``plan`` has this rank write exactly the snapshot's records, so the
        buffer can be written as it is."""

        def layout(records: list[RecordPlan]) -> list[tuple[Any, ...]]:
            return [(r.chunk, r.offset, r.length, r.data_offset, r.nbytes) for r in records]

        return not self.path and layout(self._buffer.plan.records) == layout(plan.records)


def stage(state_dict: Mapping[str, Any], timeout: float = DEFAULT_TIMEOUT) -> StagedState:
    """Copy ``state_dict``'s tensors into a reused host buffer; return the snapshot.

    Returns once everything is copied: the state may change from then on. Stateful values
    at the top level are replaced by their ``state_dict()``; plain values are deep-copied.
    Device tensors are copied into pinned memory on the current stream, then waited for.
    Before reusing the buffer of an earlier snapshot of the same layout, waits (up to
    ``timeout`` seconds) until no save or publish holds it.
    """
    started = time.perf_counter()
    resolved = resolve_stateful(state_dict)
    layout = local_layout(resolved)
    flat, _ = flatten(resolved)
    buffer = _buffer_for(layout)
    generation = buffer.claim(timeout, layout)
    try:
        for device in copy_records(buffer.image, buffer.plan.records, layout.tensors):
            stream = streams.current_stream(device)
            if stream is not None:
                stream.synchronize()
    finally:
        buffer.ready()
    views = {rec.chunk.record_key: record_view(buffer.image, rec) for rec in buffer.plan.records}
    staged = replace(layout, tensors=views, values=copy.deepcopy(layout.values))
    tree = unflatten({**_leaves(staged, flat), **staged.values}, layout.paths)
    return StagedState(tree, staged, buffer, generation, seconds=time.perf_counter() - started)


def _buffer_for(layout: LocalLayout) -> _Buffer:
    """The buffer of this state in ``layout`` (made on its first stage). Idle buffers of
    states a tensor of which was freed, and of this state in another layout, are freed."""
    sources = _source_key(layout)
    key = (layout.signature, sources)
    with _buffers_lock:
        buffer = _buffers.get(key)
        for other in [k for k, b in _buffers.items() if k != key and b.idle()]:
            if other[1] == sources or _buffers[other].source_freed():
                del _buffers[other]
        if buffer is None:
            plan = make_save_plan(0, [LayoutDescription.of(layout)], [layout.fingerprint()])
            pin = torch.cuda.is_available() and any(
                streams.is_accelerator(t.device) for t in layout.tensors.values()
            )
            buffer = _buffers[key] = _Buffer(plan, pin, layout)
        return buffer


def _leaves(staged: LocalLayout, flat: Mapping[str, Any]) -> dict[str, Any]:
    """Each tensor of the (flattened) state dict as the snapshot shows it: a view of the
    buffer, or for a DTensor a DTensor over a view of its shard."""
    leaves: dict[str, Any] = {}
    by_fqn: dict[str, list[str]] = {}
    for c in staged.chunks:
        by_fqn.setdefault(c.fqn, []).append(c.record_key)
    for fqn, keys in by_fqn.items():
        original = flat[fqn]
        local = staged.tensors[keys[0]]
        if DTensor is not None and isinstance(original, DTensor):
            if len(keys) != 1:
                raise CheckpointError(f"{fqn!r}: a DTensor whose shard is several chunks")
            leaves[fqn] = DTensor.from_local(
                local,
                original.device_mesh,
                original.placements,
                run_check=False,
                shape=original.shape,
                stride=original.stride(),
            )
        else:
            leaves[fqn] = local
    return leaves
