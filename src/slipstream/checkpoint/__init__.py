"""Checkpoints in PyTorch DCP's format, saved asynchronously and loaded in place."""

from .api import async_save, load, save
from .checkpointer import Checkpointer
from .format.safe_types import AllowedTypes, allow_types
from .health import CheckpointHealth
from .hf.export import HfExport, export_hf
from .hf.load import load_hf
from .load.whole import load_all
from .save.job import AsyncSaveResponse, SaveTimings
from .save.options import SaveOptions
from .save.saver import CheckpointSaver
from .save.snapshot import StagedState, stage
from .storage import DataWriter, LocalStorage, Storage, register_storage
from .tier.options import LocalTier

__all__ = [
    "AllowedTypes",
    "AsyncSaveResponse",
    "CheckpointHealth",
    "HfExport",
    "LocalTier",
    "CheckpointSaver",
    "Checkpointer",
    "DataWriter",
    "SaveOptions",
    "SaveTimings",
    "StagedState",
    "LocalStorage",
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
]
