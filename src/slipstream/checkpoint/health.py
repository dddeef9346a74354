"""How a run's checkpointing is doing: what is durable, what failed, how far behind it is.

A :class:`HealthTracker` is told of every save a ``Checkpointer`` starts and of how each
ends (on the saver's upload thread); :meth:`HealthTracker.snapshot` is safe to call from
any thread at any time.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointHealth:
    """A snapshot of a ``Checkpointer``'s saves."""

    last_durable_step: int | None
    """The newest step whose save committed, from this process's view (None: none yet)."""
    last_requested_step: int | None
    """The newest step a save was asked for (started, failed or skipped)."""
    in_flight_step: int | None
    """The step whose save is still running, if any."""
    last_error: str | None
    """The error of the newest failed save (cleared by the next durable one)."""
    failed_saves: int
    """Saves that failed since the last durable one."""
    skipped_saves: int
    """Saves skipped since the last durable one because one was still in flight."""

    @property
    def lag_steps(self) -> int | None:
        """How many steps durability trails the newest request (0: caught up)."""
        if self.last_requested_step is None:
            return None
        if self.last_durable_step is None:
            return None
        return self.last_requested_step - self.last_durable_step

    @property
    def healthy(self) -> bool:
        """No save has failed since the last durable one."""
        return self.failed_saves == 0


class HealthTracker:
    """Keeps a :class:`CheckpointHealth` up to date as saves start and end."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._lock = threading.Lock()
        self._durable: int | None = None
        self._requested: int | None = None
        self._in_flight: int | None = None
        self._error: str | None = None
        self._failed = 0
        self._skipped = 0

    def started(self, step: int, done: Future[None]) -> None:
        """A save of ``step`` started; ``done`` resolves when it is durable or failed."""
        with self._lock:
            self._requested = step
            self._in_flight = step
        done.add_done_callback(lambda fut: self._ended(step, fut))

    def skipped(self, step: int) -> None:
        with self._lock:
            self._requested = step
            self._skipped += 1
        logger.warning(
            "checkpoint of step %d skipped: the save of step %s into %s is still running",
            step,
            self._in_flight,
            self._where,
        )

    def failed_to_start(self, step: int, error: BaseException) -> None:
        with self._lock:
            self._requested = step
        self._record_failure(step, error)

    def _ended(self, step: int, done: Future[None]) -> None:
        error = done.exception()
        with self._lock:
            if self._in_flight == step:
                self._in_flight = None
            if error is None:
                self._durable = step if self._durable is None else max(self._durable, step)
                self._error = None
                self._failed = 0
                self._skipped = 0
                return
        self._record_failure(step, error)

    def _record_failure(self, step: int, error: BaseException) -> None:
        with self._lock:
            self._error = f"step {step}: {error}"
            self._failed += 1
            durable = self._durable
        logger.error(
            "checkpoint of step %d into %s failed (%s); the last durable step is %s and "
            "training goes on: the next save retries",
            step,
            self._where,
            error,
            durable,
        )

    def snapshot(self) -> CheckpointHealth:
        with self._lock:
            return CheckpointHealth(
                last_durable_step=self._durable,
                last_requested_step=self._requested,
                in_flight_step=self._in_flight,
                last_error=self._error,
                failed_saves=self._failed,
                skipped_saves=self._skipped,
            )
