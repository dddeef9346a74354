"""Reading another process's memory (here: our own, which the kernel always allows)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from slipstream.core import process_memory
from slipstream.core.process_memory import MAX_IOVECS, RemoteReadError, probe, read_into


def test_read_into_fills_every_destination_across_many_system_calls():
    sources = [torch.arange(n, dtype=torch.int32) * 3 + n for n in range(1, 2 * MAX_IOVECS + 7)]
    dests = [torch.empty_like(t) for t in sources]
    read_into(os.getpid(), [(d, s.data_ptr()) for d, s in zip(dests, sources, strict=True)])
    for d, s in zip(dests, sources, strict=True):
        assert torch.equal(d, s)


def test_a_short_read_is_continued_where_it_stopped(monkeypatch):
    """A unit test of this module's own retry loop: the kernel may return a short read,
    which no caller can provoke on demand, so the bound system call is wrapped here."""
    real = process_memory._process_vm_readv
    calls = []

    def at_most_100_bytes(pid, liov, n, riov, rn, flags):
        calls.append(n)
        liov[0].length = min(liov[0].length, 100)  # the kernel may stop part-way
        return real(pid, liov, 1, riov, 1, flags)

    monkeypatch.setattr(process_memory, "_process_vm_readv", at_most_100_bytes)
    src = torch.arange(1000, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    read_into(os.getpid(), [(dst, src.data_ptr())])
    assert torch.equal(dst, src)
    assert len(calls) == 10


def test_probe_names_a_process_that_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    why = probe(child.pid, 4096, b"x")
    assert why is not None and f"pid {child.pid}" in why


def test_probe_of_our_own_bytes_succeeds_and_a_wrong_expectation_is_reported():
    held = torch.tensor(list(b"slipstream"), dtype=torch.uint8)
    assert probe(os.getpid(), held.data_ptr(), b"slipstream") is None
    assert "other bytes" in probe(os.getpid(), held.data_ptr(), b"something!")


def test_a_bad_address_raises_naming_the_pid():
    with pytest.raises(RemoteReadError, match=f"pid {os.getpid()}"):
        read_into(os.getpid(), [(torch.empty(8, dtype=torch.uint8), 8)])
