"""Bulk copies that are fast on CPU and never hold the GIL for long.

A background copy is copied in slices of ``SLICE_BYTES`` (each function's ``slice_bytes``)
so it interleaves with the
training thread's Python work instead of starving it. Between contiguous CPU tensors of
one dtype each slice is a single-threaded ``memmove`` (through ``ctypes``, which drops
the GIL for the call): it runs on the copying thread's core only, where
``Tensor.copy_`` would fork an OpenMP team over every core, the training thread's
included, and stall behind whichever core is busy. Any other pair goes through
``Tensor.copy_``, still in slices where the layout allows.
"""

from __future__ import annotations

import ctypes

import torch

SLICE_BYTES = 32 * 1024 * 1024


def _plain_host_destination(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst`` takes ``src``'s bytes as they are: contiguous host memory of the
    same dtype, no lazy conjugation or negation (``copy_to_address`` checks ``src``)."""
    return (
        dst.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.is_contiguous()
        and not (dst.is_conj() or dst.is_neg())
    )


def _memmove_in_slices(to: int, frm: int, nbytes: int, slice_bytes: int) -> None:
    for start in range(0, nbytes, slice_bytes):
        ctypes.memmove(to + start, frm + start, min(slice_bytes, nbytes - start))


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_Buffer),)
_PYBUF_SIMPLE = 0
"""A plain contiguous byte buffer; a non-contiguous exporter refuses it."""
_PYBUF_WRITABLE = 0x0001


def copy_bytes(dst: memoryview, src: memoryview, slice_bytes: int = SLICE_BYTES) -> None:
    """Copy ``src`` into ``dst`` (equal lengths, C-contiguous; ``src`` may be read-only)
    with ``memmove`` in slices, without the GIL: a slice assignment between memoryviews
    holds it for the whole copy, so parallel readers would copy one at a time."""
    if len(dst) != len(src):
        raise ValueError(f"copy_bytes length mismatch: {len(dst)} vs {len(src)}")
    if not len(src):
        return
    views = (_Buffer(), _Buffer())
    _get_buffer(dst, ctypes.byref(views[0]), _PYBUF_WRITABLE)
    try:
        _get_buffer(src, ctypes.byref(views[1]), _PYBUF_SIMPLE)
        try:
            _memmove_in_slices(views[0].buf, views[1].buf, len(src), slice_bytes)
        finally:
            _release_buffer(ctypes.byref(views[1]))
    finally:
        _release_buffer(ctypes.byref(views[0]))


def copy_to_address(address: int, src: torch.Tensor, slice_bytes: int = SLICE_BYTES) -> bool:
    """Copy the bytes of ``src`` to host memory at ``address`` (which must hold them) with
    ``memmove`` in slices, when ``src`` is a contiguous CPU tensor whose bytes are its values
    (no lazy conjugation or negation). Returns False, having copied nothing, otherwise.

    No tensor view of the destination is made: staging many small tensors this way costs
    a few microseconds of Python each instead of tens."""
    if not (src.device.type == "cpu" and src.is_contiguous()) or src.is_conj() or src.is_neg():
        return False
    _memmove_in_slices(address, src.data_ptr(), src.numel() * src.element_size(), slice_bytes)
    return True


def copy_in_slices(
    dst: torch.Tensor,
    src: torch.Tensor,
    non_blocking: bool = False,
    slice_bytes: int = SLICE_BYTES,
) -> None:
    """``dst.copy_(src)`` for same-shape tensors, in slices of ``slice_bytes`` along the
    flattened data."""
    if dst.shape != src.shape:
        raise ValueError(f"copy shape mismatch: {tuple(dst.shape)} vs {tuple(src.shape)}")
    if (
        not non_blocking
        and _plain_host_destination(dst, src)
        and copy_to_address(dst.data_ptr(), src, slice_bytes)
    ):
        return
    if non_blocking or not (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=non_blocking)
        return
    d = dst.reshape(-1)
    s = src.reshape(-1)
    step = max(1, slice_bytes // max(1, dst.element_size()))
    for start in range(0, d.numel(), step):
        d[start : start + step].copy_(s[start : start + step])
