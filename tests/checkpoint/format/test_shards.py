"""This rank's shard of a DTensor, computed directly, equals DTensor's own answer."""

from __future__ import annotations

import torch
from dist_utils import run_workers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from slipstream.checkpoint.format.shards import local_chunks, shard_span


def test_shard_span_is_torch_chunks_rule_for_even_uneven_and_empty_pieces():
    for size in range(0, 23):
        for chunks in range(1, 7):
            pieces = torch.arange(size).chunk(chunks)
            for index in range(chunks):
                length, offset = Shard.local_shard_size_and_offset(size, chunks, index)
                assert shard_span(size, chunks, index) == (offset, length), (size, chunks, index)
                if index < len(pieces) and len(pieces[index]):  # torch.chunk drops empty tails
                    assert offset == int(pieces[index][0]) and length == len(pieces[index])


PLACEMENTS = [
    [Shard(0), Shard(1)],
    [Shard(1), Shard(0)],
    [Shard(1), Replicate()],
    [Replicate(), Shard(0)],
    [Replicate(), Replicate()],
    [Shard(0), Shard(0)],  # one dim sharded twice: DTensor's own answer
]
SHAPES = [(5, 3), (1, 7), (4, 4), (9, 2)]


def _count_chunk_list_calls(dt) -> list[bool]:
    """Record every call to ``dt``'s own chunk list (an instance attribute, so only this
    DTensor is affected); the returned list grows by one per call."""
    asked: list[bool] = []
    dtensors_own = dt.__create_chunk_list__

    def counted():
        asked.append(True)
        return dtensors_own()

    dt.__create_chunk_list__ = counted
    return asked


def _compare_on_a_2x2_mesh(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    for shape in SHAPES:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        for placements in PLACEMENTS:
            dt = distribute_tensor(full, mesh, placements)
            theirs = [(tuple(c.offsets), tuple(c.sizes)) for c in dt.__create_chunk_list__()]
            local_shape = tuple(dt.to_local().shape)
            asked = _count_chunk_list_calls(dt)
            assert local_chunks(dt, local_shape) == theirs, (rank, shape, placements)
            computed = not asked  # the fast path never asks DTensor
            assert computed == (placements != [Shard(0), Shard(0)]), (shape, placements)


def test_local_chunks_match_dtensor_on_a_2x2_mesh_for_every_placement_mix():
    run_workers(_compare_on_a_2x2_mesh, 4, timeout=60)
