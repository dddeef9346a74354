"""Which trainer holds, and so sends, which bytes of each published tensor: :func:`holders_of`.

A DTensor placed ``Shard(0)``, ``Shard(k)`` of one other dimension ``k`` and
``Replicate()`` over its mesh's dimensions (FSDP2's ``fully_shard``, HSDP, a replicated norm,
a tensor-parallel trainer's ``ColwiseParallel`` / ``RowwiseParallel`` weights, expert or
head dimensions cut further in, and their mix on a ``dp x tp`` mesh) holds on each mesh
coordinate a *box*: a band of rows by a band of dimension ``k``, every other dimension
whole. Its bytes are :class:`.runs.Runs` (:meth:`.runs.Runs.of_box`): one contiguous range
when it cuts only rows, else a run per step of the dimensions before ``k``, equally far
apart (a strided box). Every trainer works every coordinate's box out from the placements
alone, with no collective; the trainers holding one box (its replicas) split it into parts,
one each (by elements of a contiguous box, by runs of a strided one), so the box is sent
once. A part is
a :class:`.plan.Part` (strided like its box), which the plan cuts into slices, each one range
of the tensor's bytes, so a rollout places them as any other.

A tensor placed any other way (``Shard`` of two dimensions past the first, ``_StridedShard``
as FSDP2 over a column-parallel weight places it, ``Partial``), or whose mesh holds a rank that is
not one of the publisher's trainers, has no holders: it is gathered and sent as a tensor
every trainer holds whole.

Invariant: every trainer derives the same holders from the same tensors and rank map, and
the parts of a tensor cover each of its bytes exactly once.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from .plan import Holders, Part, TensorSpec, is_dtensor
from .runs import Runs


def holders_of(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], trainer_of: Mapping[int, int]
) -> Holders | None:
    """Per tensor, the parts each trainer sends (``None`` for a tensor with none, see the
    module doc); ``None`` when no tensor has any. ``trainer_of``: a mesh member's global
    rank -> its trainer rank in the sync group."""
    found = tuple(
        _parts(spec, t, trainer_of) if is_dtensor(t) else None
        for spec, t in zip(specs, tensors, strict=True)
    )
    return found if any(parts is not None for parts in found) else None


def _local_box(t: torch.Tensor, spec: TensorSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's local shard of the DTensor ``t`` starts in the tensor, per
    dimension, and its shape (elements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    d: Any = t
    if not spec.shape:
        return (), ()
    size, offset = compute_local_shape_and_global_offset(spec.shape, d.device_mesh, d.placements)
    return tuple(int(o) for o in offset), tuple(int(n) for n in size)


def local_runs(t: torch.Tensor, spec: TensorSpec) -> Runs:
    """The bytes of the tensor this rank's local shard of the DTensor ``t`` holds, in the
    order they lie in the shard (box placements, :func:`box_placements`)."""
    offset, size = _local_box(t, spec)
    runs = Runs.of_box(spec.shape, spec.torch_dtype.itemsize, offset, size)
    if runs is None:
        raise ValueError(f"{spec.name!r} is not placed in boxes: {cast(Any, t).placements}")
    return runs


def _parts(
    spec: TensorSpec, t: torch.Tensor, trainer_of: Mapping[int, int]
) -> tuple[Part, ...] | None:
    d: Any = t
    placements = tuple(d.placements)
    if not box_placements(placements, len(spec.shape)):
        return None
    mesh = d.device_mesh.mesh
    members = tuple(int(r) for r in mesh.flatten().tolist())
    if any(r not in trainer_of for r in members):
        return None
    itemsize = spec.torch_dtype.itemsize
    boxes = _boxes(spec.shape, itemsize, tuple(mesh.shape), members, placements)
    parts = []
    for box, ranks in sorted(boxes.items(), key=lambda item: item[0].start):
        parts += _split(box, sorted(trainer_of[r] for r in ranks), itemsize)
    if sum(p.nbytes for p in parts) != spec.nbytes:
        return None
    return tuple(parts)


def box_placements(placements: Sequence[object], ndim: int) -> bool:
    """Whether ``placements`` keep each coordinate's share of an ``ndim``-d tensor a box
    of one set of runs (:meth:`.runs.Runs.of_box`): each replicates or shards (plainly:
    not strided) a dimension of the tensor, and those sharded are dimension 0 and at most
    one other."""
    from torch.distributed.tensor import Replicate, Shard

    if not all(isinstance(p, Replicate) or type(p) is Shard for p in placements):
        return False
    dims = {cast(Any, p).dim for p in placements if type(p) is Shard}
    return all(0 <= d < ndim for d in dims) and len(dims - {0}) <= 1


@functools.lru_cache(maxsize=4096)
def _boxes(
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
    members: tuple[int, ...],
    placements: tuple[Any, ...],
) -> dict[Runs, list[int]]:
    """Each non-empty box of a tensor of ``shape`` under ``placements`` (box placements) on
    a mesh of ``mesh_shape`` (``members``: its global ranks in row-major order), as the
    runs of its bytes, with the global ranks that hold it."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    boxes: dict[Runs, list[int]] = {}
    coords = itertools.product(*(range(n) for n in mesh_shape))
    for rank, coord in zip(members, coords, strict=True):
        if shape:
            size, offset = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coord), placements
            )
        else:
            size, offset = (), ()
        box = Runs.of_box(shape, itemsize, tuple(offset), tuple(size))
        assert box is not None  # box placements cut boxes
        if box.nbytes or not box.total:
            boxes.setdefault(box, []).append(rank)
    return boxes


def _split(box: Runs, owners: list[int], itemsize: int) -> list[Part]:
    """``box`` cut into one part per owner: by whole elements when it is one run, else by
    whole rows (the last parts possibly empty and then left out)."""
    if box.count == 1:
        start, stop = box.start, box.start + box.length
        elements = (stop - start) // itemsize
        each = -(-elements // len(owners)) * itemsize
        parts = []
        for k, owner in enumerate(owners):
            lo = min(stop, start + k * each)
            hi = min(stop, lo + each)
            if hi > lo or (stop == start and k == 0):
                parts.append(Part(owner, lo, hi))
        return parts
    rows = -(-box.count // len(owners))
    parts = []
    for k, owner in enumerate(owners):
        first, last = k * rows, min(box.count, (k + 1) * rows)
        if last > first:
            at = box.start + first * box.stride
            parts.append(Part(owner, at, at + box.length, box.stride, last - first))
    return parts
