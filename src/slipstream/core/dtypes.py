"""Names of torch dtypes as plans, indexes and reports write them, both ways.

Invariant: ``dtype_from_name(dtype_name(d)) is d`` for every torch dtype, and a name that is
not one raises (it never falls back to another attribute of ``torch``).
"""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the attribute of ``torch`` that names it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; :class:`ValueError` naming ``name`` when it is
    not the name of a torch dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: not the name of a torch dtype")
    return dtype
