"""One FSDP unit: the flat sharded buffers of a module's own parameters, the parameter views
that stand for them, and the unit's own collectives (gather, release, reduce).

A unit owns the parameters of its module that no nested unit owns. Each is replaced by a
sharded ``DTensor`` (``Shard(0)``) parameter viewing the unit's flat main-weight shard, which
is what ``module.parameters()``, optimizers and checkpoints see. During the unit's forward the
module's parameters are swapped for unsharded ones (views of the unit's unsharded storage);
autograd saves those, so backward uses them after the storage is refilled.

A unit knows nothing of the schedule: :class:`~.context.FsdpContext` decides when it gathers,
releases and reduces, and registers the module hooks that drive it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..core import tracing
from ..core.shapes import row_major_strides
from ..errors import FsdpError
from .collectives import Collectives, InFlight
from .flat_buffer import FlatLayout, FlatShardedBuffer, ParamSlot
from .mixed_precision import MixedPrecision


@dataclass
class ParamRef:
    """One registered parameter attribute (``owner.attr``) and the slot backing it."""

    owner: nn.Module
    attr: str
    group: int
    slot: int


@dataclass(frozen=True)
class OwnParam:
    """A parameter a new unit will own: where it is registered and its name in the unit."""

    owner: nn.Module
    attr: str
    param: nn.Parameter
    name: str


def own_parameters(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> list[OwnParam]:
    """Parameters of ``module``'s tree, stopping at submodules that are already units."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}

    def walk(mod: nn.Module) -> Iterator[nn.Module]:
        yield mod
        for child in mod.children():
            if not is_unit(child):
                yield from walk(child)

    found = []
    for mod in walk(module):
        for attr, param in mod._parameters.items():
            if param is not None:
                pname = f"{names.get(id(mod), type(mod).__name__)}.{attr}".lstrip(".")
                found.append(OwnParam(mod, attr, param, pname))
    return found


@dataclass
class Timing:
    """Seconds of collectives: the caller blocked (``exposed``) and issue to completion."""

    exposed: float = 0.0
    total: float = 0.0

    def add(self, flight: InFlight, rank: int, timeout: float) -> None:
        self.exposed += flight.wait(rank, timeout)
        self.total += flight.seconds()


@dataclass
class PendingGather:
    """A unit's all-gathers in flight: one per dtype group, each into its staging output."""

    unit: FsdpUnit
    flights: list[InFlight]
    outputs: list[torch.Tensor]
    prefetched: bool


@dataclass
class PendingReduce:
    """One dtype group's reduce-scatter in flight, and where its output goes when done."""

    unit: FsdpUnit
    group: int
    flight: InFlight
    output: torch.Tensor
    accumulate: bool


