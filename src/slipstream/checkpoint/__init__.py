"""Checkpoints in PyTorch DCP's format, saved asynchronously and loaded in place."""

from .api import async_save, load, save
from .checkpointer import Checkpointer
from .health import CheckpointHealth
from .hf_export import HfExport, export_hf
from .hf_import import load_hf
from .options import SaveOptions
from .safe_types import AllowedTypes, allow_types
from .save_job import AsyncSaveResponse, SaveTimings
from .saver import CheckpointSaver
from .snapshot import StagedState, stage
from .storage import DataWriter, Storage, register_storage
from .tier_options import LocalTier
from .whole import load_all

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
