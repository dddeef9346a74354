"""Exceptions raised by slipstream. Every message names the key, file, rank or shape at fault."""


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


class PeerDiedError(PeerTimeoutError):
    """A rank stopped answering (no heartbeat): it died or is stopped. The message names the
    rank and what was waiting for it; found within seconds, whatever the timeout."""


class SyncError(SlipstreamError):
    """A weight transfer failed or was rejected; the receiver holds no mixed version."""


class FsdpError(SlipstreamError):
    """An FSDP unit was misconfigured or ranks disagree; raised before any collective hangs."""
