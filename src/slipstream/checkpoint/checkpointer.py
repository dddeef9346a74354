"""A training run's checkpoints: one location per step, retention, latest, resume.

Works the same on every storage backend (a directory, an object store prefix).

Invariants: a step is listed by :meth:`Checkpointer.steps` only once committed (its
``.metadata`` exists), so :meth:`latest` never names a checkpoint that was cut short;
old steps are deleted only after a newer one has committed; steps that never committed,
and multipart uploads cut short, are removed by the next save (never while a save into
them may be running). With ``reuse_files`` on the local disk the data files of a deleted
step are kept aside, under invariants of their own (see :mod:`.recycle`), for the next
save to write over, and :meth:`Checkpointer.close` deletes what is left of them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError, SlipstreamError
from . import loader
from .commit import METADATA_FILE, uncommit
from .recycle import SPARE_DIR
from .saver import AsyncSaveResponse, CheckpointSaver, SaveOptions
from .storage import Location, Storage, resolve_storage

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")


class Checkpointer:
    """Asynchronous, atomic, retained checkpoints of a training run under ``root``."""

    def __init__(
        self,
        root: Location,
        keep_last: int | None = 3,
        process_group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        options: SaveOptions | None = None,
        reuse_files: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        """``root`` is a directory, an object store URL (``s3://bucket/run``, ``memory://``)
        or a :class:`~slipstream.checkpoint.storage.Storage`; ``storage_options`` configure
        an object store's client (see docs/storage.md).

        ``reuse_files``: on the local disk, the next save writes over the data files of the
        step retention deletes, where nothing else has them open, instead of freeing their
        blocks and allocating new ones (see docs/checkpoint.md). Between saves one step's
        data files more stay on disk, in ``root/.spare``, until :meth:`close`.

        ``timeout``, when given, overrides ``options.timeout``; every default is
        :class:`SaveOptions`'s."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.keep_last = keep_last
        opts = dataclasses.replace(options or SaveOptions())
        if timeout is not None:
            opts.timeout = timeout
        self.storage: Storage = resolve_storage(
            root,
            storage_options,
            spare_dir_name=SPARE_DIR if reuse_files else None,
            direct_io=opts.direct_io,
        )
        self.root = self.storage.url
        self.storage.prepare()
        self._saver = CheckpointSaver(process_group, opts)
        self._last: AsyncSaveResponse | None = None

    def path(self, step: int) -> str:
        """Where ``step`` is saved (a path or URL)."""
        return self._step(step).url

    def _step(self, step: int) -> Storage:
        return self.storage.child(f"step_{int(step)}")

    def _step_names(self) -> dict[int, str]:
        found = {}
        for name in self.storage.list_children():
            match = _STEP_DIR.match(name)
            if match:
                found[int(match.group(1))] = name
        return found

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(
            s
            for s, name in self._step_names().items()
            if self.storage.child(name).exists(METADATA_FILE)
        )

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: dict[str, Any]) -> AsyncSaveResponse:
        """Start saving ``state_dict`` as ``step``; see :func:`slipstream.async_save`."""
        self._saver.wait_previous()
        if self._saver.rank == 0:
            self._remove_uncommitted(except_step=step)
        retain = self._retain if self._saver.rank == 0 else None
        response = self._saver.save(state_dict, self._step(step), after_commit=retain)
        self._last = response
        return response

    def _remove_uncommitted(self, except_step: int) -> None:
        """Remove steps that never committed, and unfinished uploads, except ``except_step``
        (the save about to start). Cleaning up is best effort: a failure is logged, and the
        save goes on."""
        try:
            for step, name in self._step_names().items():
                location = self.storage.child(name)
                if step != except_step and not location.exists(METADATA_FILE):
                    location.delete_all()
            self.storage.cleanup_incomplete(keep=f"step_{int(except_step)}")
        except (OSError, SlipstreamError) as exc:
            logger.warning("could not clean up uncommitted saves under %s: %s", self.root, exc)

    def _retain(self) -> None:
        """Delete committed steps older than the last ``keep_last`` (runs after a commit).

        Each step is uncommitted first (its ``.metadata`` removed), so a deletion cut short
        leaves a location that is no longer listed and that the next save cleans up.
        """
        if self.keep_last is None:
            return
        for step in self.steps()[: -self.keep_last]:
            location = self._step(step)
            try:
                uncommit(location)
                location.delete_all()
            except (OSError, SlipstreamError) as exc:
                logger.warning("could not delete old checkpoint %s: %s", location.url, exc)

    def load(
        self, state_dict: dict[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int:
        """Load ``step`` (default: the latest committed one) into ``state_dict``; return it."""
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"no committed checkpoint under {self.root}")
        loader.load(state_dict, self._step(step), strict=strict)
        return step

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last save is committed; raise its error if it failed."""
        if self._last is not None:
            self._last.upload_completion.result(timeout)

    def close(self) -> None:
        """Wait for the save in flight and join the threads; errors were already reported.
        Rank 0 then deletes the spare data files."""
        self._saver.close()
        if self._saver.rank == 0:
            self.storage.discard_spares()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
