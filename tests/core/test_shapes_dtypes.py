import pytest
import torch

from slipstream.core.dtypes import dtype_from_name, dtype_name
from slipstream.core.shapes import numel, row_major_strides

_DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=lambda d: str(d)
)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_dtype_names_round_trip(dtype):
    assert dtype_from_name(dtype_name(dtype)) is dtype


@pytest.mark.parametrize("name", ["float", "nn", "Tensor", "float128", ""])
def test_a_name_that_is_no_dtype_is_refused_by_name(name):
    if isinstance(getattr(torch, name, None), torch.dtype):
        assert dtype_from_name(name) is getattr(torch, name)  # aliases such as "float"
        return
    with pytest.raises(ValueError, match=f"unknown dtype {name!r}"):
        dtype_from_name(name)


@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (2, 3, 4), (1, 5, 1, 6)])
def test_numel_and_strides_match_a_contiguous_tensor(shape):
    t = torch.empty(shape)
    assert numel(shape) == t.numel()
    assert row_major_strides(shape) == t.stride()
