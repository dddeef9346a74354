"""Writes that run on a thread of their own, one thread per write, joined by their owner.

:class:`BackgroundWrites` starts each write on a new non-daemon thread that ends with it, so
no thread outlives its work and a process that exits normally finishes its writes first
(Python joins non-daemon threads at exit; so does ``multiprocessing``'s child). The paths
each write produces are registered process-wide while it runs: :func:`wait_for_path` lets
any reader in the process (another plugin instance, a new ``Trainer``) wait for a file
still being written instead of reading the previous one or none.

Invariants: :meth:`BackgroundWrites.wait` returns only once every write it started has
ended and its thread is joined, and raises the first failure, naming its paths; a path is
unregistered only after its write ended.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass

from ...core.threads import lower_thread_priority
from ...errors import CheckpointError

log = logging.getLogger(__name__)

_in_flight: dict[str, Future[None]] = {}
_in_flight_lock = threading.Lock()


def _key(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def wait_for_path(path: str | os.PathLike[str], timeout: float | None) -> None:
    """Wait until no write in this process is producing ``path``; raise its failure."""
    with _in_flight_lock:
        done = _in_flight.get(_key(path))
    if done is None:
        return
    try:
        done.result(timeout)
    except FutureTimeoutError:
        raise CheckpointError(f"{path} was still being written after {timeout:g} s") from None


def _forget(keys: list[str], done: Future[None]) -> None:
    for key in keys:
        if _in_flight.get(key) is done:
            del _in_flight[key]


@dataclass
class _Write:
    paths: list[str]
    thread: threading.Thread
    done: Future[None]


class BackgroundWrites:
    """The background writes of one owner (a plugin, a trainer), each on its own thread."""

    def __init__(self, nice: int = 0) -> None:
        self.nice = nice
        """Nice levels each write's thread lowers itself by (it gives way to training)."""
        self._writes: list[_Write] = []

    def start(
        self,
        paths: Sequence[str | os.PathLike[str]],
        write: Callable[[], None],
        timeout: float | None,
    ) -> Future[None]:
        """Run ``write`` (which produces ``paths``) on a new thread; return its future.
        A write over one in flight waits (up to ``timeout``) for it first, so it lands
        after it."""
        keys = [_key(p) for p in paths]
        for key in keys:
            wait_for_path(key, timeout)
        name = f"slipstream-write-{os.path.basename(keys[0].rstrip('/')) if keys else 'files'}"
        done: Future[None] = Future()
        thread = threading.Thread(target=self._run, args=(keys, done, write), name=name)
        job = _Write(keys, thread, done)
        with _in_flight_lock:
            for key in keys:
                _in_flight[key] = job.done
        self._writes.append(job)
        job.thread.start()
        return job.done

    def _run(self, keys: list[str], done: Future[None], write: Callable[[], None]) -> None:
        if self.nice:
            lower_thread_priority(self.nice)
        try:
            write()
        except BaseException as error:  # noqa: BLE001 - raised by the owner's wait
            with _in_flight_lock:
                _forget(keys, done)
            done.set_exception(error)
        else:
            with _in_flight_lock:
                _forget(keys, done)
            done.set_result(None)

    @property
    def busy(self) -> bool:
        """Whether a write this owner started is still running."""
        return any(not w.done.done() for w in self._writes)

    def raise_finished_failures(self) -> None:
        """Forget the writes that ended; raise the first one's failure, if any."""
        finished = [w for w in self._writes if w.done.done()]
        self._writes = [w for w in self._writes if not w.done.done()]
        for w in finished:
            w.thread.join()
        for w in finished:
            if w.done.exception() is not None:
                raise _failure(w)

    def wait(self, timeout: float | None) -> None:
        """Wait for every write started; join their threads; raise the first failure."""
        writes, self._writes = self._writes, []
        failures: list[CheckpointError] = []
        for w in writes:
            w.thread.join(timeout)
            if w.thread.is_alive():
                self._writes.append(w)
                failures.append(
                    CheckpointError(
                        f"writing {', '.join(w.paths)} did not finish within {timeout:g} s"
                    )
                )
            elif w.done.exception() is not None:
                failures.append(_failure(w))
        if failures:
            for extra in failures[1:]:
                log.error("a further checkpoint write failed: %s", extra)
            raise failures[0]


def _failure(write: _Write) -> CheckpointError:
    error = write.done.exception()
    failure = CheckpointError(f"writing {', '.join(write.paths)} failed: {error}")
    failure.__cause__ = error
    return failure
