"""A framework's own checkpoint files, written beside training.

A drop-in for a framework's checkpoints writes exactly the files the framework writes
(``torch.save`` archives, safetensors, json) and changes only *when* and *how*: the state is
copied into reused host memory on the caller's thread (:mod:`.host_copy`), the files are
written on a thread of their own (:mod:`.background`), each one atomically and durably
(:mod:`.atomic`). :func:`async_torch_save` is the three together for one file.
"""

from .atomic import atomic_directory, atomic_file
from .background import BackgroundWrites, wait_for_path
from .host_copy import HostCopy
from .torch_file import async_torch_save, torch_save

__all__ = [
    "BackgroundWrites",
    "HostCopy",
    "async_torch_save",
    "atomic_directory",
    "atomic_file",
    "torch_save",
    "wait_for_path",
]
