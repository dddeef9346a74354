"""Lightning checkpoints through slipstream: ``Trainer(plugins=[SlipstreamCheckpointIO()])``.

Lightning hands its ``CheckpointIO`` the whole checkpoint dict on global rank 0 only
(``Strategy.save_checkpoint``), names it by a file path (``epoch=1-step=20.ckpt``), and
removes older ones as ``ModelCheckpoint`` rotates its top-k and ``last`` files.
:class:`SlipstreamCheckpointIO` writes exactly the file Lightning's ``TorchCheckpointIO``
writes there, through Lightning's own writer: one ``torch.save`` of the whole checkpoint
into one ``.ckpt`` archive, which ``torch.load``, ``pl_load`` and
``Model.load_from_checkpoint`` read with slipstream not installed. What slipstream changes
is when it is written, and that it is durable:

- By default (``background_write=False``) ``save_checkpoint`` returns once the file is
  written and fsynced, as Lightning's own IO returns once written: Lightning's flow reads
  a checkpoint at once after ``trainer.save_checkpoint`` (``load_from_checkpoint``, a new
  ``Trainer``'s ``ckpt_path``, a callback counting ``torch.save`` calls in
  ``on_train_end``).
- With ``background_write=True`` it returns once every tensor is copied into host memory
  that the plugin reuses from save to save; the model and optimizer may change from then
  on, and the file is written on a thread of its own that ends with the write. A later
  save waits until the write has serialized the copy before it reuses the memory. Until
  the file is complete the path holds the previous file (or nothing).
  ``load_checkpoint``, ``remove_checkpoint`` and a save to a path being written wait for
  that write, in this plugin or any other in the process. A local file is written to a
  hidden sibling, fsynced and renamed over the path; the plugin's first such write in a
  directory removes the hidden files a killed process left there. A process exits only after its
  writes (their threads are not daemons: Lightning's spawn launcher reads the
  ``.temp.ckpt`` its worker saved once the worker exited); ``teardown`` joins every
  write and raises the first failure, naming its path, as does the next
  ``save_checkpoint``.
- ``load_checkpoint`` and ``remove_checkpoint`` are Lightning's, with its messages; a
  checkpoint directory that earlier slipstream releases wrote (a ``.metadata`` inside)
  still loads.
- The plugin pickles (``ddp_spawn`` sends it to its workers) without its writes in
  flight.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError as exc:  # pragma: no cover - exercised only without lightning installed
    raise ImportError(
        "slipstream.integrations.lightning needs the Lightning package: pip install lightning"
    ) from exc

import slipstream as ss
from slipstream.checkpoint.files import (
    BackgroundWrites,
    HostCopy,
    async_torch_save,
    wait_for_path,
)
from slipstream.checkpoint.format.names import METADATA_FILE
from slipstream.checkpoint.storage.files import fsync_dir, fsync_file

from .removal import sweep

logger = logging.getLogger(__name__)


class SlipstreamCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` files, durable, and written beside training with
    ``background_write=True``.

    ``timeout`` (seconds) bounds each wait on a write in flight (before a load, a removal,
    a later save, ``teardown``). ``storage_options`` are passed on as Lightning's
    ``TorchCheckpointIO`` takes them (it refuses any).
    """

    def __init__(
        self,
        *,
        background_write: bool = False,
        timeout: float = ss.SaveOptions.timeout,
    ) -> None:
        self.background_write = background_write
        self.timeout = timeout
        self._writes = BackgroundWrites(nice=ss.SaveOptions.thread_nice)
        self._host = HostCopy(timeout)
        self._swept: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"background_write": self.background_write, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` as ``TorchCheckpointIO`` does; with
        ``background_write``, return once it is copied and write it on a thread."""
        self._writes.raise_finished_failures()
        wait_for_path(path, self.timeout)
        if not self.background_write or storage_options is not None:
            self._write(checkpoint, path, storage_options)
            return
        fs = get_filesystem(path)
        fs.makedirs(os.path.dirname(path), exist_ok=True)  # as Lightning's, on the caller
        self._sweep(os.fspath(path))
        async_torch_save(checkpoint, path, host_copy=self._host, writes=self._writes)

    def _sweep(self, path: str) -> None:
        """Before this plugin's first background write into a local directory, remove the
        hidden files of writes a killed process left there (:func:`.removal.sweep`)."""
        directory = os.path.dirname(os.path.abspath(path))
        if "://" in path or directory in self._swept:
            return
        self._swept.add(directory)
        sweep(directory)

    def _write(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
        """Lightning's own write (its checks, its fsspec handling), then an fsync."""
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        target = os.fspath(path)
        if "://" not in target and os.path.isfile(target):
            fsync_file(target)
            fsync_dir(os.path.dirname(os.path.abspath(target)))

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable[..., Any] | Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``TorchCheckpointIO.load_checkpoint``, once no write in this process is
        producing ``path``."""
        wait_for_path(path, self.timeout)
        target = os.fspath(path)
        if "://" not in target and os.path.isfile(os.path.join(target, METADATA_FILE)):
            return _load_slipstream_directory(target, map_location, weights_only)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """``TorchCheckpointIO.remove_checkpoint``, once no write in this process is
        producing ``path``."""
        wait_for_path(path, self.timeout)
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)
            logger.debug("Removed checkpoint: %s", path)

    def teardown(self) -> None:
        """Wait for every write in flight and join its thread; raise the first failure."""
        self._writes.wait(self.timeout)


def _load_slipstream_directory(
    path: str, map_location: Any, weights_only: bool | None
) -> dict[str, Any]:
    """A checkpoint directory an earlier slipstream wrote, as the dict Lightning saved."""
    checkpoint = ss.load_all(path, trusted=True if weights_only is False else None)
    if map_location is None:
        return checkpoint
    return _map_tensors(checkpoint, map_location)


def _map_tensors(value: Any, map_location: Any) -> Any:
    """``value`` with every tensor moved as ``map_location`` says (containers in place)."""
    if isinstance(value, torch.Tensor):
        if callable(map_location):
            mapped = map_location(value, "cpu")
            return mapped if isinstance(mapped, torch.Tensor) else value
        if isinstance(map_location, dict):
            target = map_location.get("cpu")
            return value if target is None else value.to(target)
        return value.to(map_location)
    if isinstance(value, dict):
        for k, v in value.items():
            value[k] = _map_tensors(v, map_location)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            value[i] = _map_tensors(v, map_location)
    return value
