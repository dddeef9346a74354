"""Which trainer holds, and so sends, which bytes of each published tensor: :func:`holders_of`.

A DTensor placed ``Shard(0)`` and ``Replicate()`` over its mesh's dimensions (FSDP2's
``fully_shard``, HSDP, a replicated norm) holds on each mesh coordinate a run of whole rows:
a contiguous byte range of the tensor (its *box*). Every trainer works every coordinate's box
out from the placements alone, with no collective; the trainers holding one box (its
replicas) split it into parts, one each, so the box is sent once. A tensor placed any other
way (``Shard`` of another dimension, strided or partial placements), or whose mesh holds a
rank that is not one of the publisher's trainers, has no holders: it is gathered and sent as
a tensor every trainer holds whole.

Invariant: every trainer derives the same holders from the same tensors and rank map, and
the parts of a tensor cover each of its bytes exactly once.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .plan import Holders, Part, TensorSpec, is_dtensor

#: A box: bytes ``[start, stop)`` of a tensor.
Box = tuple[int, int]


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


def local_offset(t: torch.Tensor, spec: TensorSpec) -> tuple[int, ...]:
    """Where this rank's local shard of the DTensor ``t`` starts in the tensor, per
    dimension (elements)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    d: Any = t
    if not spec.shape:
        return ()
    _, offset = compute_local_shape_and_global_offset(spec.shape, d.device_mesh, d.placements)
    return tuple(int(o) for o in offset)


def local_start(t: torch.Tensor, spec: TensorSpec) -> int:
    """Where this rank's local shard of the DTensor ``t`` (one placed by rows, as those
    :func:`holders_of` gives parts) starts in the tensor's bytes."""
    offset = local_offset(t, spec)
    return offset[0] * _row_bytes(spec) if offset else 0


def _row_bytes(spec: TensorSpec) -> int:
    rows = spec.shape[0] if spec.shape else 1
    return spec.nbytes // rows if rows else 0


def _parts(
    spec: TensorSpec, t: torch.Tensor, trainer_of: Mapping[int, int]
) -> tuple[Part, ...] | None:
    d: Any = t
    placements = tuple(d.placements)
    if not all(row_placement(p) for p in placements):
        return None
    mesh = d.device_mesh.mesh
    members = tuple(int(r) for r in mesh.flatten().tolist())
    if any(r not in trainer_of for r in members):
        return None
    boxes = _boxes(spec.shape, spec.nbytes, tuple(mesh.shape), members, placements)
    itemsize = spec.torch_dtype.itemsize
    parts = []
    for (start, stop), ranks in sorted(boxes.items()):
        parts += _split(start, stop, sorted(trainer_of[r] for r in ranks), itemsize)
    if sum(p.stop - p.start for p in parts) != spec.nbytes:
        return None
    return tuple(parts)


def row_placement(p: object) -> bool:
    """Whether ``p`` keeps each coordinate's box a run of whole rows."""
    return shard_placement(p, 0)


def shard_placement(p: object, dim: int) -> bool:
    """Whether ``p`` replicates, or shards (plainly: not strided) dimension ``dim``."""
    from torch.distributed.tensor import Replicate, Shard

    return isinstance(p, Replicate) or (type(p) is Shard and p.dim == dim)


@functools.lru_cache(maxsize=4096)
def _boxes(
    shape: tuple[int, ...],
    nbytes: int,
    mesh_shape: tuple[int, ...],
    members: tuple[int, ...],
    placements: tuple[Any, ...],
) -> dict[Box, list[int]]:
    """Each non-empty box of a tensor of ``shape`` under ``placements`` on a mesh of
    ``mesh_shape`` (``members``: its global ranks in row-major order), with the global ranks
    that hold it."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    row = nbytes // shape[0] if shape and shape[0] else 0
    boxes: dict[Box, list[int]] = {}
    coords = itertools.product(*(range(n) for n in mesh_shape))
    for rank, coord in zip(members, coords, strict=True):
        if not shape:
            box = (0, nbytes)
        else:
            local, offset = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coord), placements
            )
            box = (offset[0] * row, (offset[0] + local[0]) * row)
        if box[1] > box[0] or nbytes == 0:
            boxes.setdefault(box, []).append(rank)
    return boxes


def _split(start: int, stop: int, owners: list[int], itemsize: int) -> list[Part]:
    """``[start, stop)`` cut into one part per owner (whole elements, the last ones
    possibly empty and then left out)."""
    elements = (stop - start) // itemsize
    each = -(-elements // len(owners)) * itemsize
    parts = []
    for k, owner in enumerate(owners):
        lo = min(stop, start + k * each)
        hi = min(stop, lo + each)
        if hi > lo or (stop == start and k == 0):
            parts.append(Part(owner, lo, hi))
    return parts
