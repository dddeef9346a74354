"""Many tensors copied into views of one flat byte buffer in a few fused calls.

:class:`FlatGather` is built once per buffer and list of slots (offset, dtype, shape): it
keeps a typed view of the buffer per slot and, per dtype, the list of those views. A
:meth:`FlatGather.copy` then issues one ``torch._foreach_copy_`` per dtype for the sources
that live on the buffer's device and are contiguous (on an accelerator, the fused
multi-tensor kernel: a few launches for any number of tensors), one for the strided rest
(torch's per-tensor loop, in C++), and for sources on the host while the buffer is on an
accelerator, two: a host copy into a pinned buffer of this call's own, then an asynchronous
copy from it to the device. The caller's later changes to the sources cannot reach the
buffer through that last path: the bytes the device receives are this call's copy.

Invariant: every call queues its copies on the current stream of the buffer's device, in
the order of the slots, and each slot receives exactly its source's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import streams

ALIGN = 64
"""Alignment of the packed pinned buffer's pieces (host sources of a device buffer)."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor's values go in the flat buffer: ``dtype`` and ``shape``, row-major,
    from byte ``offset`` (a multiple of the dtype's size)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class FlatGather:
    """Copies a fixed list of tensors into their slots of ``buffer`` (flat ``uint8``)."""

    def __init__(self, buffer: torch.Tensor, slots: Sequence[Slot]) -> None:
        self.buffer = buffer
        self.device = buffer.device
        self.slots = list(slots)
        self.views = [
            buffer[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.slots
        ]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, s in enumerate(self.slots):
            by_dtype.setdefault(s.dtype, []).append(i)
        self._groups = [(idx, [self.views[i] for i in idx]) for idx in by_dtype.values()]

    def copy(
        self, sources: Sequence[torch.Tensor], devices: set[torch.device] | None = None
    ) -> int:
        """Queue the copy of ``sources[i]`` into slot ``i`` on the current stream; returns
        the number of copy calls issued. Each source has its slot's dtype and shape (the
        caller's plan says so: this is not checked per tensor, which would cost more than
        the copies' launches). ``devices``, where the sources live if the caller knows,
        saves a pass over them."""
        if len(sources) != len(self.slots):
            raise ValueError(f"{len(sources)} sources for {len(self.slots)} slots")
        if devices is None:
            devices = {src.device for src in sources}
        if devices - {self.device}:
            host = [i for i, src in enumerate(sources) if src.device != self.device]
            local = [i for i, src in enumerate(sources) if src.device == self.device]
        else:
            host, local = [], list(range(len(sources)))
        contiguous = [sources[i].is_contiguous() for i in local]
        calls = 0
        with torch.no_grad():
            if len(local) == len(sources) and all(contiguous):
                for idx, views in self._groups:
                    self._foreach(views, [sources[i] for i in idx])
                    calls += 1
            else:
                by_dtype: dict[torch.dtype, list[int]] = {}
                strided: list[int] = []
                for i, dense in zip(local, contiguous, strict=True):
                    if dense:
                        by_dtype.setdefault(self.slots[i].dtype, []).append(i)
                    else:
                        strided.append(i)
                for idx in [*by_dtype.values(), strided]:
                    if idx:
                        self._foreach([self.views[i] for i in idx], [sources[i] for i in idx])
                        calls += 1
            if host:
                calls += self._copy_from_host(host, sources)
        return calls

    @staticmethod
    def _foreach(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        torch._foreach_copy_(dst, src, non_blocking=True)

    def _copy_from_host(self, host: list[int], sources: Sequence[torch.Tensor]) -> int:
        """Host sources of a device buffer: copied now into a pinned buffer of this call,
        then from it to the device asynchronously (torch's pinned allocator keeps that
        buffer until the device has read it). A non-blocking copy straight from the
        caller's memory would, from pinned memory, read it only when the stream gets there,
        after the caller may have changed it."""
        for i in host:
            if sources[i].device.type != "cpu":
                raise ValueError(
                    f"source {i} is on {sources[i].device}, the buffer on {self.device}: "
                    "a gather reads from its own device and the host only"
                )
        offsets = []
        total = 0
        for i in host:
            offsets.append(total)
            total += (self.slots[i].nbytes + ALIGN - 1) // ALIGN * ALIGN
        pin = streams.is_accelerator(self.device)
        packed = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        staged = [
            packed[o : o + self.slots[i].nbytes].view(self.slots[i].dtype).view(self.slots[i].shape)
            for o, i in zip(offsets, host, strict=True)
        ]
        torch._foreach_copy_(staged, [sources[i] for i in host])
        self._foreach([self.views[i] for i in host], staged)
        return 2
