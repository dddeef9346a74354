"""Exceptions raised by slipstream. Every message names the key, file, rank or shape at fault."""

from __future__ import annotations

from collections.abc import Sequence


class SlipstreamError(RuntimeError):
    """Base class of every error slipstream raises on purpose."""


class CheckpointError(SlipstreamError):
    """A checkpoint could not be saved or loaded; nothing was committed or applied."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match what was written (checksum, truncation, bad header)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint asks to run or import something outside the allow-list."""


class PeerTimeoutError(SlipstreamError, TimeoutError):
    """A rank or worker did not answer within its timeout; the message names it."""


class MissingRanksError(PeerTimeoutError):
    """Ranks did not answer: ``ranks`` (sorted), what was awaited from them (``what``) and for
    how long (``waited`` seconds). The message names all three, and the waiting party."""

    def __init__(
        self, message: str, ranks: Sequence[int] = (), what: str = "", waited: float = 0.0
    ) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.what = what
        self.waited = waited


class PeerDiedError(MissingRanksError):
    """A rank stopped answering (its process is gone, or no heartbeat): it died or is stopped.
    The message names the rank and what was waiting for it; found within seconds, whatever
    the timeout. ``ranks`` are the dead ranks."""


class SyncError(SlipstreamError):
    """A weight transfer failed or was rejected; the receiver holds no mixed version."""


class FsdpError(SlipstreamError):
    """An FSDP unit was misconfigured or ranks disagree; raised before any collective hangs."""
