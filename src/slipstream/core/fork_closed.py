"""Sockets a forked child lets go of: :class:`ForkClosedSockets`.

A process that forks without exec (an inference engine starting its workers, a
``multiprocessing`` fork) hands its children every descriptor it has open. When it then
dies, the sockets of its transfer process groups live on in the children, so its peers'
connections do not close, and a peer blocked on one of them (gloo's waits cannot be polled
or cut short) waits out the group's timeout instead of failing at once. The sockets a
process group opened are recorded here when it is built; in a forked child (an
``os.register_at_fork`` hook, installed once) each is pointed at ``/dev/null``, so the
parent's death closes the connection as if it had no children.

Invariant: only a descriptor that still names the very socket recorded (the same inode)
is touched in the child, and it stays open there (on ``/dev/null``), so a descriptor
number the child's own code may still close is never handed to something else.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """This process's open sockets: descriptor -> its link (``socket:[inode]``); empty
    where ``/proc`` is not there."""
    found = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return {}
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue  # closed meanwhile (or the listing's own descriptor)
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


class ForkClosedSockets:
    """Sockets, recorded under a key (a process group), that a forked child lets go of."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: dict[Hashable, dict[int, str]] = {}
        os.register_at_fork(after_in_child=self._in_child)

    def add(self, key: Hashable, sockets: dict[int, str]) -> None:
        """Record ``sockets`` (descriptor -> link, as :func:`open_sockets` gives them)."""
        with self._lock:
            self._sockets[key] = dict(sockets)

    def discard(self, key: Hashable) -> None:
        """Forget the sockets recorded under ``key`` (their process group was let go)."""
        with self._lock:
            self._sockets.pop(key, None)

    def _in_child(self) -> None:
        """In a forked child (its only thread): point each recorded socket that is still
        the one recorded at ``/dev/null``. The lock may have been held by a parent's
        thread that does not exist here, so it is replaced, not taken."""
        self._lock = threading.Lock()
        recorded = [s for group in self._sockets.values() for s in group.items()]
        self._sockets = {}
        if not recorded:
            return
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd, link in recorded:
                try:
                    if os.readlink(f"{_FD_DIR}/{fd}") == link:
                        os.dup2(null, fd)
                except OSError:
                    continue
        finally:
            os.close(null)


#: The sockets of every sync process group of this process.
SYNC_SOCKETS = ForkClosedSockets()
