"""Waiting with a deadline, and an error that says who did not answer."""

from __future__ import annotations

import concurrent.futures
import time
from typing import TypeVar

from ..errors import PeerTimeoutError

_T = TypeVar("_T")


def wait_future(fut: concurrent.futures.Future[_T], timeout: float | None, who: str) -> _T:
    """``fut.result(timeout)``, raising :class:`PeerTimeoutError` naming ``who`` on expiry."""
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise PeerTimeoutError(f"timed out after {timeout:.1f} s waiting for {who}") from None


class Deadline:
    """A point in time shared by several waits, so their sum respects one timeout."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    def expired(self) -> bool:
        return self._end is not None and time.monotonic() >= self._end

    def remaining(self) -> float | None:
        """Seconds left (never below zero), or ``None`` for no deadline."""
        return None if self._end is None else max(self._end - time.monotonic(), 0.0)
