"""Holds on memory another party may reuse: the protocol between a buffer and its readers.

A snapshot (:func:`slipstream.stage`) owns a buffer that a later stage reuses; a reader
(a save, a publish) takes a hold for as long as it reads, and the buffer is not reused
while any hold is taken. Readers see only :class:`Holdable`, so a reader's package needs
nothing from the package that owns the buffer.

Invariant: every hold taken is released exactly once, by the reader that took it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Holdable(Protocol):
    """Memory that is not reused between :meth:`hold` and :meth:`release`."""

    def hold(self, who: str) -> int:
        """Keep the memory from being reused until :meth:`release` of the returned token;
        ``who`` names the reader in errors. Raises when the memory was reused already."""
        ...

    def release(self, hold: int) -> None:
        """Let go of one hold."""
        ...
