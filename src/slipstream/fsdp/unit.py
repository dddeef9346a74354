"""``fully_shard``: turn a module into an FSDP unit managed by an :class:`FsdpContext`.

A unit owns the parameters of its module that no nested unit owns. Each is replaced by a
sharded ``DTensor`` (``Shard(0)``) parameter viewing the unit's flat main-weight shard, which
is what ``module.parameters()``, optimizers and checkpoints see. During the unit's forward the
module's parameters are swapped for unsharded ones (views of the unit's unsharded storage);
autograd saves those, so backward uses them after the storage is refilled.

Hooks (all on the caller's thread): forward pre/post hooks on the module; a multi-grad hook
on the forward outputs as the pre-backward hook; a post-accumulate-grad hook on every
trainable unsharded parameter, whose last firing is the unit's post-backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_flatten

from ..errors import FsdpError
from .context import FsdpContext
from .flat_buffer import FlatLayout, FlatShardedBuffer
from .mixed_precision import MixedPrecision


@dataclass
class ParamRef:
    """One registered parameter attribute (``owner.attr``) and the slot backing it."""

    owner: nn.Module
    attr: str
    group: int
    slot: int


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


class FsdpUnit:
    """The FSDP state of one module: flat sharded buffers, parameter views and hooks."""

    def __init__(
        self, module: nn.Module, context: FsdpContext, mixed_precision: MixedPrecision | None
    ) -> None:
        self.module = module
        self.context = context
        self.name = type(module).__name__
        self.explicit_mp = mixed_precision
        self.mp = mixed_precision or MixedPrecision()
        self.index = len(context.units)
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
        self._shard(self._own_parameters())
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    # -- construction -------------------------------------------------------------------

    def _own_parameters(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """Parameters of the module tree, stopping at modules that are already units."""
        found = []

        def walk(mod: nn.Module) -> Iterator[nn.Module]:
            yield mod
            for child in mod.children():
                if self.context.unit_of(child) is None:
                    yield from walk(child)

        for mod in walk(self.module):
            for attr, param in mod._parameters.items():
                if param is not None:
                    found.append((mod, attr, param))
        return found

    def _shard(self, found: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
        ctx = self.context
        slot_of: dict[int, tuple[int, int]] = {}
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        names = {id(m): n for n, m in self.module.named_modules(remove_duplicate=False)}
        for mod, attr, param in found:
            pname = f"{names.get(id(mod), type(mod).__name__)}.{attr}".lstrip(".")
            owner = ctx.param_owner(param)
            if owner is not None:
                raise FsdpError(
                    f"parameter {pname!r} of unit {self.name} is already managed by unit "
                    f"{owner.name}: a parameter shared across units is not supported (tie "
                    "weights inside one unit, or call fully_shard bottom-up)"
                )
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
                [(n, tuple(p.shape)) for n, p in params], dtype, ctx.world_size
            )
            buf = FlatShardedBuffer(layout, ctx.rank, [p for _, p in params], ctx.device)
            self.groups.append(buf)
            sharded, grads = [], []
            for slot, (_, p) in zip(layout.slots, params, strict=True):
                main = _shard_view(buf, buf.main, slot, ctx.mesh)
                sharded.append(nn.Parameter(main, requires_grad=p.requires_grad))
                grads.append(
                    _shard_view(buf, buf.grad, slot, ctx.mesh) if p.requires_grad else None
                )
            self.sharded.append(sharded)
            self.sharded_grads.append(grads)
            self.requires_grad.append([p.requires_grad for _, p in params])
        for mod, attr, param in found:
            gi, si = slot_of[id(param)]
            self.refs.append(ParamRef(mod, attr, gi, si))
            mod._parameters[attr] = self.sharded[gi][si]
        for group in self.sharded:
            for p in group:
                ctx.claim(p, self)
        for _, _, param in found:
            ctx.claim(param, self)

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
                p = nn.Parameter(view, requires_grad=trainable)
                if trainable:
                    p.register_post_accumulate_grad_hook(self._on_grad_accumulated)
                    self.trainable_count += 1
                params.append(p)
            self.unsharded.append(params)

    # -- state ----------------------------------------------------------------------------

    def is_unsharded(self) -> bool:
        return any(g.is_unsharded() for g in self.groups)

    @property
    def unsharded_nbytes(self) -> int:
        return sum(g.unsharded_nbytes for g in self.groups)

    def release(self) -> None:
        for g in self.groups:
            g.release()

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

    # -- hooks ----------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.context.pre_forward(self)
        self.ran_forward = torch.is_grad_enabled()
        self.use_unsharded()
        return self.mp.cast_inputs(args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> object:
        self.use_sharded()
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward, mode="any"
                )
        self.context.post_forward(self)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.context.pre_backward(self)

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        self.grads_seen += 1
        if self.grads_seen == self.trainable_count:
            self.context.post_backward(self)

    # -- gradients --------------------------------------------------------------------------

    def take_grads(self, group: int) -> list[torch.Tensor | None]:
        """The unsharded gradients of one group (``None`` where frozen or unused), cleared."""
        grads = []
        for p in self.unsharded[group]:
            grads.append(p.grad)
            p.grad = None
        return grads

    def has_sharded_grads(self, group: int) -> bool:
        return any(p.grad is not None for p in self.sharded[group])

    def attach_sharded_grads(self, group: int) -> None:
        """Point each trainable sharded parameter's ``.grad`` at its slice of the grad shard
        (``DTensor`` views made once: building them every step cost about 30 us each)."""
        for p, grad in zip(self.sharded[group], self.sharded_grads[group], strict=True):
            if grad is not None and p.grad is None:
                p.grad = grad


def _shard_view(buf, flat: torch.Tensor, slot, mesh) -> DTensor:
    """This rank's ``Shard(0)`` rows of ``slot``'s parameter in the flat segment ``flat`` (the
    main weights or the gradients of ``buf``), as a DTensor viewing that memory."""
    return DTensor.from_local(
        buf.local_view(flat, slot),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size(slot.shape),
        stride=_contiguous_stride(slot.shape),
    )


def fully_shard(
    module: nn.Module,
    *,
    context: FsdpContext,
    mixed_precision: MixedPrecision | None = None,
) -> nn.Module:
    """Shard ``module``'s own parameters (those no nested unit owns) over ``context``'s group.

    Call it bottom-up (blocks first, then the model). Returns ``module`` itself, whose
    parameters are now sharded ``DTensor``s; its forward gathers them as needed.
    """
    if not isinstance(module, nn.Module):
        raise FsdpError(f"fully_shard needs an nn.Module, got {type(module).__name__}")
    if context.unit_of(module) is not None:
        raise FsdpError(f"unit {context.unit_of(module).name}: fully_shard called twice")
    if hasattr(module, "_get_fsdp_state") or type(module).__name__.startswith("FSDP"):
        raise FsdpError(
            f"module {type(module).__name__} is already sharded by torch FSDP; unsupported"
        )
    context.add_unit(module, FsdpUnit(module, context, mixed_precision))
    return module
