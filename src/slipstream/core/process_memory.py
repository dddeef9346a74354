"""Copying bytes out of another process's memory: Linux cross-memory attach.

``process_vm_readv(2)`` copies from a range of another process's address space straight
into ours, in one pass through the kernel: the CPU analogue of CUDA IPC. The kernel allows
it when we may ptrace the other process: the same user with Yama's ``ptrace_scope`` at 0,
or ``CAP_SYS_PTRACE``. Where it is refused, :func:`probe` says why, so a caller can use
something else.

Invariant: :func:`read_into` either fills every destination byte from the other process or
raises; a short read is never returned as success.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Callable, Sequence

import torch

#: The kernel's limit on iovecs per call (``IOV_MAX``).
MAX_IOVECS = 1024


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _bind() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_readv", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    readv: Callable[..., int] = fn
    return readv


_process_vm_readv = _bind()


class RemoteReadError(OSError):
    """Reading another process's memory failed (refused, process gone, bad address)."""


def _read_batch(pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """One call for matching lists of (address, length); retried for what a call left."""
    assert _process_vm_readv is not None, "read_into checks it is bound"
    while local:
        n = len(local)
        liov = (_IoVec * n)(*[_IoVec(a, m) for a, m in local])
        riov = (_IoVec * n)(*[_IoVec(a, m) for a, m in remote])
        done = _process_vm_readv(pid, liov, n, riov, n, 0)
        if done < 0:
            code = ctypes.get_errno()
            raise RemoteReadError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        if done == 0:
            raise RemoteReadError(errno.EIO, f"process_vm_readv from pid {pid} read nothing")
        local, remote = _advance(local, done), _advance(remote, done)


def _advance(iovs: list[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    """``iovs`` less their first ``done`` bytes."""
    out = []
    for addr, length in iovs:
        if done >= length:
            done -= length
            continue
        out.append((addr + done, length - done))
        done = 0
    return out


def read_into(pid: int, pairs: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Fill each contiguous CPU tensor ``dest`` from address ``addr`` in process ``pid``,
    for every ``(dest, addr)`` in ``pairs``, ``MAX_IOVECS`` ranges per system call."""
    if _process_vm_readv is None:
        raise RemoteReadError(errno.ENOSYS, "process_vm_readv is not available here")
    local: list[tuple[int, int]] = []
    remote: list[tuple[int, int]] = []
    for dest, addr in pairs:
        nbytes = dest.numel() * dest.element_size()
        if nbytes == 0:
            continue
        local.append((dest.data_ptr(), nbytes))
        remote.append((addr, nbytes))
        if len(local) == MAX_IOVECS:
            _read_batch(pid, local, remote)
            local, remote = [], []
    _read_batch(pid, local, remote)


def probe(pid: int, addr: int, expected: bytes) -> str | None:
    """``None`` if ``expected`` reads back from ``addr`` in process ``pid``, else why not."""
    got = torch.zeros(len(expected), dtype=torch.uint8)
    try:
        read_into(pid, [(got, addr)])
    except RemoteReadError as exc:
        return str(exc)
    if bytes(got.tolist()) != expected:
        return f"process_vm_readv from pid {pid} returned other bytes than it holds"
    return None
