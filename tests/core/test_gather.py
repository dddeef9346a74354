"""FlatGather: many tensors into their slots of one flat buffer, in one call per dtype (and
one for the strided rest), each slot receiving exactly its tensor's bytes."""

from __future__ import annotations

import pytest
import torch

from slipstream.core.gather import FlatGather, Slot


def _slots(sources: list[torch.Tensor]) -> tuple[list[Slot], int]:
    """Slots 64-byte aligned with a gap after each, which the copies must leave alone."""
    slots, offset = [], 64
    for src in sources:
        slots.append(Slot(offset, src.dtype, tuple(src.shape)))
        offset += (src.numel() * src.element_size() + 64 + 63) // 64 * 64
    return slots, offset


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _sources() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(100, generator=g),
        torch.randn(7, 3, generator=g).to(torch.bfloat16),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.tensor(2.5),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(200, generator=g),
        torch.tensor([True, False, True]),
    ]


@pytest.mark.parametrize("strided", [False, True])
def test_each_slot_gets_its_tensors_bytes_and_nothing_else_is_written(strided):
    sources = _sources()
    if strided:
        sources.append(torch.randn(6, 4).t())
    slots, size = _slots(sources)
    buffer = torch.full((size,), 0xAB, dtype=torch.uint8)
    calls = FlatGather(buffer, slots).copy(sources)
    assert calls == 4 + strided  # float32, bfloat16, int64, bool (+ the strided one)
    want = bytearray(b"\xab" * size)
    for slot, src in zip(slots, sources, strict=True):
        want[slot.offset : slot.offset + slot.nbytes] = _bytes_of(src)
    assert buffer.numpy().tobytes() == bytes(want)


def test_views_are_reused_so_a_second_copy_sees_new_values():
    sources = _sources()
    slots, size = _slots(sources)
    buffer = torch.zeros(size, dtype=torch.uint8)
    gather = FlatGather(buffer, slots)
    gather.copy(sources)
    for src in sources:
        src.copy_(torch.ones_like(src)) if src.dtype != torch.bool else src.logical_not_()
    gather.copy(sources, devices={torch.device("cpu")})
    for view, src in zip(gather.views, sources, strict=True):
        assert torch.equal(view, src)


def test_sources_that_require_grad_are_copied_without_a_graph():
    w = torch.nn.Parameter(torch.randn(10))
    slots, size = _slots([w])
    gather = FlatGather(torch.zeros(size, dtype=torch.uint8), slots)
    gather.copy([w])
    assert not gather.views[0].requires_grad
    assert torch.equal(gather.views[0], w.detach())


def test_a_wrong_number_of_sources_is_refused():
    slots, size = _slots(_sources())
    with pytest.raises(ValueError, match="6 sources for 7 slots"):
        FlatGather(torch.zeros(size, dtype=torch.uint8), slots).copy(_sources()[:6])
