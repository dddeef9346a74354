"""Ending a network transfer's blocked wait when a member vanishes: :class:`Watchdog`.

A gloo send or receive cannot be polled, and a wait on one to a host that vanished (its
link cut, its processes frozen: no connection is ever reset) lasts the whole timeout. So
while a transport's wait is blocked, its watchdog's thread runs a look (the members'
liveness, :func:`..round.negotiation.liveness_watch`) every :data:`LOOK_EVERY` seconds; when
the look raises, the watchdog keeps that error and cuts the transfer (shuts its process
group's connections down), so the blocked wait fails at once and :meth:`Watchdog.failure`
says why.

A wait that even a cut may not end (gloo leaves a send to a peer that already closed its
connection pending until the timeout) runs apart (:meth:`Watchdog.wait_apart`): on the
watchdog's waiter thread, the caller looking meanwhile and leaving as soon as a look raises;
a waiter left blocked then ends at the wait's own timeout, and the process joins it at exit
(:data:`~slipstream.core.strays.STRAYS`).

Invariant: a look runs only while a wait is blocked (an idle transport costs no store
request), the thread belongs to the watchdog and :meth:`Watchdog.close` joins it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...core.strays import STRAYS

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
        self._waiter: _Waiter | None = None
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

    def wait_apart(self, wait: Callable[[], None], timeout: float) -> None:
        """Run ``wait`` (one blocking wait of at most ``timeout`` seconds) on the
        watchdog's waiter thread; return when it does (raising what it raised), or raise the
        look's error as soon as a look (every :data:`LOOK_EVERY` seconds, on the caller's
        thread) raises, after cutting the transfer. A waiter left blocked joins
        :data:`STRAYS` and ends at the wait's own timeout."""
        if self._waiter is None:
            self._waiter = _Waiter(f"{self._thread.name}-waiter")
        done, raised = self._waiter.submit(wait)
        while not done.wait(LOOK_EVERY):
            try:
                self._look()
            except BaseException as exc:
                self._error = exc
                self._cut()
                self._waiter.stop()
                STRAYS.add(self._waiter.thread, timeout)
                self._waiter = None
                raise
        if raised:
            raise raised[0]

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
        self._blocked.set()  # wakes the thread at once
        self._thread.join(10 * LOOK_EVERY + 30)
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter.thread.join(10 * LOOK_EVERY + 30)
            self._waiter = None


_Job = tuple[Callable[[], None], threading.Event, list[BaseException]]
"""A wait handed to a :class:`_Waiter`, the event it sets when done and what it raised."""


class _Waiter:
    """One thread that runs the waits handed to it, in order, until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, wait: Callable[[], None]) -> tuple[threading.Event, list[BaseException]]:
        """Queue ``wait``; the event is set once it ran, the list then holds what it raised."""
        done, raised = threading.Event(), list[BaseException]()
        self._jobs.put((wait, done, raised))
        return done, raised

    def stop(self) -> None:
        """End the thread once the waits queued before have run."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            wait, done, raised = job
            try:
                wait()
            except BaseException as exc:
                raised.append(exc)
            finally:
                done.set()
