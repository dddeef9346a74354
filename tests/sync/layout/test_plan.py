"""The bucket plan and the payload's segments, which every rank derives alike (no processes)."""

from __future__ import annotations

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
