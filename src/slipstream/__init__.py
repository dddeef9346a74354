"""slipstream: move training state beside compute instead of in front of it.

Public API lives here (and in the ``sync`` and ``fsdp`` subpackages and the ``tracing``
module it exports); everything else may change between releases.
"""

from importlib import metadata as _metadata

from . import fsdp, sync
from .checkpoint import (
    AllowedTypes,
    AsyncSaveResponse,
    Checkpointer,
    CheckpointHealth,
    DataWriter,
    HfExport,
    LocalStorage,
    LocalTier,
    SaveOptions,
    SaveTimings,
    StagedState,
    Storage,
    allow_types,
    async_save,
    export_hf,
    load,
    load_all,
    load_hf,
    register_storage,
    save,
    stage,
)
from .core import tracing
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    FsdpError,
    MissingRanksError,
    PeerDiedError,
    PeerTimeoutError,
    SlipstreamError,
    SyncError,
    UnsafeCheckpointError,
)
from .sync import WeightPublisher, WeightSubscriber

# The version lives only in pyproject.toml; a source tree that was never installed has no
# metadata to read and says so instead of guessing.
try:
    __version__ = _metadata.version("slipstream")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"

__all__ = [
    "AllowedTypes",
    "AsyncSaveResponse",
    "CheckpointHealth",
    "Checkpointer",
    "DataWriter",
    "HfExport",
    "LocalStorage",
    "LocalTier",
    "SaveOptions",
    "SaveTimings",
    "StagedState",
    "Storage",
    "allow_types",
    "async_save",
    "export_hf",
    "load",
    "load_all",
    "load_hf",
    "register_storage",
    "save",
    "stage",
    "CheckpointError",
    "CorruptCheckpointError",
    "FsdpError",
    "MissingRanksError",
    "PeerDiedError",
    "PeerTimeoutError",
    "SlipstreamError",
    "SyncError",
    "UnsafeCheckpointError",
    "WeightPublisher",
    "WeightSubscriber",
    "fsdp",
    "sync",
    "tracing",
]
