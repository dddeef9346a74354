"""Checkpoints in PyTorch DCP's format, saved asynchronously and loaded in place."""

from .api import async_save, load, save
from .checkpointer import Checkpointer
from .saver import AsyncSaveResponse, CheckpointSaver, SaveOptions, SaveTimings

__all__ = [
    "AsyncSaveResponse",
    "CheckpointSaver",
    "Checkpointer",
    "SaveOptions",
    "SaveTimings",
    "async_save",
    "load",
    "save",
]
