"""FsdpContext: the schedule of one model's units. It registers the hooks that drive them,
decides when each unit gathers, releases and reduces, and keeps the delay queue; the units
run their collectives themselves (:mod:`.unit`, :mod:`.collectives`).

Schedule. The first iteration records the order units are called in forward and in backward;
each call in that iteration is first checked across ranks with a tiny all-gather of
``(phase, position, unit)``, so ranks that disagree raise :class:`FsdpError` instead of
pairing mismatched collectives. Later iterations check each call against the record locally
and, before a unit computes, issue the all-gather of the next unit in the record (prefetch).

Overlap. All-gathers and reduce-scatters are issued from the caller's thread as async work
(``async_op=True``; on an accelerator under the shared communication stream). On CPU gloo
runs them on its own threads while the caller computes. They write into staging buffers
allocated once at the first forward (``out=``), sized to the largest unit.

Invariants:
- compute on a unit waits for its all-gather (and copy-out) to complete;
- at most one all-gather is in flight (the gather staging is reused), at most two
  reduce-scatters (double-buffered reduce staging);
- a unit's unsharded storage is released only when a later gather needs room, so at most
  ``release_delay`` non-root units are unsharded. It is allocated on the compute stream and
  read only there, so the host frees it without waiting for the device: the caching
  allocator hands that memory out again only to work queued behind its last reader;
- before the optimizer can run (end of backward) every reduce-scatter has been waited on and
  every unit resharded;
- every wait has a timeout.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections import deque
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from ..errors import FsdpError
from .collectives import Collectives
from .mixed_precision import MixedPrecision
from .unit import FsdpUnit, PendingGather, PendingReduce, Timing, own_parameters


@dataclass
class FsdpStats:
    """What the context measured since construction or :meth:`FsdpContext.reset_stats`.

    ``peak_live_units`` counts non-root units whose unsharded storage was allocated at the
    same time (measured from the storages after every re-allocation);
    ``peak_unsharded_bytes`` includes the root. ``allgather_seconds`` sums issue-to-completion
    times; ``allgather_exposed_seconds`` is the time the caller blocked waiting on them.
    """

    peak_live_units: int = 0
    peak_unsharded_bytes: int = 0
    allgather_count: int = 0
    prefetch_count: int = 0
    allgather_seconds: float = 0.0
    allgather_exposed_seconds: float = 0.0
    reduce_scatter_count: int = 0
    reduce_scatter_seconds: float = 0.0
    reduce_scatter_exposed_seconds: float = 0.0
    release_count: int = 0

    @property
    def hidden_allgather_fraction(self) -> float:
        """Share of all-gather time the caller did not wait for (0 when nothing gathered)."""
        if self.allgather_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.allgather_exposed_seconds / self.allgather_seconds)


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise FsdpError("FsdpContext needs an initialized torch.distributed process group")
    return world


class _Phase(Enum):
    IDLE = 0
    FORWARD = 1
    FORWARD_DONE = 2
    BACKWARD = 3


_PHASE_END = -1


class _Schedule:
    """The order units run in one phase: recorded on the first iteration, enforced after."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.recorded: list[FsdpUnit] | None = None
        self.current: list[FsdpUnit] = []

    def next_unit(self) -> FsdpUnit | None:
        if self.recorded is None or len(self.current) >= len(self.recorded):
            return None
        return self.recorded[len(self.current)]

    def check_local(self, unit: FsdpUnit) -> None:
        expected = self.next_unit()
        if expected is not unit:
            want = expected.name if expected is not None else "no further unit"
            raise FsdpError(
                f"{self.phase} order changed: unit {unit.name} ran at position "
                f"{len(self.current)} where the first iteration ran {want}; FSDP units must "
                "run in the same order every iteration"
            )


