"""slipstream: move training state beside compute instead of in front of it.

Public API lives here; everything else may change between releases.
"""

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    FsdpError,
    PeerTimeoutError,
    SlipstreamError,
    SyncError,
    UnsafeCheckpointError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "FsdpError",
    "PeerTimeoutError",
    "SlipstreamError",
    "SyncError",
    "UnsafeCheckpointError",
]
