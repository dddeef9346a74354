"""The bucket plan and the payload's segments, which every rank derives alike (no processes)."""

from __future__ import annotations

from typing import Any

from slipstream.sync.layout.plan import BucketPlan, TensorSpec, payload_offsets

BUCKET = 64 * 1024


def test_plan_splits_large_tensors_and_is_deterministic():
    specs = [
        TensorSpec("a", (10,), "float32"),
        TensorSpec("big", (50_000,), "float32"),
        TensorSpec("empty", (0, 3), "bfloat16"),
        TensorSpec("c", (3,), "int64"),
    ]
    plan = BucketPlan.build(specs, BUCKET, [0, 1])
    again = BucketPlan.build(specs, BUCKET, [0, 1])
    assert plan == again and plan.plan_id == again.plan_id
    big = [s for s in plan.slices if s.tensor == 1]
    assert len(big) == 4 and sum(s.nbytes for s in big) == 200_000
    assert all(s.bucket_offset + s.nbytes <= BUCKET for s in plan.slices)
    assert [b.owner for b in plan.buckets] == [0, 1, 0, 1]
    for b in plan.buckets:
        slices = plan.bucket_slices(b.index)
        offsets, size = payload_offsets(slices, [1] * len(slices))
        assert offsets == [s.bucket_offset for s in slices] and size == b.nbytes
    assert BucketPlan.build(specs, BUCKET, [0]).plan_id != plan.plan_id