class FsdpContext:
    """Schedules the units of one model: registers their module and gradient hooks, keeps
    the recorded order, the delay queue, the gather in flight and the reduce-scatters in
    flight, and measures :class:`FsdpStats`. The collectives themselves are the units' own
    (through the shared :class:`Collectives`: process group, stream, staging, timeout).

    ``release_delay`` bounds how many non-root units may be unsharded at once; with 2 the next
    unit's all-gather overlaps the current unit's compute. ``overlap_reduce_scatter=False``
    waits for each reduce-scatter as soon as it is issued: better when compute itself
    saturates the host's cores (CPU training), where a collective running beside it only
    competes for them. ``timeout`` bounds every wait.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        release_delay: int = 2,
        *,
        device: torch.device | str = "cpu",
        overlap_reduce_scatter: bool = True,
        timeout: float = 300.0,
    ) -> None:
        if release_delay < 1:
            raise FsdpError(f"release_delay must be >= 1, got {release_delay}")
        if not dist.is_initialized():
            raise FsdpError("FsdpContext needs an initialized torch.distributed process group")
        self.group = group or _world()
        self.device = torch.device(device)
        self.comm = Collectives(self.group, self.device, timeout)
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        self.release_delay = release_delay
        self.overlap_reduce_scatter = overlap_reduce_scatter
        self.stats = FsdpStats()
        self.units: list[FsdpUnit] = []
        self._unit_of_module: dict[int, FsdpUnit] = {}
        self._param_owner: dict[int, tuple[weakref.ref[torch.Tensor], FsdpUnit]] = {}
        self._initialized = False
        self._root: FsdpUnit | None = None
        self._phase = _Phase.IDLE
        self._forward = _Schedule("forward")
        self._backward = _Schedule("backward")
        self._delay_queue: deque[FsdpUnit] = deque()
        self._inflight: PendingGather | None = None
        self._reduces: deque[PendingReduce] = deque()
        self._reduce_slot = 0
        self._backward_open: list[FsdpUnit] = []

    # -- registration ---------------------------------------------------------------------

    def unit_of(self, module: nn.Module) -> FsdpUnit | None:
        return self._unit_of_module.get(id(module))

    def param_owner(self, param: torch.Tensor) -> FsdpUnit | None:
        """The unit that manages ``param`` (its sharded parameter or the original it replaced)."""
        entry = self._param_owner.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def _claim(self, param: torch.Tensor, unit: FsdpUnit) -> None:
        """Record ``unit`` as ``param``'s owner (weakly: originals may be freed)."""
        self._param_owner[id(param)] = (weakref.ref(param), unit)

    def shard(self, module: nn.Module, mixed_precision: MixedPrecision | None) -> FsdpUnit:
        """Make ``module`` a unit owning the parameters no nested unit owns, and hook it."""
        if self._initialized:
            raise FsdpError(f"unit {type(module).__name__}: fully_shard after the first forward")
        found = own_parameters(module, lambda m: self.unit_of(m) is not None)
        for own in found:
            owner = self.param_owner(own.param)
            if owner is not None:
                raise FsdpError(
                    f"parameter {own.name!r} of unit {type(module).__name__} is already "
                    f"managed by unit {owner.name}: a parameter shared across units is not "
                    "supported (tie weights inside one unit, or call fully_shard bottom-up)"
                )
        unit = FsdpUnit(module, len(self.units), found, self.comm, self.mesh, mixed_precision)
        for params in unit.sharded:
            for p in params:
                self._claim(p, unit)
        for own in found:
            self._claim(own.param, unit)
        self._unit_of_module[id(module)] = unit
        self.units.append(unit)
        module.register_forward_pre_hook(
            functools.partial(self._on_pre_forward, unit), prepend=True, with_kwargs=True
        )
        module.register_forward_hook(functools.partial(self._on_post_forward, unit))
        return unit

    def live_units(self) -> list[str]:
        """Names of the non-root units whose unsharded storage is allocated right now."""
        return [u.name for u in self.units if u is not self._root and u.is_unsharded()]

    def reset_stats(self) -> None:
        self.stats = FsdpStats()

    # -- hooks (all on the caller's thread) -----------------------------------------------

    def _on_pre_forward(
        self, unit: FsdpUnit, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        self.pre_forward(unit)
        unit.begin_forward()
        return unit.mp.cast_inputs(args, kwargs)

    def _on_post_forward(
        self, unit: FsdpUnit, module: nn.Module, args: tuple[object, ...], output: object
    ) -> object:
        """Reshard the module's parameters; the first gradient reaching any output is the
        unit's pre-backward (a multi-grad hook)."""
        unit.use_sharded()
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._on_pre_backward, unit), mode="any"
                )
        self.post_forward(unit)
        return output

    def _on_pre_backward(self, unit: FsdpUnit, grad: torch.Tensor) -> None:
        self.pre_backward(unit)

    def _on_grad_accumulated(self, unit: FsdpUnit, param: torch.Tensor) -> None:
        """The last trainable gradient of ``unit`` is its post-backward."""
        if unit.grad_arrived():
            self.post_backward(unit)

    # -- lazy init ------------------------------------------------------------------------

    def _lazy_init(self, root: FsdpUnit) -> None:
        names = {id(m): n for n, m in root.module.named_modules()}
        outside = [u.name for u in self.units if id(u.module) not in names]
        if outside:
            raise FsdpError(
                f"units {outside} are not inside the root unit {root.name} that ran first; "
                "shard the whole model with one outer fully_shard call"
            )
        self._root = root
        for unit in self.units:
            mp = unit.explicit_mp
            ancestors = [
                u
                for u in self.units
                if u.explicit_mp is not None
                and any(m is unit.module for m in u.module.modules())
                and u is not unit
            ]
            if mp is None and ancestors:
                mp = min(ancestors, key=lambda u: sum(1 for _ in u.module.modules())).explicit_mp
            unit.finish_init(names[id(unit.module)], mp or unit.mp)
            for p in unit.trainable_unsharded():
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    functools.partial(self._on_grad_accumulated, unit)
                )
        self._check_layouts_agree()
        self.comm.staging.allocate()
        self._initialized = True

    def _check_layouts_agree(self) -> None:
        """One small all-gather of a layout hash; on mismatch, name the first differing unit."""
        digest = hashlib.sha1(repr([u.fingerprint() for u in self.units]).encode()).digest()
        mine = torch.tensor(
            [len(self.units), int.from_bytes(digest[:7], "little")],
            dtype=torch.int64,
            device=self.device,
        )
        every = self.comm.exchange(mine)
        if bool((every.view(-1, 2) == mine).all()):
            return
        prints: list[list[str] | None] = [None] * self.comm.world_size
        dist.all_gather_object(prints, [u.fingerprint() for u in self.units], group=self.group)
        ours = prints[self.comm.rank] or []
        for rank, theirs in enumerate(prints):
            theirs = theirs or []
            if theirs == ours:
                continue
            for i in range(max(len(theirs), len(ours))):
                a = ours[i] if i < len(ours) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    name = self.units[i].name if i < len(self.units) else f"#{i}"
                    raise FsdpError(
                        f"ranks disagree on the FSDP layout: unit {name} (unit #{i}) on rank "
                        f"{self.comm.rank} is {a}, on rank {rank} it is {b}"
                    )
        raise FsdpError("ranks disagree on the FSDP layout hash")

    # -- gathers and releases -------------------------------------------------------------

    def _live_children(self) -> int:
        n = sum(1 for u in self.units if u is not self._root and u.is_unsharded())
        inflight = self._inflight
        if inflight is not None and inflight.unit is not self._root:
            n += 0 if inflight.unit.is_unsharded() else 1
        return n

    def _make_room(self, unit: FsdpUnit) -> bool:
        """Release delayed units (oldest first) until ``unit`` fits under ``release_delay``."""
        if unit is self._root:
            return True
        while self._live_children() + 1 > self.release_delay and self._delay_queue:
            self._release(self._delay_queue.popleft())
        return self._live_children() + 1 <= self.release_delay

    def _release(self, unit: FsdpUnit) -> None:
        if unit.release():
            self.stats.release_count += 1

    def _issue_gather(self, unit: FsdpUnit, prefetched: bool) -> PendingGather:
        if self._inflight is not None:
            self._finish_gather(self._inflight)
        pending = unit.gather(prefetched)
        self._inflight = pending
        self.stats.allgather_count += len(pending.flights)
        self.stats.prefetch_count += int(prefetched)
        return pending

    def _finish_gather(self, pending: PendingGather) -> None:
        timing = pending.unit.finish_gather(pending)
        self.stats.allgather_exposed_seconds += timing.exposed
        self.stats.allgather_seconds += timing.total
        self._inflight = None
        self._measure()

    def _measure(self) -> None:
        live = [u for u in self.units if u.is_unsharded()]
        children = sum(1 for u in live if u is not self._root)
        nbytes = sum(u.unsharded_nbytes for u in live)
        self.stats.peak_live_units = max(self.stats.peak_live_units, children)
        self.stats.peak_unsharded_bytes = max(self.stats.peak_unsharded_bytes, nbytes)

    def _unshard(self, unit: FsdpUnit) -> None:
        """Make ``unit``'s unsharded parameters valid: reuse, finish a prefetch, or gather now."""
        if unit in self._delay_queue:
            self._delay_queue.remove(unit)
        if self._inflight is not None and self._inflight.unit is unit:
            self._finish_gather(self._inflight)
            return
        if unit.is_unsharded() or not unit.groups:
            return
        self._make_room(unit)
        self._finish_gather(self._issue_gather(unit, prefetched=False))

    def _prefetch(self, schedule: _Schedule) -> None:
        nxt = schedule.next_unit()
        if nxt is None or nxt.is_unsharded() or not nxt.groups:
            return
        if self._inflight is not None:
            return
        if self._make_room(nxt):
            self._issue_gather(nxt, prefetched=True)

    def _release_all(self) -> None:
        if self._inflight is not None:
            self._finish_gather(self._inflight)
        self._delay_queue.clear()
        for unit in self.units:
            self._release(unit)

    # -- order checks ---------------------------------------------------------------------

    def _check_across_ranks(self, phase: str, position: int, unit: FsdpUnit | None) -> None:
        """First iteration only: every rank must run the same unit at this position."""
        code = {"forward": 0, "backward": 1}[phase]
        index = _PHASE_END if unit is None else unit.index
        mine = torch.tensor([code, position, index], dtype=torch.int64, device=self.device)
        rows = self.comm.exchange(mine).view(-1, 3).tolist()
        for rank, (c, pos, idx) in enumerate(rows):
            if (c, pos, idx) != (code, position, index):

                def label(i: int) -> str:
                    return "the end of the phase" if i == _PHASE_END else self.units[i].name

                raise FsdpError(
                    f"ranks disagree on the FSDP call order: at {phase} position {position} "
                    f"rank {self.comm.rank} runs {label(index)}, rank {rank} runs "
                    f"{label(idx)} ({'backward' if c else 'forward'} position {pos})"
                )

    def _enter(self, schedule: _Schedule, unit: FsdpUnit) -> None:
        if unit in schedule.current:
            raise FsdpError(
                f"unit {unit.name} ran twice in one {schedule.phase} pass; a unit may run once "
                "per iteration (shard repeated modules as separate units)"
            )
        if schedule.recorded is None:
            self._check_across_ranks(schedule.phase, len(schedule.current), unit)
        else:
            schedule.check_local(unit)
        schedule.current.append(unit)

    def _close(self, schedule: _Schedule) -> None:
        if schedule.recorded is None:
            self._check_across_ranks(schedule.phase, len(schedule.current), None)
            schedule.recorded = list(schedule.current)
        elif len(schedule.current) != len(schedule.recorded):
            raise FsdpError(
                f"{schedule.phase} ran {len(schedule.current)} units where the first iteration "
                f"ran {len(schedule.recorded)}"
            )
        schedule.current = []

    # -- forward --------------------------------------------------------------------------

    def pre_forward(self, unit: FsdpUnit) -> None:
        if self._phase is not _Phase.FORWARD:
            self._begin_iteration(unit)
            return
        self._enter(self._forward, unit)
        self._unshard(unit)
        self._prefetch(self._forward)

    def _begin_iteration(self, root: FsdpUnit) -> None:
        if self._phase is _Phase.BACKWARD:
            raise FsdpError(f"unit {root.name}: forward started while backward is running")
        if not self._initialized:
            self._lazy_init(root)
        elif root is not self._root:
            current = self._root.name if self._root is not None else None
            raise FsdpError(f"unit {root.name} started a forward but the root unit is {current}")
        if self._phase is _Phase.FORWARD_DONE:
            self._end_iteration(backward_ran=False)
        for u in self.units:
            u.begin_iteration()
        self._phase = _Phase.FORWARD
        self._unshard(root)
        self._prefetch(self._forward)

    def post_forward(self, unit: FsdpUnit) -> None:
        if unit is self._root:
            self._close(self._forward)
            self._phase = _Phase.FORWARD_DONE
            if not any(u.ran_forward for u in self.units):
                self._end_iteration(backward_ran=False)
            return
        self._delay_queue.append(unit)

    # -- backward -------------------------------------------------------------------------

    def pre_backward(self, unit: FsdpUnit) -> None:
        if self._phase is _Phase.FORWARD_DONE:
            self._phase = _Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self._phase is not _Phase.BACKWARD:
            raise FsdpError(f"unit {unit.name}: backward outside an FSDP iteration")
        for done in [u for u in self._backward_open if u.trainable_count == 0]:
            self._backward_open.remove(done)
            self._delay_queue.append(done)
        if unit is not self._root:
            self._enter(self._backward, unit)
            self._backward_open.append(unit)
        self._unshard(unit)
        self._prefetch(self._backward)

    def post_backward(self, unit: FsdpUnit) -> None:
        """All of ``unit``'s trainable gradients exist: reduce-scatter them, queue release."""
        self._reduce(unit)
        if unit is not self._root:
            if unit in self._backward_open:
                self._backward_open.remove(unit)
            self._delay_queue.append(unit)

    def _reduce(self, unit: FsdpUnit) -> None:
        """Issue ``unit``'s reduce-scatters into alternating staging slots, at most two in
        flight (waiting for the oldest first)."""
        unit.reduced = True
        for gi in unit.reduced_groups():
            while len(self._reduces) >= 2:
                self._finish_reduce(self._reduces.popleft())
            slot = self._reduce_slot
            self._reduce_slot ^= 1
            self._reduces.append(unit.reduce(gi, slot))
            self.stats.reduce_scatter_count += 1
            if not self.overlap_reduce_scatter:
                self._finish_reduce(self._reduces.popleft())

    def _finish_reduce(self, pending: PendingReduce) -> None:
        timing: Timing = pending.unit.finish_reduce(pending)
        self.stats.reduce_scatter_exposed_seconds += timing.exposed
        self.stats.reduce_scatter_seconds += timing.total

    def _finish_backward(self) -> None:
        for unit in self.units:
            if unit.ran_forward and unit.trainable_count and not unit.reduced:
                self._reduce(unit)
        self._end_iteration(backward_ran=True)

    def _end_iteration(self, backward_ran: bool) -> None:
        """Wait every reduce-scatter, reshard every unit, close the schedules."""
        while self._reduces:
            self._finish_reduce(self._reduces.popleft())
        self._release_all()
        self._backward_open.clear()
        if backward_ran:
            self._close(self._backward)
        else:
            self._backward.current = []
        for unit in self.units:
            unit.use_sharded()
        self._phase = _Phase.IDLE

    def wait(self) -> None:
        """Block until every collective this context issued has completed."""
        if self._inflight is not None:
            self._finish_gather(self._inflight)
        while self._reduces:
            self._finish_reduce(self._reduces.popleft())
