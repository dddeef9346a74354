"""What a vLLM worker's loaders do with a checkpoint's layout: :func:`record_loads` (and
:func:`record_slices`, its reads alone).

With tensor parallelism a worker's weight loaders read only a slice of most checkpoint
tensors (column-parallel q/k/v and gate/up take rows, row-parallel o_proj and down_proj
take columns, vocab-parallel embeddings take rows, norms are read whole). The worker's own
loaders say which: :func:`record_slices` runs ``model.load_weights`` once on recording
placeholders, one per checkpoint tensor, and returns for each tensor read only in part the
one :class:`Narrow` covering every element its loaders read; :func:`record_loads` also
names the parameters no tensor of the layout writes (a layer missing from it), and the
loaders' own error (a name they do not know, a shape they refuse) comes out of the
recording, so a layout is known to load whole before a byte of it reaches the model.

How nothing of the model is touched: for the recording, every module's parameters and
buffers are swapped for meta tensors of the layout its loaders expect (the metadata vLLM
records when it builds a model, so a worker whose weights were repacked after loading
still presents its loaders the checkpoint's shapes), carrying the same attributes (the
``weight_loader`` and the partition attributes the loaders read); afterwards the module
gets its own tensors back, the very objects, whose bytes were never written. Meta tensors
cost no memory, where a deep copy would double the worker's, and a restore from a copy
would have to write every weight back.

How a read is seen: a placeholder is a meta view of its checkpoint tensor, and every view
op a loader applies (``narrow``, slicing, ``chunk``, ``t``, ``view``...) returns another
placeholder, whose storage offset and strides (torch's own, on meta) locate its elements
in the checkpoint tensor. Any other op on a placeholder (the ``copy_`` into a parameter, a
``to``, arithmetic) reads it: the box of checkpoint elements that view covers is recorded,
and the op runs on meta (ops that take only a tensor's geometry, ``empty_like`` and the
like, read nothing). A view whose elements are no box of the tensor (a flattening across a
narrowed dim, a view as another dtype) is recorded by the rows its bytes span.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import SyncError
from ...sync import Layout, Narrow

__all__ = ["Loads", "Narrow", "SliceRecordingError", "record_loads", "record_slices"]


class SliceRecordingError(SyncError):
    """A weight loader needed a checkpoint tensor's values (``.item()``, a comparison) while
    its slices were recorded; the message names the tensor and the op."""


@dataclass
class _Reads:
    """What the loaders read of one checkpoint tensor: nothing yet, or the bounding box
    (inclusive ``lo``/``hi`` per dim) of every box read."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    lo: list[int] | None = None
    hi: list[int] | None = None

    def add(self, view: torch.Tensor) -> None:
        if view.numel() == 0:
            return
        lo, hi = _box(view, self.shape, self.dtype)
        if self.lo is None or self.hi is None:
            self.lo, self.hi = lo, hi
            return
        self.lo = [min(a, b) for a, b in zip(self.lo, lo, strict=True)]
        self.hi = [max(a, b) for a, b in zip(self.hi, hi, strict=True)]

    def narrow(self) -> Narrow | None:
        """The smallest single-dim narrow covering the box read (``None``: the whole)."""
        if not self.shape:
            return None
        if self.lo is None or self.hi is None:
            return Narrow(0, 0, 0)
        numel = math.prod(self.shape)
        best: tuple[int, Narrow] | None = None
        for dim, (lo, hi, size) in enumerate(zip(self.lo, self.hi, self.shape, strict=True)):
            if lo == 0 and hi == size - 1:
                continue
            cost = (hi - lo + 1) * (numel // size)
            if best is None or cost < best[0]:
                best = (cost, Narrow(dim, lo, hi - lo + 1))
        return None if best is None else best[1]


def _box(
    view: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[list[int], list[int]]:
    """An inclusive box of a contiguous tensor of ``shape`` and ``dtype`` holding every
    element ``view`` (a non-empty view of it) covers: exactly the elements' box where each
    dim of ``view`` steps along one dim of the tensor, else the rows (dim 0) its first to
    last byte span."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    if view.dtype.itemsize == dtype.itemsize:
        exact = _stepped_box(view, shape, strides)
        if exact is not None:
            return exact
    first = view.storage_offset() * view.dtype.itemsize
    span = sum(stride * (size - 1) for size, stride in zip(view.shape, view.stride(), strict=True))
    last = first + (span + 1) * view.dtype.itemsize - 1
    numel = math.prod(shape)
    a, b = first // dtype.itemsize, min(last // dtype.itemsize, numel - 1)
    return [a // strides[0]] + [0] * (len(shape) - 1), [b // strides[0]] + [
        size - 1 for size in shape[1:]
    ]


def _stepped_box(
    view: torch.Tensor, shape: tuple[int, ...], strides: list[int]
) -> tuple[list[int], list[int]] | None:
    """The box ``view`` covers where each of its dims steps along a single dim ``d`` of the
    tensor (its stride a multiple of ``d``'s) and the steps stay inside every dim: then an
    element's position decomposes uniquely into coordinates, and the box is exactly what it
    covers along each dim. ``None`` otherwise."""
    offset = view.storage_offset()
    lo = [offset // stride % size for size, stride in zip(shape, strides, strict=True)]
    if sum(c * s for c, s in zip(lo, strides, strict=True)) != offset:
        return None
    hi = list(lo)
    for size, stride in zip(view.shape, view.stride(), strict=True):
        if size == 1 or stride == 0:
            continue
        dim = next((d for d, s in enumerate(strides) if stride % s == 0), None)
        if dim is None:
            return None
        hi[dim] += stride // strides[dim] * (size - 1)
    if any(h >= size for h, size in zip(hi, shape, strict=True)):
        return None
    return lo, hi


# Ops that take a tensor's geometry and not its values: no read.
_GEOMETRY_ONLY = {
    getattr(torch.ops.aten, op)
    for op in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    )
}


@dataclass
class Loads:
    """What a worker's loaders do with a layout: ``narrows``, the part of each checkpoint
    tensor they read where it is not the whole (see :func:`record_slices`); ``unwritten``,
    the model's parameters that no tensor of the layout writes an element of."""

    narrows: dict[str, Narrow]
    unwritten: list[str]


@dataclass
class _Recording:
    """One recording's reads (checkpoint tensor name -> what was read of it) and writes
    (a stand-in's storage -> elements written into it)."""

    reads: dict[str, _Reads]
    writes: dict[int, int] = field(default_factory=dict)


class _Placeholder(torch.Tensor):
    """A checkpoint tensor as the loaders see it during a recording: a meta view
    (``_view``) of the tensor ``_name``; its view ops return placeholders, its other ops
    record a read in ``_rec`` (and the elements an op writes into a stand-in) and run on
    meta. Their results are placeholders too, ``_derived`` from the tensors ``_name``
    names (reading one reads nothing more of them), so that copying one into a tensor of
    the loader's own runs on meta as well."""

    _name: str
    _view: torch.Tensor
    _rec: _Recording
    _derived: bool

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls, name: str, view: torch.Tensor, rec: _Recording, derived: bool = False
    ) -> _Placeholder:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            view.shape,
            strides=view.stride(),
            storage_offset=view.storage_offset(),
            dtype=view.dtype,
            device=torch.device("meta"),
            requires_grad=False,
        )
        t._name, t._view, t._rec, t._derived = name, view, rec, derived
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"_Placeholder({self._name!r}, shape={tuple(self.shape)})"

    def _child(self, view: torch.Tensor) -> _Placeholder:
        return _Placeholder(self._name, view, self._rec, self._derived)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's default is a plain function
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func.is_view and isinstance(first, _Placeholder):
            out = func(*_on_meta(args), **_on_meta(kwargs))
            return pytree.tree_map_only(torch.Tensor, first._child, out)
        held = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, _Placeholder)]
        if func.overloadpacket not in _GEOMETRY_ONLY:
            for p in held:
                if not p._derived:
                    p._rec.reads[p._name].add(p._view)
        names = ", ".join(sorted({p._name for p in held}))
        try:
            out = func(*_on_meta(args), **_on_meta(kwargs))
        except (NotImplementedError, RuntimeError) as e:
            raise SliceRecordingError(
                f"slipstream: recording the slices of {names}, a weight loader called {func}, "
                f"which needs the tensor's values: {e}"
            ) from e
        rec = held[0]._rec
        written = _written_argument(func, args, kwargs)
        if written is not None:
            if isinstance(written, torch.Tensor) and not isinstance(written, _Placeholder):
                key = _storage(written)
                rec.writes[key] = rec.writes.get(key, 0) + written.numel()
            return written
        return pytree.tree_map_only(
            torch.Tensor, lambda t: _Placeholder(names, t, rec, derived=True), out
        )


