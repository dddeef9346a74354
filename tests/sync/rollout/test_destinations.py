"""A destination keeps exactly its box of a sent tensor, whatever slices the tensor is cut
into: a run of bytes (a plain tensor, a shard of rows) or a band of columns of every row;
and what a trainer gathers of each slice for that rank is those bytes, in its order.
The reference is the tensor's bytes cut with ``torch`` indexing; the slices are random cuts,
so they start and end inside rows and bands."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from slipstream.sync.layout.holders import box_placements
from slipstream.sync.layout.plan import Slice
from slipstream.sync.layout.runs import Runs, gather
from slipstream.sync.rollout.destinations import Dest


def _box(rng: random.Random, rows: int, row_bytes: int) -> tuple[Dest, torch.Tensor]:
    """A random destination over a ``rows`` x ``row_bytes`` tensor, and the bytes it must
    end up holding (of :func:`_tensor`)."""
    full = _tensor(rows, row_bytes)
    if rng.random() < 0.5:
        lo = rng.randint(0, row_bytes)
        hi = rng.randint(lo, row_bytes)
        want = full.view(rows, row_bytes)[:, lo:hi].flatten()
        count = rows if hi > lo else 0
        data = torch.zeros(want.numel(), dtype=torch.uint8)
        return Dest(data, Runs(lo, hi - lo, row_bytes, count, full.numel())), want
    lo = rng.randint(0, full.numel())
    hi = rng.randint(lo, full.numel())
    data = torch.zeros(hi - lo, dtype=torch.uint8)
    return Dest(data, Runs.one(lo, hi - lo, full.numel())), full[lo:hi]


def _tensor(rows: int, row_bytes: int) -> torch.Tensor:
    return (torch.arange(rows * row_bytes) * 7 % 251).to(torch.uint8)


def _slices(rng: random.Random, total: int) -> list[Slice]:
    cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 6))))
    bounds = [0, *cuts, total]
    return [Slice(0, lo, hi - lo, 0, 0) for lo, hi in itertools.pairwise(bounds)]


@pytest.mark.parametrize("seed", range(4))
def test_a_destination_holds_exactly_its_box_of_every_cut(seed):
    rng = random.Random(seed)
    for _ in range(500):
        rows, row_bytes = rng.randint(1, 6), rng.randint(1, 9)
        full = _tensor(rows, row_bytes)
        dest, want = _box(rng, rows, row_bytes)
        kept = 0
        for s in _slices(rng, full.numel()):
            lo, hi = dest.local_range(s)
            assert hi - lo == dest.kept(s)
            kept += dest.kept(s)
            dest.copy(s, full[s.tensor_offset : s.tensor_offset + s.nbytes])
            sent = gather(dest.runs, s, full[s.tensor_offset : s.tensor_offset + s.nbytes])
            assert torch.equal(sent, want[lo:hi])  # what a trainer sends this rank of s
            view = dest.view(s)
            if view is not None:  # a slice it keeps whole, in one run: received in place
                assert torch.equal(view, full[s.tensor_offset : s.tensor_offset + s.nbytes])
        assert kept == want.numel()
        assert torch.equal(dest.data, want)


def test_a_destination_is_whole_only_when_it_holds_every_byte_in_order():
    assert Runs.one(0, 12, 12).whole
    assert not Runs.one(0, 6, 12).whole  # the first shard of rows
    assert Runs(0, 4, 4, 3, 12).whole  # every column of 3 rows
    assert not Runs(0, 2, 4, 3, 12).whole  # a band of columns


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((6, 10), (2,), ("S1",)),
        ((7, 5), (2,), ("S1",)),
        ((6, 10), (2, 2), ("S0", "S1")),
        ((5, 6, 3), (2, 2), ("R", "S1")),
        ((7, 6, 8), (2, 2), ("S1", "S0")),
        ((10, 16), (2, 2), ("S1", "S1")),
        ((9,), (2, 2), ("S0", "R")),
        ((4, 6, 10), (2,), ("S2",)),
        ((5, 6, 9), (2, 2), ("S0", "S2")),
        ((7, 6, 9), (2, 2), ("S2", "R")),
        ((3, 5, 4, 6), (2, 2), ("S2", "S2")),
        ((2, 3, 8), (2, 2), ("S2", "S0")),
    ],
)
def test_a_shards_runs_are_its_box_of_the_tensor_in_the_shards_own_order(
    shape, mesh_shape, placements
):
    """The geometry a trainer reads its own shard by and a rollout's DTensor target keeps
    (:meth:`Runs.of_box`), on meshes of one and two dimensions: the bytes its runs pick out
    of the tensor, one after another, are the bytes of the shard ``torch`` indexing cuts
    from the tensor at DTensor's offset and size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    place = {"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "R": Replicate()}
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    data = full.flatten().view(torch.uint8)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        size, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), [place[p] for p in placements]
        )
        runs = Runs.of_box(shape, 4, tuple(offset), tuple(size))
        assert runs is not None
        box = full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
        picked = [
            data[runs.start + k * runs.stride : runs.start + k * runs.stride + runs.length]
            for k in range(runs.count)
        ]
        got = torch.cat(picked) if picked else torch.empty(0, dtype=torch.uint8)
        assert torch.equal(got, box.contiguous().flatten().view(torch.uint8)), coord
    assert box_placements([place[p] for p in placements], len(shape), mesh_shape)


def test_a_box_cut_on_two_dimensions_past_the_first_is_not_one_set_of_runs():
    """Bands of dimensions 1 and 2 under a spanned dimension 0 are runs at two distances:
    no single set of runs holds them, and such placements are not taken for boxes (their
    tensors are gathered)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    assert Runs.of_box((2, 4, 8), 4, (0, 0, 0), (2, 2, 4)) is None
    assert Runs.of_box((2, 4, 8), 4, (0, 0, 0), (2, 4, 4)) == Runs(0, 16, 32, 8, 256)
    assert Runs.of_box((1, 4, 8), 4, (0, 2, 4), (1, 2, 4)) == Runs(80, 16, 32, 2, 128)
    assert not box_placements([Shard(1), Shard(2)], 3, (2, 2))
    assert not box_placements([Shard(2)], 2, (2,))
    assert not box_placements([Partial(), Replicate()], 2, (2, 2))
    assert box_placements([Shard(2), Shard(0)], 3, (2, 2))


def test_a_strided_shard_is_a_box_only_where_later_shards_of_its_dimension_cut_first():
    """FSDP2 over a column-parallel weight: ``[_StridedShard(0, 2), Shard(0)]`` on a 2 x 2
    mesh is a band of rows per coordinate; a strided shard whose split factor is not the
    size of the later shards of its dimension, or with none, interleaves its rows."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert box_placements([_StridedShard(0, split_factor=2), Shard(0)], 2, (2, 2))
    assert box_placements([_StridedShard(1, split_factor=3), Shard(1)], 2, (2, 3))
    assert not box_placements([_StridedShard(0, split_factor=2), Shard(0)], 2, (2, 4))
    assert not box_placements([_StridedShard(0, split_factor=2), Replicate()], 2, (2, 2))
    assert not box_placements([_StridedShard(0, split_factor=2)], 2, (4,))
