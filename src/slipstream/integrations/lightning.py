"""Lightning checkpoints through slipstream: ``Trainer(plugins=[SlipstreamCheckpointIO()])``.

Lightning hands its ``CheckpointIO`` the whole checkpoint dict on global rank 0 only
(``Strategy.save_checkpoint``), names it by a file path (``epoch=1-step=20.ckpt``), and
removes older ones as ``ModelCheckpoint`` rotates its top-k and ``last`` files.
:class:`SlipstreamCheckpointIO` writes a slipstream (DCP-format) checkpoint *directory* at
that path, as one process alone (``no_dist``: no other rank takes part), and keeps these
invariants:

- ``save_checkpoint`` returns once the state is staged: the model and optimizer may change
  from then on; the write goes on in the background. The path exists (as a directory) when
  it returns, as a file would after ``torch.save``, so ``ModelCheckpoint``'s existence
  checks see it.
- A save over an existing checkpoint never leaves a half-written one: the old one stays
  committed until the new one replaces it atomically (see slipstream's generations).
- ``remove_checkpoint``, ``load_checkpoint`` and a later save to a path wait for the save
  in flight to that path first; ``teardown`` waits for every save. On a local disk a
  removed checkpoint's name is free when ``remove_checkpoint`` returns, and its files are
  deleted on the plugin's own thread, which ``teardown`` joins. A save that failed in the
  background is raised, naming its path, by the next call that waits on it, the next
  ``save_checkpoint``, or ``teardown``.
- ``load_checkpoint`` returns the dict Lightning saved, with its original types (int keys
  of optimizer state, hyper-parameter dataclasses, enums, omegaconf containers).
- A resume never loads an incomplete checkpoint (a save that never committed: no
  ``.metadata``, nothing but a save's own files): ``load_checkpoint`` of one raises, naming
  the newest complete checkpoint beside it. ``ckpt_path="last"`` picks the newest
  ``last*.ckpt`` that exists, complete or not: the first save to such a path (one that
  does not exist yet) is written to a hidden sibling and renamed into place once
  committed, before ``save_checkpoint`` returns; later saves over it go through
  slipstream's generations, which keep the previous one committed until the new one is.
  So a ``last*.ckpt`` is complete whenever it exists.
- The plugin's first save or removal in a local directory removes what a killed run left
  there (:func:`.removal.sweep`): incomplete ``*.ckpt`` directories, hidden directories of a
  removal cut short, temporary files; its first load there, the last two only.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError as exc:  # pragma: no cover - exercised only without lightning installed
    raise ImportError(
        "slipstream.integrations.lightning needs the Lightning package: pip install lightning"
    ) from exc

import slipstream as ss
from slipstream.errors import CheckpointError

from .removal import Remover, saving_name, sweep
from .training_state import incomplete_error, is_incomplete

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A save in flight, and whether it made its path (to remove again if it fails)."""

    response: ss.AsyncSaveResponse
    created: bool
    storage_options: dict[str, Any] | None


class SlipstreamCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stages a checkpoint and writes it in the background.

    ``timeout`` (seconds) bounds each wait on a save: its staging, and its completion before
    a removal, a load or ``teardown``. ``storage_options`` configure an object store
    (``s3://``, ``gs://``, ``az://`` paths; see docs/storage.md). ``trusted`` names further
    classes a checkpoint's plain values may hold (as ``ss.load``'s ``trusted``);
    ``load_checkpoint(..., weights_only=False)`` trusts everything, as ``torch.load`` does.
    """

    def __init__(
        self,
        *,
        timeout: float = ss.SaveOptions.timeout,
        storage_options: dict[str, Any] | None = None,
        trusted: Any = None,
    ) -> None:
        self.timeout = timeout
        self.storage_options = storage_options
        self.trusted = trusted
        self._in_flight: dict[str, _Pending] = {}
        self._remover = Remover()
        self._swept: set[tuple[str, bool]] = set()
        """The (directory, with incomplete checkpoints) sweeps this plugin ran."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage ``checkpoint`` for ``path`` and return; the write goes on in the background."""
        key = _key(path)
        self._raise_finished_failures()
        self._wait_for(key)  # a save over one in flight: the first's failure is not lost
        self._sweep(key, incomplete=True)
        options = storage_options if storage_options is not None else self.storage_options
        fs = get_filesystem(key, **(options or {}))
        if fs.isfile(key):
            raise CheckpointError(
                f"{key} is a file (a checkpoint written by another CheckpointIO?); "
                "SlipstreamCheckpointIO writes a directory there: remove the file or save "
                "under another name"
            )
        created = not fs.exists(key)
        if created and "://" not in key and _is_last_name(key):
            self._save_in_place_once_committed(checkpoint, key)
            return
        fs.makedirs(key, exist_ok=True)
        try:
            response = ss.async_save(
                checkpoint, checkpoint_id=key, no_dist=True, storage_options=options
            )
        except BaseException:
            if created:  # nothing was written: leave no directory that looks like a checkpoint
                fs.rm(key, recursive=True)
            raise
        self._in_flight[key] = _Pending(response, created, options)
        try:
            response.staging_completion.result(self.timeout)
        except FutureTimeoutError:
            raise CheckpointError(
                f"staging the checkpoint for {key} did not finish within {self.timeout:g} s"
            ) from None
        except BaseException as exc:
            self._failed(key, exc)

    def _save_in_place_once_committed(self, checkpoint: dict[str, Any], key: str) -> None:
        """Save a new ``last*.ckpt`` before returning, into a hidden sibling renamed to
        ``key`` once committed: ``ckpt_path="last"`` takes any such path that exists, so it
        never exists unfinished (a kill leaves the hidden directory, which a sweep
        removes)."""
        hidden = saving_name(key)
        try:
            ss.async_save(checkpoint, checkpoint_id=hidden, no_dist=True).result(self.timeout)
            os.rename(hidden, key)
        except BaseException as exc:
            if os.path.isdir(hidden):
                shutil.rmtree(hidden, ignore_errors=True)
            raise CheckpointError(f"saving the checkpoint {key} failed: {exc}") from exc

    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The dict saved at ``path`` (after the save in flight to it, if any, is done).

        A file at ``path`` (a checkpoint from ``TorchCheckpointIO``) is read with
        ``torch.load``, so a run can switch to slipstream and resume from its old
        checkpoints. ``map_location``: a device (or its name) every tensor moves to, a dict
        mapping ``"cpu"`` to one, or a function called as ``fn(tensor, "cpu")``.
        """
        key = _key(path)
        self._wait_for(key)
        self._sweep(key, incomplete=False)
        fs = get_filesystem(key, **(self.storage_options or {}))
        if not fs.exists(key):
            raise FileNotFoundError(f"Checkpoint not found: {key}")
        if "://" not in key and is_incomplete(key):
            raise incomplete_error(key)
        if fs.isfile(key):
            return TorchCheckpointIO().load_checkpoint(
                key, map_location=map_location, weights_only=weights_only
            )
        trusted = True if weights_only is False else self.trusted
        checkpoint = ss.load_all(key, trusted=trusted, storage_options=self.storage_options)
        if map_location is None:
            return checkpoint
        return _map_tensors(checkpoint, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``, after the save in flight to it, if any, is done.
        On a local disk the name is free at once and the files are deleted on a thread of
        this plugin's (:class:`~slipstream.integrations.removal.Remover`)."""
        key = _key(path)
        self._wait_for(key)
        if "://" not in key:
            self._sweep(key, incomplete=True)
            if os.path.lexists(key):
                self._remover.remove(key)
                logger.debug("removing checkpoint %s", key)
            return
        fs = get_filesystem(key, **(self.storage_options or {}))
        if fs.exists(key):
            fs.rm(key, recursive=True)
            logger.debug("removed checkpoint %s", key)

    def teardown(self) -> None:
        """Wait for every save and removal in flight; raise the first failure, naming its
        path."""
        self._remover.wait(self.timeout)
        failures = []
        for key in list(self._in_flight):
            try:
                self._wait_for(key)
            except CheckpointError as exc:
                failures.append(exc)
        if failures:
            if len(failures) > 1:
                logger.error("further checkpoint failures: %s", failures[1:])
            raise failures[0]

    def _sweep(self, key: str, incomplete: bool) -> None:
        """The first time this plugin touches ``key``'s local directory (with
        ``incomplete``: the first time it saves or removes there), remove what a killed
        run left in it; never what a save of this plugin's own is writing."""
        directory = os.path.dirname(key)
        if "://" in key or (directory, incomplete) in self._swept:
            return
        if any(os.path.dirname(k) == directory for k in self._in_flight):
            return  # until none of this plugin's saves is writing there
        self._swept.add((directory, incomplete))
        if incomplete:
            self._swept.add((directory, False))
        sweep(directory, _is_checkpoint_name if incomplete else None)

    def _wait_for(self, key: str) -> None:
        pending = self._in_flight.get(key)
        if pending is None:
            return
        try:
            pending.response.upload_completion.result(self.timeout)
        except FutureTimeoutError:
            raise CheckpointError(
                f"the save to {key} did not finish within {self.timeout:g} s "
                "(SlipstreamCheckpointIO(timeout=...) sets how long to wait)"
            ) from None
        except BaseException as exc:
            self._failed(key, exc)
        del self._in_flight[key]

    def _failed(self, key: str, exc: BaseException) -> None:
        """Forget the failed save to ``key`` and raise its error; a path it made goes too
        (the saver removed what it wrote), so no empty directory passes for a checkpoint;
        a checkpoint it was saving over stays as it was."""
        pending = self._in_flight.pop(key)
        if pending.created:
            fs = get_filesystem(key, **(pending.storage_options or {}))
            if fs.exists(key):
                fs.rm(key, recursive=True)
        raise CheckpointError(f"saving the checkpoint {key} failed: {exc}") from exc

    def _raise_finished_failures(self) -> None:
        for key, pending in list(self._in_flight.items()):
            if pending.response.upload_completion.done():
                self._wait_for(key)


def _is_last_name(key: str) -> bool:
    """Whether ``ModelCheckpoint``'s ``ckpt_path="last"`` looks for a checkpoint so named."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    name = os.path.basename(key.rstrip("/"))
    last = re.escape(ModelCheckpoint.CHECKPOINT_NAME_LAST)
    extension = re.escape(ModelCheckpoint.FILE_EXTENSION)
    return re.match(rf"^{last}(-(\d+))?.*{extension}$", name) is not None


def _is_checkpoint_name(name: str) -> bool:
    return name.endswith(".ckpt")


def _key(path: Any) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


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
