"""Which tensors a publish sends: each storage once, under every name that shows it.

A ``state_dict()`` lists tied weights (e.g. an embedding shared with the output layer)
under each of their names, while the bytes exist once. The publisher sends each distinct
tensor once, under the first name it appears with, and its plan lists the other names so
the rollouts apply it under each (:mod:`..rollout.apply`).

Invariant: two names share one sent tensor exactly when their tensors are the same bytes
seen the same way (:func:`alias_key`); names are unique and every value is a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ...core.dtypes import dtype_name
from .plan import TensorSpec, is_dtensor


def named_items(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    seen: set[str] = set()
    for name, t in items:
        if name in seen:
            raise ValueError(f"tensor name {name!r} is published twice")
        seen.add(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
    return items


def spec_of(name: str, t: torch.Tensor, aliases: Sequence[str] = ()) -> TensorSpec:
    return TensorSpec(name, tuple(t.shape), dtype_name(t.dtype), tuple(aliases))


def alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors exactly when they are the same bytes seen the same way: the same
    storage, offset, shape, stride and dtype (a DTensor: the same local shard, global shape,
    stride and placements). A tensor without bytes of its own is only its own alias."""
    extra: tuple[Any, ...] = ()
    local = t
    if is_dtensor(t):
        dt: Any = t
        local = dt._local_tensor
        extra = (tuple(t.stride()), tuple(map(str, dt.placements)), id(dt.device_mesh))
    if local.numel() == 0 or local.device.type == "meta" or local.data_ptr() == 0:
        return ("object", id(t))
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        t.dtype,
        tuple(t.shape),
        extra,
    )


def unique_tensors(
    items: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """The specs and tensors to send: each tensor once, under the first name it appears with,
    its spec listing its other names (aliases, e.g. tied embeddings) in order of appearance."""
    index: dict[tuple[Any, ...], int] = {}
    names: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    for name, t in items:
        key = alias_key(t)
        i = index.get(key)
        if i is None:
            index[key] = len(tensors)
            tensors.append(t)
            names.append([name])
        else:
            names[i].append(name)
    specs = [spec_of(ns[0], t, ns[1:]) for ns, t in zip(names, tensors, strict=True)]
    return specs, tensors
