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

FSDP2 over tensor parallelism places a column-parallel weight ``[_StridedShard(0), Shard(0)]``:
a band of rows too (the strided shard records only that ``tp`` cut first). A DTensor of a
submesh (a parameter tensor parallelism left whole, on the ``dp`` mesh alone) is held, box
for box, by the ranks at the same place on the submesh's dimensions of the mesh it was cut
from: the replicas the other dimensions imply.

A tensor placed any other way (``Shard`` of two dimensions past the first, another
``_StridedShard``, ``Partial``), or whose mesh holds a rank that is not one of the
publisher's trainers, has no holders: it is gathered and sent as a tensor every trainer
holds whole.

Invariant: every trainer derives the same holders from the same tensors and rank map, and
the parts of a tensor cover each of its bytes exactly once.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from math import prod
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
    mesh = d.device_mesh
    if not box_placements(placements, len(spec.shape), tuple(mesh.mesh.shape)):
        return None
    members = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    replicas = _replicas(members, tuple(mesh.mesh.shape), _job_mesh(mesh))
    if replicas is None or any(r not in trainer_of for rs in replicas.values() for r in rs):
        return None
    itemsize = spec.torch_dtype.itemsize
    boxes = _boxes(spec.shape, itemsize, tuple(mesh.mesh.shape), members, placements)
    parts = []
    for box, ranks in sorted(boxes.items(), key=lambda item: item[0].start):
        owners = sorted({trainer_of[r] for rank in ranks for r in replicas[rank]})
        parts += _split(box, owners, itemsize)
    if sum(p.nbytes for p in parts) != spec.nbytes:
        return None
    return tuple(parts)


def _job_mesh(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh ``mesh`` was cut from (itself when it is no submesh): its shape and its
    global ranks in row-major order."""
    root = getattr(mesh, "_get_root_mesh", lambda: mesh)()
    return tuple(root.mesh.shape), tuple(int(r) for r in root.mesh.flatten().tolist())


@functools.lru_cache(maxsize=256)
def _replicas(
    members: tuple[int, ...],
    shape: tuple[int, ...],
    job: tuple[tuple[int, ...], tuple[int, ...]],
) -> dict[int, tuple[int, ...]] | None:
    """Each member of a mesh (``members``, of ``shape``) with the ranks of the mesh it was
    cut from (``job``: its shape and ranks) that hold what it holds: those at its place on
    the job mesh's dimensions the mesh spans, anywhere on the others (FSDP2 over tensor
    parallelism keeps a parameter that tensor parallelism left whole on the ``dp`` mesh
    alone, the same on every ``tp`` rank). ``None`` when the mesh is not such a slice of
    its job mesh."""
    job_shape, job_ranks = job
    coords = dict(zip(job_ranks, itertools.product(*(range(n) for n in job_shape)), strict=True))
    if any(r not in coords for r in members):
        return None
    spanned = [k for k in range(len(job_shape)) if len({coords[r][k] for r in members}) > 1]
    classes: dict[tuple[int, ...], list[int]] = {}
    for rank, coord in coords.items():
        classes.setdefault(tuple(coord[k] for k in spanned), []).append(rank)
    found = {r: tuple(classes[tuple(coords[r][k] for k in spanned)]) for r in members}
    each = len(found[members[0]])
    if len(set(found.values())) != len(members) or prod(shape) * each != len(job_ranks):
        return None
    return found


def box_placements(placements: Sequence[object], ndim: int, mesh_shape: Sequence[int]) -> bool:
    """Whether ``placements`` (on a mesh of ``mesh_shape``) keep each coordinate's share of
    an ``ndim``-d tensor a box of one set of runs (:meth:`.runs.Runs.of_box`): each
    replicates or shards (plainly, or strided as FSDP2 over tensor parallelism places it,
    :func:`_nested_strided`) a dimension of the tensor, and those sharded are dimension 0
    and at most one other."""
    from torch.distributed.tensor import Replicate, Shard

    dims = set()
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not (type(p) is Shard or _nested_strided(p, placements[m + 1 :], mesh_shape[m + 1 :])):
            return False
        dims.add(cast(Any, p).dim)
    return all(0 <= d < ndim for d in dims) and len(dims - {0}) <= 1


def _nested_strided(p: object, later: Sequence[object], sizes: Sequence[int]) -> bool:
    """Whether ``p`` is a ``_StridedShard`` that only records that the later mesh
    dimensions sharding its tensor dimension (``later``, of ``sizes``) cut it first: its
    split factor is their size, so each coordinate's share is one band of that dimension,
    the band the plain shards nested in that order would give."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if type(p) is not _StridedShard:
        return False
    dim = cast(Any, p).dim
    cut_first = [n for q, n in zip(later, sizes, strict=True) if type(q) is Shard and q.dim == dim]
    return bool(cut_first) and cast(Any, p).split_factor == prod(cut_first)


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
