"""Names of torch dtypes as plans, indexes and reports write them."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the attribute of ``torch`` that names it."""
    return str(dtype).removeprefix("torch.")