class FsdpUnit:
    """The FSDP state of one module: flat sharded buffers, parameter views, gradients, and
    the unit's gather, release and reduce-scatter through its model's :class:`Collectives`.

    Invariant: the module's registered parameters are the sharded ``DTensor``s except between
    :meth:`use_unsharded` and :meth:`use_sharded` (the unit's forward).
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        found: list[OwnParam],
        comm: Collectives,
        mesh: DeviceMesh,
        mixed_precision: MixedPrecision | None,
    ) -> None:
        self.module = module
        self.comm = comm
        self.name = type(module).__name__
        self.explicit_mp = mixed_precision
        self.mp = mixed_precision or MixedPrecision()
        self.index = index
        self.refs: list[ParamRef] = []
        self.groups: list[FlatShardedBuffer] = []
        self.sharded: list[list[nn.Parameter]] = []
        self.sharded_grads: list[list[DTensor | None]] = []
        self.unsharded: list[list[nn.Parameter]] = []
        self.requires_grad: list[list[bool]] = []
        self.trainable_count = 0
        self.grads_seen = 0
        self.ran_forward = False
        self.reduced = False
        self._shard(found, mesh)

    # -- construction -------------------------------------------------------------------

    def _shard(self, found: list[OwnParam], mesh: DeviceMesh) -> None:
        comm = self.comm
        slot_of: dict[int, tuple[int, int]] = {}
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for own in found:
            param, pname = own.param, own.name
            if isinstance(param, DTensor):
                raise FsdpError(
                    f"unit {self.name}: parameter {pname!r} is already a DTensor (module "
                    "sharded by another FSDP or tensor parallelism); unsupported"
                )
            if param.dim() == 0 or not param.is_floating_point() or param.is_sparse:
                raise FsdpError(
                    f"unit {self.name}: parameter {pname!r} (shape {tuple(param.shape)}, "
                    f"{param.dtype}) is unsupported: need a dense floating tensor with dim >= 1"
                )
            if id(param) in slot_of:
                continue
            group = by_dtype.setdefault(param.dtype, [])
            slot_of[id(param)] = (list(by_dtype).index(param.dtype), len(group))
            group.append((pname, param))

        for dtype, params in by_dtype.items():
            layout = FlatLayout.plan(
                [(n, tuple(p.shape)) for n, p in params], dtype, comm.world_size
            )
            buf = FlatShardedBuffer(layout, comm.rank, [p for _, p in params], comm.device)
            self.groups.append(buf)
            sharded: list[nn.Parameter] = []
            grads: list[DTensor | None] = []
            for slot, (_, p) in zip(layout.slots, params, strict=True):
                main = _shard_view(buf, buf.main, slot, mesh)
                sharded.append(nn.Parameter(main, requires_grad=p.requires_grad))
                grads.append(_shard_view(buf, buf.grad, slot, mesh) if p.requires_grad else None)
            self.sharded.append(sharded)
            self.sharded_grads.append(grads)
            self.requires_grad.append([p.requires_grad for _, p in params])
        for own in found:
            gi, si = slot_of[id(own.param)]
            self.refs.append(ParamRef(own.owner, own.attr, gi, si))
            own.owner._parameters[own.attr] = self.sharded[gi][si]

    def fingerprint(self) -> str:
        return repr(
            (
                self.index,
                self.name,
                [g.layout.fingerprint() for g in self.groups],
                self.requires_grad,
            )
        )

    def finish_init(self, name: str, mp: MixedPrecision) -> None:
        """Lazy init: the unit's name under the root and its resolved precision policy."""
        self.name = name or "<root>"
        self.mp = mp
        self.unsharded = []
        self.trainable_count = 0
        for gi, buf in enumerate(self.groups):
            dtype = mp.param_dtype or buf.layout.dtype
            views = buf.set_compute_dtype(dtype)
            params = []
            for si, view in enumerate(views):
                trainable = self.requires_grad[gi][si]
                params.append(nn.Parameter(view, requires_grad=trainable))
                self.trainable_count += int(trainable)
            self.unsharded.append(params)
        for gi, buf in enumerate(self.groups):
            lay = buf.layout
            self.comm.staging.need(("gather", gi, buf.compute_dtype), lay.gathered_numel)
            if buf.compute_dtype != lay.dtype:
                self.comm.staging.need(("send", gi, buf.compute_dtype), lay.segment_numel)
            rdtype = self._reduce_dtype(buf)
            for slot in (0, 1):
                self.comm.staging.need(("reduce_in", slot, gi, rdtype), lay.gathered_numel)
                self.comm.staging.need(("reduce_out", slot, gi, rdtype), lay.segment_numel)

    def trainable_unsharded(self) -> list[nn.Parameter]:
        """The unsharded parameters that receive gradients (after :meth:`finish_init`)."""
        return [p for params in self.unsharded for p in params if p.requires_grad]

    # -- state ----------------------------------------------------------------------------

    def is_unsharded(self) -> bool:
        return any(g.is_unsharded() for g in self.groups)

    @property
    def unsharded_nbytes(self) -> int:
        return sum(g.unsharded_nbytes for g in self.groups)

    def use_unsharded(self) -> None:
        for ref in self.refs:
            ref.owner._parameters[ref.attr] = self.unsharded[ref.group][ref.slot]

    def use_sharded(self) -> None:
        for ref in self.refs:
            ref.owner._parameters[ref.attr] = self.sharded[ref.group][ref.slot]

    def begin_iteration(self) -> None:
        self.grads_seen = 0
        self.ran_forward = False
        self.reduced = False

    def begin_forward(self) -> None:
        """The unit's forward starts: compute on the unsharded parameters."""
        self.ran_forward = torch.is_grad_enabled()
        self.use_unsharded()

    def grad_arrived(self) -> bool:
        """Count one accumulated gradient; True when it was the unit's last trainable one."""
        self.grads_seen += 1
        return self.grads_seen == self.trainable_count

    # -- gather and release -----------------------------------------------------------------

    def gather(self, prefetched: bool) -> PendingGather:
        """Issue the async all-gather of every dtype group into the shared gather staging."""
        staging = self.comm.staging
        pairs = []
        with tracing.span("slipstream.fsdp.all_gather", unit=self.name, prefetch=prefetched):
            for gi, buf in enumerate(self.groups):
                lay = buf.layout
                cast = buf.compute_dtype != lay.dtype
                send_staging = (
                    staging.take(("send", gi, buf.compute_dtype), lay.segment_numel)
                    if cast
                    else None
                )
                out = staging.take(("gather", gi, buf.compute_dtype), lay.gathered_numel)
                pairs.append((out, buf.send_buffer(send_staging)))
            flights = self.comm.all_gather_into(pairs, f"all-gather of unit {self.name}")
        return PendingGather(self, flights, [out for out, _ in pairs], prefetched)

    def finish_gather(self, pending: PendingGather) -> Timing:
        """Wait for the gathers, re-allocate the unsharded storage and copy the result in."""
        timing = Timing()
        with tracing.span("slipstream.fsdp.all_gather.wait", unit=self.name):
            for flight, out, buf in zip(pending.flights, pending.outputs, self.groups, strict=True):
                timing.add(flight, self.comm.rank, self.comm.timeout)
                buf.reallocate()
                buf.copy_out(out)
        return timing

    def release(self) -> bool:
        """Free the unsharded storage; False when it was not allocated."""
        if not self.is_unsharded():
            return False
        with tracing.span("slipstream.fsdp.release", unit=self.name):
            for g in self.groups:
                g.release()
        return True

    # -- gradients --------------------------------------------------------------------------

    def _reduce_dtype(self, buf: FlatShardedBuffer) -> torch.dtype:
        return self.mp.reduce_dtype or buf.compute_dtype

    def reduced_groups(self) -> list[int]:
        """Dtype groups with at least one trainable parameter."""
        return [gi for gi in range(len(self.groups)) if any(self.requires_grad[gi])]

    def reduce(self, group: int, slot: int) -> PendingReduce:
        """Lay out one group's unsharded gradients in reduce staging ``slot`` and issue their
        async reduce-scatter: straight into the grad shard unless it must be accumulated or
        cast."""
        buf = self.groups[group]
        lay = buf.layout
        rdtype = self._reduce_dtype(buf)
        staging = self.comm.staging
        with tracing.span("slipstream.fsdp.reduce_scatter", unit=self.name):
            reduce_in = staging.take(("reduce_in", slot, group, rdtype), lay.gathered_numel)
            buf.copy_in(self._take_grads(group), reduce_in)
            accumulate = any(p.grad is not None for p in self.sharded[group])
            if accumulate or rdtype != lay.dtype:
                out = staging.take(("reduce_out", slot, group, rdtype), lay.segment_numel)
            else:
                out = buf.grad
            flight = self.comm.reduce_scatter_into(
                out, reduce_in, f"reduce-scatter of unit {self.name}", slot
            )
        return PendingReduce(self, group, flight, out, accumulate)

    def finish_reduce(self, pending: PendingReduce) -> Timing:
        """Wait for the reduce-scatter, land its output in the grad shard, attach ``.grad``."""
        timing = Timing()
        with tracing.span("slipstream.fsdp.reduce_scatter.wait", unit=self.name):
            timing.add(pending.flight, self.comm.rank, self.comm.timeout)
            buf = self.groups[pending.group]
            if pending.accumulate:
                buf.grad.add_(pending.output)
            elif pending.output is not buf.grad:
                buf.grad.copy_(pending.output)
            self._attach_sharded_grads(pending.group)
        return timing

    def _take_grads(self, group: int) -> list[torch.Tensor | None]:
        """The unsharded gradients of one group (``None`` where frozen or unused), cleared."""
        grads = []
        for p in self.unsharded[group]:
            grads.append(p.grad)
            p.grad = None
        return grads

    def _attach_sharded_grads(self, group: int) -> None:
        """Point each trainable sharded parameter's ``.grad`` at its slice of the grad shard
        (``DTensor`` views made once in :meth:`_shard`, not every step)."""
        for p, grad in zip(self.sharded[group], self.sharded_grads[group], strict=True):
            if grad is not None and p.grad is None:
                p.grad = grad


def _shard_view(
    buf: FlatShardedBuffer, flat: torch.Tensor, slot: ParamSlot, mesh: DeviceMesh
) -> DTensor:
    """This rank's ``Shard(0)`` rows of ``slot``'s parameter in the flat segment ``flat`` (the
    main weights or the gradients of ``buf``), as a DTensor viewing that memory."""
    return DTensor.from_local(
        buf.local_view(flat, slot),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(slot.shape),
        stride=row_major_strides(slot.shape),
    )
