"""A training run's checkpoints: one directory per step, retention, latest, resume.

Invariants: a step is listed by :meth:`Checkpointer.steps` only once committed (its
``.metadata`` exists), so :meth:`latest` never names a checkpoint that was cut short;
old steps are deleted only after a newer one has committed; directories of saves that
never committed are removed by the next save (never while a save into them may be
running). With ``reuse_files`` the data files of a deleted step are kept aside, under
invariants of their own (see :mod:`.recycle`), for the next save to write over, and
:meth:`Checkpointer.close` deletes what is left of them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError
from . import loader
from .commit import METADATA_FILE, uncommit
from .recycle import SPARE_DIR, discard_spares, retire
from .saver import AsyncSaveResponse, CheckpointSaver, SaveOptions

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")


class Checkpointer:
    """Asynchronous, atomic, retained checkpoints of a training run under ``root``."""

    def __init__(
        self,
        root: str | os.PathLike,
        keep_last: int | None = 3,
        process_group: dist.ProcessGroup | None = None,
        timeout: float = 600.0,
        options: SaveOptions | None = None,
        reuse_files: bool = True,
    ) -> None:
        """``reuse_files``: the next save writes over the data files of the step retention
        deletes, where nothing else has them open, instead of freeing their blocks and
        allocating new ones (on the development host the writes then took 0.7 - 1.2
        core-s per GiB from busy cores instead of 1.4 - 1.9; see docs/checkpoint.md).
        Between saves one step's data files more stay on disk, in ``root/.spare``, until
        :meth:`close`."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        opts = dataclasses.replace(options or SaveOptions(), timeout=timeout)
        self._saver = CheckpointSaver(process_group, opts)
        self._spare_dir = self.root / SPARE_DIR if reuse_files else None
        self._last: AsyncSaveResponse | None = None

    def path(self, step: int) -> Path:
        return self.root / f"step_{int(step)}"

    def _step_dirs(self) -> dict[int, Path]:
        found = {}
        for entry in os.scandir(self.root):
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = Path(entry.path)
        return found

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(s for s, p in self._step_dirs().items() if (p / METADATA_FILE).is_file())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: dict[str, Any]) -> AsyncSaveResponse:
        """Start saving ``state_dict`` as ``step``; see :func:`slipstream.async_save`."""
        self._saver.wait_previous()
        if self._saver.rank == 0:
            self._remove_uncommitted(except_step=step)
        retain = self._retain if self._saver.rank == 0 else None
        response = self._saver.save(
            state_dict, self.path(step), after_commit=retain, spare_dir=self._spare_dir
        )
        self._last = response
        return response

    def _remove_uncommitted(self, except_step: int) -> None:
        for step, path in self._step_dirs().items():
            if step != except_step and not (path / METADATA_FILE).is_file():
                shutil.rmtree(path, ignore_errors=True)

    def _retain(self) -> None:
        """Delete committed steps older than the last ``keep_last`` (runs after a commit).

        Each step is uncommitted first (its ``.metadata`` removed), so a deletion cut short
        leaves a directory that is no longer listed and that the next save cleans up.
        """
        if self.keep_last is None:
            return
        for step in self.steps()[: -self.keep_last]:
            try:
                uncommit(str(self.path(step)))
                if self._spare_dir is None:
                    shutil.rmtree(self.path(step))
                else:
                    retire(self.path(step), self._spare_dir)
            except OSError as exc:
                logger.warning("could not delete old checkpoint %s: %s", self.path(step), exc)

    def load(
        self, state_dict: dict[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int:
        """Load ``step`` (default: the latest committed one) into ``state_dict``; return it."""
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"no committed checkpoint under {self.root}")
        loader.load(state_dict, self.path(step), strict=strict)
        return step

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last save is committed; raise its error if it failed."""
        if self._last is not None:
            self._last.upload_completion.result(timeout)

    def close(self) -> None:
        """Wait for the save in flight and join the threads; errors were already reported.
        Rank 0 then deletes the spare data files."""
        self._saver.close()
        if self._spare_dir is not None and self._saver.rank == 0:
            discard_spares(self._spare_dir)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
