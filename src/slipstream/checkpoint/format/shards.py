"""Where this rank's shard of a DTensor sits in the global tensor.

``DTensor.__create_chunk_list__`` answers that through DTensor's symbolic-shape helpers,
which are slow enough to dominate a resharding load of many tensors. For the placements
nearly every model uses (``Shard`` and ``Replicate``, each tensor dimension sharded by at
most one mesh dimension), :func:`local_chunks` applies the same rule directly: along a
sharded dimension of size ``n`` over ``k`` ranks, rank ``c`` holds ``torch.chunk``'s piece
``c``, which starts at ``min(c * ceil(n / k), n)`` and ends at
``min((c + 1) * ceil(n / k), n)``. Any other placement falls back to DTensor's own answer.

Invariant: the returned sizes equal the shape of the rank's local tensor, else DTensor's
own answer is returned.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard


def shard_span(size: int, chunks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of piece ``index`` when ``size`` is split as ``torch.chunk``
    splits it into ``chunks`` (trailing pieces may be short or empty)."""
    full = -(-size // chunks)
    start = min(index * full, size)
    end = min(start + full, size)
    return start, end - start


def local_chunks(
    value: DTensor, local_shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of this rank's shard of ``value`` (whose local tensor has
    ``local_shape``) in the global tensor: one entry, or DTensor's own list for placements
    this module does not compute."""
    simple = _simple_chunk(value, local_shape)
    if simple is not None:
        return [simple]
    chunks = value.__create_chunk_list__()  # type: ignore[no-untyped-call]  # unannotated in torch
    return [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]


def _simple_chunk(
    value: DTensor, local_shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    sizes = list(value.shape)
    offsets = [0] * len(sizes)
    sharded: set[int] = set()
    for mesh_dim, placement in enumerate(value.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        dim = placement.dim % len(sizes)
        if dim in sharded:
            return None
        sharded.add(dim)
        offsets[dim], sizes[dim] = shard_span(sizes[dim], mesh.size(mesh_dim), coordinate[mesh_dim])
    if tuple(local_shape) != tuple(sizes):
        return None
    return tuple(offsets), tuple(sizes)
