"""Bulk copies that are fast on CPU and never hold the GIL for long.

``torch.Tensor.copy_`` releases the GIL while it runs, so copying in slices of
``SLICE_BYTES`` lets a background copy interleave with the training thread's Python work
instead of starving it, at no loss of bandwidth.
"""

from __future__ import annotations

import torch

SLICE_BYTES = 32 * 1024 * 1024


def copy_in_slices(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for same-shape tensors, in slices along the flattened data."""
    if dst.shape != src.shape:
        raise ValueError(f"copy shape mismatch: {tuple(dst.shape)} vs {tuple(src.shape)}")
    if non_blocking or not (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=non_blocking)
        return
    d = dst.reshape(-1)
    s = src.reshape(-1)
    step = max(1, SLICE_BYTES // max(1, dst.element_size()))
    for start in range(0, d.numel(), step):
        d[start : start + step].copy_(s[start : start + step])