def test_payload_segments_cover_the_included_slices_once_in_payload_order():
    from slipstream.sync.layout.segments import payload_segments

    specs = [
        TensorSpec("a", (100,), "float32"),  # 400 B, packed
        TensorSpec("b", (3000,), "float32"),  # 12000 B, separate
        TensorSpec("c", (10,), "int64"),  # 80 B, packed
        TensorSpec("d", (5,), "uint8"),  # 5 B, packed
        TensorSpec("e", (2000,), "float32"),  # 8000 B, separate
    ]
    slices = BucketPlan.build(specs, BUCKET, [0]).bucket_slices(0)
    for mask in ([1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [0, 1, 0, 1, 1], [0, 0, 0, 0, 0]):
        offsets, size = payload_offsets(slices, mask)
        segments = payload_segments(slices, mask, 4096)
        covered = []
        for seg in segments:
            if seg.slice is not None:
                assert slices[seg.slice].nbytes >= 4096 and mask[seg.slice]
                assert (seg.start, seg.nbytes) == (offsets[seg.slice], slices[seg.slice].nbytes)
            covered += [
                k
                for k in range(len(slices))
                if mask[k]
                and offsets[k] >= seg.start
                and offsets[k] + slices[k].nbytes <= seg.start + seg.nbytes
            ]
        assert sorted(covered) == [k for k in range(len(slices)) if mask[k]]
        assert [seg.start for seg in segments] == sorted(seg.start for seg in segments)
        assert all(
            a.start + a.nbytes <= b.start for a, b in zip(segments, segments[1:], strict=False)
        )
        assert not segments or segments[-1].start + segments[-1].nbytes == size
    # nothing separate: the whole payload is one segment
    whole = payload_segments(slices, [1] * 5, None)
    assert [(s.start, s.nbytes, s.slice) for s in whole] == [
        (0, payload_offsets(slices, [1] * 5)[1], None)
    ]


def _held_by(shape, mesh_shape, placements):
    """The bytes of a float32 tensor of ``shape`` each mesh coordinate (trainer rank, in
    row-major order) holds, from DTensor's own arithmetic, element by element."""
    import itertools

    import torch
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    index = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    held = {}
    coords = itertools.product(*(range(n) for n in mesh_shape))
    for rank, coord in enumerate(coords):
        size, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
        box = index[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
        held[rank] = {int(e) * 4 + b for e in box.flatten().tolist() for b in range(4)}
    return held


def test_trainer_shards_placed_by_rows_and_columns_are_cut_into_parts_that_cover_each_byte_once():
    """Shard(1) (a row-parallel weight's band of columns), Shard(0) x Shard(1) (dp x tp),
    Shard(1) uneven and a replicated dimension (the replicas split a strided box by runs),
    Shard(2) of a head or expert dimension, alone and under Shard(0): every byte of the
    tensor is in exactly one part, of a trainer that holds it; the plan's slices are ranges
    of the parts' runs, aligned in the payload; the layout round-trips through its JSON.
    Shards of two dimensions past the first have no holders (they are gathered)."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.tensor import Replicate, Shard

    from slipstream.sync.layout.holders import _parts
    from slipstream.sync.layout.plan import ALIGN, layout_json, plan_from_json

    cases = [
        ((6, 10), (2,), (Shard(1),)),
        ((6, 10), (2, 2), (Shard(0), Shard(1))),
        ((7, 5), (2,), (Shard(1),)),
        ((5, 6, 3), (2, 2), (Replicate(), Shard(1))),
        ((4, 8), (4,), (Shard(0),)),
        ((3, 4, 10), (2,), (Shard(2),)),
        ((5, 4, 6), (2, 2), (Shard(0), Shard(2))),
        ((3, 4, 6), (2, 2), (Replicate(), Shard(2))),
    ]
    for shape, mesh_shape, placements in cases:
        spec = TensorSpec("w", shape, "float32")
        world = int(torch.tensor(mesh_shape).prod())
        mesh = SimpleNamespace(mesh=torch.arange(world).view(mesh_shape))
        t: Any = SimpleNamespace(placements=placements, device_mesh=mesh)
        parts = _parts(spec, t, {r: r for r in range(world)})
        assert parts is not None, (shape, placements)
        held = _held_by(shape, mesh_shape, placements)
        seen: list[int] = []
        for p in parts:
            mine = [b for run in p.run_starts() for b in range(run, run + p.stop - p.start)]
            assert set(mine) <= held[p.owner], (shape, placements, p)
            seen += mine
        assert sorted(seen) == list(range(spec.nbytes)), (shape, placements)
        holders = (parts,)
        plan = BucketPlan.build([spec], 128, list(range(world)), holders)
        assert sum(s.nbytes for s in plan.slices) == spec.nbytes
        for s in plan.slices:
            owner = plan.buckets[s.bucket].owner
            bytes_ = set(range(s.tensor_offset, s.tensor_offset + s.nbytes))
            assert bytes_ <= held[owner] and s.bucket_offset % ALIGN == 0, (placements, s)
        meta = layout_json(plan.specs, 128, plan.trainer_ranks, plan.holders)
        assert plan_from_json(meta) == plan
    mesh = SimpleNamespace(mesh=torch.arange(4).view(2, 2))
    later: Any = SimpleNamespace(placements=(Shard(1), Shard(2)), device_mesh=mesh)
    assert _parts(TensorSpec("w", (2, 4, 4), "float32"), later, {r: r for r in range(4)}) is None


def test_a_bucket_of_narrow_column_bands_is_closed_when_its_header_is_full():
    """A ``Shard(1)`` part is a slice per row: rows of 64 bytes would put 131072 slices in an
    8 MiB bucket, past a header's room; each bucket is closed at ``MAX_SLICES`` instead, the
    next taking the rest, and the slices still cover every byte once, in each owner's
    buckets only."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.tensor import Shard

    from slipstream.sync.layout.holders import _parts
    from slipstream.sync.layout.plan import HEADER_CAP, MAX_SLICES

    spec = TensorSpec("band", (70_000, 32), "float32")
    mesh = SimpleNamespace(mesh=torch.arange(2))
    t: Any = SimpleNamespace(placements=(Shard(1),), device_mesh=mesh)
    parts = _parts(spec, t, {0: 0, 1: 1})
    assert parts is not None and {p.count for p in parts} == {70_000}
    plan = BucketPlan.build([spec], 8 * 2**20, [0, 1], (parts,))
    assert max(b.num_slices for b in plan.buckets) == MAX_SLICES
    assert plan.max_header_bytes <= HEADER_CAP
    assert len(plan.slices) == 140_000 and len(plan.buckets) == 4
    covered = sorted((s.tensor_offset, s.nbytes) for s in plan.slices)
    assert all(n == 64 for _, n in covered)
    assert [o for o, _ in covered] == list(range(0, spec.nbytes, 64))
    for s in plan.slices:  # owner 0 holds the first 16 columns of each 128-byte row
        assert (s.tensor_offset % 128 == 0) == (plan.buckets[s.bucket].owner == 0), s
