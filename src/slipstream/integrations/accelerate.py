"""``Accelerator.save_state`` writing accelerate's own files beside training.

``SlipstreamAccelerator`` is an ``accelerate.Accelerator`` whose ``save_state`` writes
exactly the files accelerate's writes, with the same names and contents
(:mod:`.accelerate_files`), so accelerate's own ``load_state`` (which this class keeps)
reads them, with or without slipstream. What changes is when and how: the state is copied
into reused host memory on the caller's thread (the random generators' states taken
there, at the call), the files are written on a thread of their own, and the directory
appears whole and durable (:mod:`~slipstream.checkpoint.files.into_directory`).

Invariants:

- A checkpoint directory never holds a partial file; a new one (automatic naming always
  makes one) appears under its name only once every file in it is fsynced. Until then it
  is a hidden ``.<name>.saving-<id>`` sibling.
- ``save_state`` returns once the checkpoint is in place and its rotation done, as
  accelerate's; with ``background_write``, once the state is copied (the caller may change
  it at once) while the write goes on.
- One save is in flight at a time: ``save_state`` and ``load_state`` first wait for the
  previous one; so do ``wait_for_checkpoints()`` and ``end_training()``. ``total_limit``
  rotation runs only after that wait, so it never deletes a checkpoint still being
  written; a rotated-out directory leaves its name at once and is deleted on a thread of
  its own (:mod:`.removal`), which those waits join.
- ``load_state()`` under automatic naming never picks a hidden directory a killed save or
  rotation left: the first ``save_state`` or ``load_state`` there removes them
  (:func:`.removal.sweep`), and the newest is picked among visible names only.
- With several processes, the main one renames the directory into place once every
  process's files are durable; that rename waits for all of them, and no collective runs
  off the caller's thread, so it happens in the ``save_state`` that waits (by default) or,
  with ``background_write``, at the next ``save_state``, ``load_state``,
  ``wait_for_checkpoints()`` or ``end_training()``, which every process must call.

Why a subclass and not accelerate's save/load pre-hooks: those hooks only see the model
weights; the optimizer, scheduler, RNG and custom objects are written with ``torch.save``
after them whatever a hook does. FSDP, DeepSpeed, Megatron-LM and XLA keep accelerate's own
``save_state`` (logged once); FSDP's sharded path calls DCP and goes through
``slipstream.dcp`` with the swap in docs/dcp.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, broadcast_object_list, gather_object
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "slipstream.integrations.accelerate needs the 'accelerate' package: pip install accelerate"
    ) from error

from ..checkpoint.files import BackgroundWrites, HostCopy, wait_for_path
from ..checkpoint.files.into_directory import files_into
from ..checkpoint.save.options import SaveOptions
from ..errors import CheckpointError
from .accelerate_files import state_files, write_files
from .removal import Remover, sweep

log = logging.getLogger(__name__)

_OWN_CODE = (
    DistributedType.FSDP,
    DistributedType.DEEPSPEED,
    DistributedType.MEGATRON_LM,
    DistributedType.XLA,
)


PROBE_ENV = "SLIPSTREAM_ACCELERATE_PROBE"
"""A file to which each ``save_state`` that slipstream writes (not accelerate's own code)
and each ``load_state`` that went through this class's waits appends a line: the call and
the running pytest test (for tests/integrations/test_accelerate_conformance.py)."""


def _probe(call: str) -> None:
    path = os.environ.get(PROBE_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        with open(path, "a") as out:
            out.write(f"slipstream:{call}\t{test}\n")


def _iteration(folder: str) -> int:
    """The number accelerate orders ``checkpoints/`` by (its ``_inner``)."""
    found = re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)
    if not found:
        raise CheckpointError(f"{folder}: no checkpoint iteration in its name")
    return int(found[0])


def _checkpoint_folders(root: str) -> list[str]:
    """The checkpoints under ``root``, oldest first: its visible entries (a hidden one is a
    save or a deletion in progress, or what a killed one left)."""
    names = [name for name in os.listdir(root) if not name.startswith(".")]
    return sorted((os.path.join(root, name) for name in names), key=_iteration)


@dataclass
class _Save:
    """A save in flight: where it goes, and (main process) the rename that ends it."""

    path: str
    commit: contextlib.ExitStack
    """Entered on the main process: closing it lands the directory (when several processes
    write; a single one closes it on its write's thread)."""


class SlipstreamAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state`` writes accelerate's files in the background.

    Takes accelerate's arguments, plus ``slipstream_timeout``: the bound on every wait for
    a previous save, in seconds (a save that does not finish in time raises, naming its
    directory); and ``background_write``: ``save_state`` returns once
    the state is copied and the files are written in the background (off by default: as
    accelerate's, ``save_state`` returns once the checkpoint is in place and nothing of it
    is still being written or rotated out, so the caller may read, copy or delete it).

    ``save_state`` writes what accelerate's writes, on the processes accelerate's writes it
    on; save hooks run as in accelerate, with the directory being assembled as their
    ``output_dir`` (files they write there are part of the checkpoint). ``load_state`` is
    accelerate's own, after waiting for the save in flight. A save changes nothing it saves.
    """

    def __init__(
        self,
        *args: Any,
        slipstream_timeout: float = SaveOptions.timeout,
        background_write: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.slipstream_timeout = slipstream_timeout
        self.background_write = background_write
        self._ss_copy = HostCopy(slipstream_timeout)
        self._ss_writes = BackgroundWrites(nice=SaveOptions.thread_nice)
        self._ss_save: _Save | None = None
        self._ss_remover = Remover()
        self._ss_swept = False
        self._ss_fallback_logged = False

    # -- waiting -----------------------------------------------------------------------------

    def wait_for_checkpoints(self) -> None:
        """Block until the last ``save_state`` is in place and its rotation done; raise its
        error. With several processes every one must call it (the rename waits for all)."""
        self._ss_remover.wait(self.slipstream_timeout)
        save, self._ss_save = self._ss_save, None
        if save is None:
            return
        failure: BaseException | None = None
        try:
            self._ss_writes.wait(self.slipstream_timeout)
        except CheckpointError as error:
            failure = error
        if self.num_processes > 1:
            failure = self._ss_commit_together(save, failure)
        if failure is not None:
            raise CheckpointError(
                f"save_state to {save.path} failed: {failure}; nothing of it is in place"
            ) from failure

    def _ss_commit_together(self, save: _Save, failure: BaseException | None) -> Any:
        """Every process's files are written: the main process renames the directory into
        place (or, if any process failed, removes it); all return once that is done."""
        written = gather_object([failure is None])
        if self.is_main_process:
            if all(written):
                save.commit.close()
            else:
                error = failure or CheckpointError("another process's write failed")
                save.commit.__exit__(type(error), error, error.__traceback__)
        self.wait_for_everyone()
        if failure is None and not all(written):
            return CheckpointError("another process's write failed")
        return failure

    def end_training(self) -> None:
        self.wait_for_checkpoints()
        super().end_training()

    # -- save --------------------------------------------------------------------------------

    def _ss_supported(self) -> bool:
        unsupported = self.distributed_type in _OWN_CODE
        if unsupported and not self._ss_fallback_logged:
            self._ss_fallback_logged = True
            log.warning(
                "slipstream: %s checkpoints use accelerate's own code (for FSDP, see the "
                "slipstream.dcp swap in docs/dcp.md)",
                self.distributed_type,
            )
        return not unsupported

    def _ss_sweep(self, root: str) -> None:
        """The first time, on the main process: remove what a killed run left in ``root``."""
        if self.is_main_process and not self._ss_swept:
            self._ss_swept = True
            sweep(root)

    def _ss_output_dir(self, output_dir: str | os.PathLike[str] | None) -> str:
        """Where to save; with automatic naming, accelerate's ``checkpoint_<i>`` after its
        ``total_limit`` rotation (run by the main process once no save is in flight)."""
        if not self.project_configuration.automatic_checkpoint_naming:
            if output_dir is None:
                raise CheckpointError(
                    "save_state needs an output_dir when automatic checkpoint naming is off"
                )
            return os.fspath(output_dir)
        root = os.path.join(self.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        self._ss_sweep(root)
        limit = self.project_configuration.total_limit
        if self.is_main_process and limit is not None:
            folders = _checkpoint_folders(root)
            if len(folders) + 1 > limit:
                log.warning(
                    "Deleting %d checkpoints to make room for new checkpoint.",
                    len(folders) + 1 - limit,
                )
            for folder in folders[: max(0, len(folders) + 1 - limit)]:
                self._ss_remover.remove(folder)
        path = os.path.join(root, f"checkpoint_{self.save_iteration}")
        if os.path.exists(path):
            raise ValueError(
                f"Checkpoint directory {path} ({self.save_iteration}) already exists. Please "
                "manually override `self.save_iteration` with what iteration to start with."
            )
        self.wait_for_everyone()
        return path

    def _ss_assemble(self, path: str) -> tuple[str, contextlib.ExitStack]:
        """The hidden directory every process writes into, and (main process) the commit
        that lands it in ``path``."""
        commit = contextlib.ExitStack()
        hidden: list[str | None] = [None]
        if self.is_main_process:
            hidden[0] = commit.enter_context(files_into(path))
        if self.num_processes > 1:
            broadcast_object_list(hidden)
        assert hidden[0] is not None
        return hidden[0], commit

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Path:
        """Copy the state, write accelerate's files for it into ``output_dir`` (or the next
        ``checkpoint_<i>``), return the directory, as accelerate's."""
        if not self._ss_supported():
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        self.wait_for_checkpoints()
        _probe("save_state")
        if save_model_func_kwargs:
            log.warning(
                "save_state: %s apply to DeepSpeed only; ignored", ", ".join(save_model_func_kwargs)
            )
        if self.project_configuration.save_on_each_node and self.num_processes > 1:
            log.warning(
                "save_state: with save_on_each_node, each node's main process writes the "
                "shared files, but the main process renames the directory into place: it "
                "needs a filesystem all nodes share"
            )
        path = self._ss_output_dir(output_dir)
        weights = [self.get_state_dict(model, unwrap=False) for model in self._models]
        hidden, commit = self._ss_assemble(path)
        lands_here = commit if self.num_processes == 1 else contextlib.nullcontext()

        def write() -> None:
            try:
                with lands_here:
                    write_files(staged, hidden)
            finally:
                self._ss_copy.release()

        try:
            for hook in self._save_model_state_pre_hook.values():
                hook(self._models, weights, hidden)
            staged = self._ss_copy.copy(state_files(self, weights, safe_serialization))
            self._ss_copy.hold()
            try:
                self._ss_writes.start([path], write, self.slipstream_timeout)
            except BaseException:
                self._ss_copy.release()
                raise
        except BaseException as error:
            commit.__exit__(type(error), error, error.__traceback__)
            raise
        self._ss_save = _Save(path, commit)
        self.project_configuration.iteration += 1
        if not self.background_write:
            self.wait_for_checkpoints()
        return Path(path)

    # -- load --------------------------------------------------------------------------------

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """accelerate's ``load_state``, once no save of this process is writing the
        directory; ``load_state()`` under automatic naming loads the newest checkpoint."""
        self.wait_for_checkpoints()
        if self._ss_supported():
            _probe("load_state")
            if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
                input_dir = self._ss_newest()
            if input_dir is not None:
                wait_for_path(os.path.expanduser(input_dir), self.slipstream_timeout)
        super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def _ss_newest(self) -> str:
        root = os.path.join(self.project_dir, "checkpoints")
        self._ss_sweep(root)
        folders = _checkpoint_folders(root) if os.path.isdir(root) else []
        if not folders:
            raise CheckpointError(f"load_state: no checkpoint in {root}")
        return folders[-1]
