import pytest
import torch

from slipstream.core.copy import copy_in_slices

SMALL = 1000
"""Slices smaller than the tensors, so every copy below crosses slice boundaries."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_contiguous_cpu_copy_matches_copy_(dtype):
    src = (torch.arange(3001) % 7).to(dtype).reshape(3001)
    dst = torch.zeros_like(src)
    copy_in_slices(dst, src, slice_bytes=SMALL)
    assert torch.equal(dst, src)


def test_copy_into_a_view_of_a_larger_buffer_leaves_the_rest_alone():
    buf = torch.full((5000,), -1.0)
    src = torch.randn(40, 100)
    copy_in_slices(buf[500:4500].view(40, 100), src, slice_bytes=SMALL)
    assert torch.equal(buf[500:4500].view(40, 100), src)
    assert bool((buf[:500] == -1).all()) and bool((buf[4500:] == -1).all())


def test_non_contiguous_and_lazy_sources_are_materialized():
    base = torch.randn(50, 60)
    dst = torch.empty(60, 50)
    copy_in_slices(dst, base.t(), slice_bytes=SMALL)
    assert torch.equal(dst, base.t())
    cplx = torch.randn(300, dtype=torch.complex64)
    out = torch.empty_like(cplx)
    copy_in_slices(out, cplx.conj(), slice_bytes=SMALL)
    assert torch.equal(out, cplx.conj())


def test_dtype_conversion_falls_back_to_copy_():
    src = torch.randn(2000)
    dst = torch.empty(2000, dtype=torch.float64)
    copy_in_slices(dst, src, slice_bytes=SMALL)
    assert torch.equal(dst, src.double())


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        copy_in_slices(torch.empty(3), torch.empty(4))
