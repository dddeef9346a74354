"""The flat sharded layout, without processes: shards are torch.chunk rows, gather round-trips."""

from __future__ import annotations

import torch

from slipstream.core.buffers import storage_is_released
from slipstream.fsdp import FlatLayout, FlatShardedBuffer

SHAPES = [("a", (5, 3)), ("b", (7,)), ("c", (1, 2, 2)), ("d", (8, 4))]


def _buffers(world_size: int) -> tuple[list[torch.Tensor], list[FlatShardedBuffer]]:
    torch.manual_seed(0)
    params = [torch.randn(shape) for _, shape in SHAPES]
    layout = FlatLayout.plan(SHAPES, torch.float32, world_size)
    return params, [
        FlatShardedBuffer(layout, r, params, torch.device("cpu")) for r in range(world_size)
    ]


def test_each_rank_holds_its_torch_chunk_rows_as_views_of_its_segment():
    world_size = 4
    params, bufs = _buffers(world_size)
    for rank, buf in enumerate(bufs):
        for slot, p in zip(buf.layout.slots, params, strict=True):
            local = buf.local_view(buf.main, slot)
            chunks = p.chunk(world_size)
            expected = chunks[rank] if rank < len(chunks) else p[:0]
            assert torch.equal(local, expected), (slot.name, rank)
            assert local.untyped_storage().data_ptr() == buf.main.untyped_storage().data_ptr()


def test_gathered_segments_copy_out_to_full_params_and_copy_in_inverts_it():
    world_size = 3
    params, bufs = _buffers(world_size)
    gathered = torch.cat([b.main for b in bufs])
    buf = bufs[1]
    views = buf.set_compute_dtype(torch.float32)
    assert storage_is_released(buf.unsharded)
    buf.reallocate()
    buf.copy_out(gathered)
    for view, p in zip(views, params, strict=True):
        assert torch.equal(view, p)
    reduce_input = torch.full_like(gathered, float("nan"))
    buf.copy_in(list(params), reduce_input)
    for rank, other in enumerate(bufs):
        segment = reduce_input.view(world_size, -1)[rank]
        for slot in other.layout.slots:
            assert torch.equal(other.local_view(segment, slot), other.local_view(other.main, slot))
    buf.release()
    assert storage_is_released(buf.unsharded) and views[0].shape == (5, 3)


def test_copy_out_casts_to_the_compute_dtype():
    params, bufs = _buffers(2)
    views = [b.set_compute_dtype(torch.bfloat16) for b in bufs][0]
    gathered = torch.cat(
        [b.send_buffer(torch.empty(b.layout.segment_numel, dtype=torch.bfloat16)) for b in bufs]
    )
    bufs[0].reallocate()
    bufs[0].copy_out(gathered)
    for view, p in zip(views, params, strict=True):
        assert view.dtype == torch.bfloat16 and torch.equal(view, p.to(torch.bfloat16))


def test_copy_in_lays_missing_gradients_out_as_zeros_and_pads_with_zeros():
    world_size = 3
    params, bufs = _buffers(world_size)
    buf = bufs[0]
    grads = [params[0], None, params[2], None]  # frozen or unused parameters give no gradient
    reduce_input = torch.full((buf.layout.gathered_numel,), float("nan"))
    buf.copy_in(grads, reduce_input)
    segments = reduce_input.view(world_size, -1)
    for rank in range(world_size):
        for slot, grad in zip(buf.layout.slots, grads, strict=True):
            block = segments[rank, slot.offset : slot.offset + slot.padded_numel]
            rows = slot.local_rows(rank)
            expected = torch.zeros(slot.padded_numel)
            if grad is not None and rows:
                expected[: rows * slot.row_numel] = grad.chunk(world_size)[rank].reshape(-1)
            assert torch.equal(block, expected), (slot.name, rank)
