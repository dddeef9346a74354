"""Ending a network transfer's blocked wait when a member vanishes: :class:`Watchdog`.

A gloo send or receive cannot be polled, and a wait on one to a host that vanished (its
link cut, its processes frozen: no connection is ever reset) lasts the whole timeout. So
while a transport's wait is blocked, its watchdog's thread runs a look (the members'
liveness, :func:`..round.negotiation.liveness_watch`) every :data:`LOOK_EVERY` seconds; when
the look raises, the watchdog keeps that error and cuts the transfer (shuts its process
group's connections down), so the blocked wait fails at once and :meth:`Watchdog.failure`
says why.

Invariant: a look runs only while a wait is blocked (an idle transport costs no store
request), the thread belongs to the watchdog and :meth:`Watchdog.close` joins it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: How often a blocked wait's members are looked at, in seconds.
LOOK_EVERY = 0.25

Look = Callable[[], None]
"""``look()``: raises when the transfer cannot finish (a member found dead)."""


class Watchdog:
    """Runs ``look`` while one of its owner's waits is blocked; on its first error runs
    ``cut`` once (see the module doc)."""

    def __init__(self, look: Look, cut: Callable[[], None], name: str) -> None:
        self._look = look
        self._cut = cut
        self._blocked = threading.Event()
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """Mark the caller's wait as blocked for its duration."""
        self._blocked.set()
        try:
            yield
        finally:
            self._blocked.clear()

    def failure(self) -> BaseException | None:
        """The error the look raised (the transfer was cut for it), or ``None``."""
        return self._error

    def _run(self) -> None:
        while not self._closed.is_set() and self._error is None:
            if not self._blocked.wait(LOOK_EVERY):
                continue
            if self._closed.wait(LOOK_EVERY) or not self._blocked.is_set():
                continue
            try:
                self._look()
            except BaseException as exc:
                self._error = exc
                self._cut()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(10 * LOOK_EVERY + 30)
