"""Checkpoints in PyTorch DCP's format, saved asynchronously and loaded in place."""

from .api import async_save, load, save
from .checkpointer import Checkpointer
from .saver import AsyncSaveResponse, CheckpointSaver, SaveOptions, SaveTimings
from .storage import DataWriter, Storage, register_storage

__all__ = [
    "AsyncSaveResponse",
    "CheckpointSaver",
    "Checkpointer",
    "DataWriter",
    "SaveOptions",
    "SaveTimings",
    "Storage",
    "async_save",
    "load",
    "register_storage",
    "save",
]
