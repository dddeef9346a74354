"""Two-phase futures and a watermark, the pieces every movement's handles are made of.

A save (``staging_completion`` then ``upload_completion``) and a weight publish
(``staged`` then ``delivered``) are each a pair of plain :class:`concurrent.futures.Future`
objects, so callers compose them with what they already know (``result(timeout)``,
``add_done_callback``, ``wait``).

Invariant: the second phase never resolves successfully before the first has; an error
in the first fails both (:func:`fail_unfinished`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from ..errors import PeerTimeoutError


def fail_unfinished(exc: BaseException, *phases: Future[Any]) -> None:
    """Fail whichever of ``phases`` have not finished yet with ``exc``."""
    for fut in phases:
        if not fut.done():
            fut.set_exception(exc)


def completed_future() -> Future[None]:
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


class Watermark:
    """A byte count that only grows, with waits for it to pass a mark (producer/consumer).

    The producer calls :meth:`advance` as it fills a buffer front to back, or :meth:`fail`;
    consumers call :meth:`wait_for` to start on a prefix as soon as it is ready.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._level = -1
        self._error: BaseException | None = None
        self._awaited: list[int] = []

    def advance(self, level: int) -> None:
        """Raise the level; wakes only consumers whose mark it passes (a producer advancing
        after every small piece would otherwise wake every waiting thread each time)."""
        with self._cv:
            self._level = max(self._level, level)
            if any(mark <= self._level for mark in self._awaited):
                self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    def wait_for(self, level: int, timeout: float | None, what: str) -> None:
        """Block until the watermark reaches ``level``; re-raise the producer's failure."""
        with self._cv:
            self._awaited.append(level)
            try:
                reached = self._cv.wait_for(
                    lambda: self._level >= level or self._error is not None, timeout
                )
            finally:
                self._awaited.remove(level)
            if self._error is not None:
                raise self._error
            if not reached:
                raise PeerTimeoutError(f"timed out after {timeout} s waiting for {what}")