def _storage(t: torch.Tensor) -> int:
    """Which storage ``t`` views (a meta tensor's too: each has one of its own)."""
    key: int = t.untyped_storage()._cdata
    return key


def _on_meta(tree: Any) -> Any:
    """``tree`` with every placeholder replaced by its meta view and every other tensor by
    a meta tensor of its geometry (so no op of a recording writes real memory)."""

    def meta(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, _Placeholder):
            return t._view
        if t.is_meta:
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    return pytree.tree_map_only(torch.Tensor, meta, tree)


def _written_argument(func: Any, args: Any, kwargs: Any) -> Any:
    """The argument an in-place or ``out=`` op returns (as the caller passed it), or
    ``None`` for an op returning a new tensor."""
    schema = func._schema
    if not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias = schema.returns[0].alias_info.before_set
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == alias:
            if arg.kwarg_only or i >= len(args):
                return kwargs.get(arg.name)
            return args[i]
    return None


def _meta_of(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s geometry, class and attributes (vLLM's own conversion),
    whose ``weight_loader`` is the layer's own: where a layerwise reload wrapped it (to
    buffer what it loads and process the layer once whole), the wrapped one."""
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

    stand_in = to_meta_tensor(t)
    loader = getattr(stand_in, "weight_loader", None)
    if loader is not None:
        while getattr(loader, "__name__", "") == _RELOAD_WRAPPER:
            loader = loader.__wrapped__
        setattr(stand_in, "weight_loader", loader)  # noqa: B010 (not every tensor has one)
    return stand_in


_RELOAD_WRAPPER = "online_process_loader"  # vLLM's layerwise reload's loader wrapper


def _loader_layout(
    module: nn.Module, memo: dict[int, torch.Tensor]
) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None]]:
    """Meta stand-ins for ``module``'s parameters and buffers, in the layout its loaders
    expect: the metadata vLLM recorded when it built the model where there is some (a
    weight repacked after loading gets its checkpoint shape back), else the tensors as
    they are. A tensor shared by two modules gets one stand-in."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    def shell(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in memo:
            memo[id(t)] = _meta_of(t)
        return memo[id(t)]

    params = {name: shell(t) for name, t in module._parameters.items()}
    buffers = {name: shell(t) for name, t in module._buffers.items()}
    info = LAYERWISE_INFO.get(module)
    if info is not None:
        recorded_params, recorded_buffers = info.restore_metadata
        for name, t in recorded_params.items():
            params[name] = restore_layer_refs(_meta_of(t), module)
        for name, t in recorded_buffers.items():
            buffers[name] = restore_layer_refs(_meta_of(t), module)
    return params, buffers


@contextmanager
def _meta_stand_ins(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Within: every module of ``model`` holds meta stand-ins (:func:`_loader_layout`),
    yielded by parameter (its first name: every stand-in of it, one per module holding a
    tied one); after, its own parameter and buffer dicts again, the same objects."""
    held: list[tuple[nn.Module, Any, Any]] = []
    memo: dict[int, torch.Tensor] = {}
    names: dict[int, str] = {}
    stand_ins: dict[str, list[torch.Tensor]] = {}
    try:
        for prefix, module in model.named_modules():
            params, buffers = _loader_layout(module, memo)
            held.append((module, module._parameters, module._buffers))
            for name, real in module._parameters.items():
                shell = params.get(name)
                if real is None or shell is None:
                    continue
                first = names.setdefault(id(real), f"{prefix}.{name}" if prefix else name)
                stand_ins.setdefault(first, []).append(shell)
            module._parameters = cast(Any, params)
            module._buffers = cast(Any, buffers)
        yield stand_ins
    finally:
        for module, params, buffers in held:
            module._parameters = params
            module._buffers = buffers


def record_loads(model: nn.Module, specs: Layout) -> Loads:
    """What ``model``'s loaders do with a checkpoint of ``specs`` (name -> shape, dtype):
    the narrows of :func:`record_slices` and the parameters they write no element of.

    Runs ``model.load_weights`` once, on placeholders (as :func:`record_slices` does);
    the loaders' own error for a layout they refuse is raised as it is."""
    rec = _Recording({name: _Reads(tuple(shape), dtype) for name, (shape, dtype) in specs.items()})
    batch = [
        (name, _Placeholder(name, torch.empty(shape, dtype=dtype, device="meta"), rec))
        for name, (shape, dtype) in specs.items()
    ]
    with torch.no_grad(), _meta_stand_ins(model) as stand_ins:
        cast(Any, model).load_weights(batch)  # vLLM's models, not nn.Module's
    narrows = {name: r.narrow() for name, r in rec.reads.items()}
    unwritten = [
        name
        for name, shells in stand_ins.items()
        if shells[0].numel() and not any(rec.writes.get(_storage(t)) for t in shells)
    ]
    return Loads({name: n for name, n in narrows.items() if n is not None}, unwritten)


def record_slices(model: nn.Module, specs: Layout) -> dict[str, Narrow]:
    """For each checkpoint tensor of ``specs`` (name -> shape, dtype) that ``model``'s
    loaders read only in part, the one :class:`Narrow` covering every element they read
    (the bounding box of all their reads, narrowed on the dim that keeps it smallest;
    ``start + length`` never passes the tensor's size on ``dim``); a tensor read whole is
    left out (the worker needs all of it). A tensor read not at all gets length 0 (a rotary
    ``inv_freq`` its loaders drop).

    Runs ``model.load_weights`` once, on placeholders; ``model``'s parameters and buffers
    are the same objects, bytes unchanged, afterwards (meanwhile the model holds meta
    stand-ins: call it where nothing runs the model, as a worker's RPCs do). Raises
    :class:`SliceRecordingError` where a loader needs a tensor's values."""
    return record_loads(model, specs).narrows
