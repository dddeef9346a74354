"""Work a caller gave up waiting for, left to end on a thread of its own: :data:`STRAYS`.

Two things here may block for as long as a process group's timeout and cannot be cut
short: a gloo wait on a peer that vanished, and a gloo process group's destructor (it runs
every operation still queued on it, each until it fails or times out). A caller that has
already decided the transfer is lost must not pay for either, so it leaves the wait, or the
last reference to the group (:func:`release_apart`), to a thread that ends by itself within
that timeout.

Invariant: every such thread is recorded with how long it may still run, and the process
joins each at exit for at most that long; nothing is destroyed on the caller's thread once
it has been handed over.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any


class Strays:
    """Threads left running by a caller that gave up on them; each ends within its own
    timeout, and the process joins them at exit (each for as long as it may still run)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, float]] = []
        atexit.register(self.join)

    def add(self, thread: threading.Thread, timeout: float) -> None:
        with self._lock:
            self._threads = [(t, s) for t, s in self._threads if t.is_alive()]
            self._threads.append((thread, timeout))

    def join(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for thread, timeout in threads:
            thread.join(timeout)


STRAYS = Strays()


def release_apart(box: list[Any], timeout: float, name: str) -> None:
    """Drop what ``box`` holds on a thread of its own (joined through :data:`STRAYS`), so
    a destructor that blocks (for up to ``timeout`` seconds) never blocks the caller. The
    caller hands over its only reference inside ``box`` and keeps none."""
    thread = threading.Thread(target=box.clear, name=name, daemon=True)
    thread.start()
    STRAYS.add(thread, timeout)
