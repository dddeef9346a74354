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


def all_of(futures: list[Future[None]]) -> Future[None]:
    """A future that resolves once every one of ``futures`` has, failing with the first
    failure among them in list order (a save to several tiers, as one handle)."""
    combined: Future[None] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[None]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
        else:
            combined.set_result(None)

    if not futures:
        combined.set_result(None)
    for fut in futures:
        fut.add_done_callback(one_done)
    return combined


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
