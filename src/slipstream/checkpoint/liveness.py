"""Liveness of the ranks of a save: heartbeats through the job's key-value store.

Every :class:`~.saver.CheckpointSaver` of more than one rank beats: a thread it owns adds
one to its rank's counter in the store every :data:`BEAT_SECONDS`. A rank waiting on others
reads the counters of those it is waiting for; one that has not moved for
:data:`SILENT_AFTER_SECONDS` (as seen on the waiting rank's own clock, so hosts' clocks
need not agree) belongs to a process that died or stopped (SIGKILL, SIGSTOP, a lost host),
and the wait fails at once naming it, instead of running on until its timeout. A rank
that has never beaten (its saver not made yet) gets the whole timeout.

The beat runs at the caller's priority, not the saver's lowered one: a rank whose cores
are all busy training still beats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

BEAT_SECONDS = 1.0
SILENT_AFTER_SECONDS = 6.0
"""Silence that marks a rank dead: six missed beats, so a rank is noticed within
:data:`SILENT_AFTER_SECONDS` plus one check (under ten seconds)."""


class Heartbeat:
    """Adds one to ``key`` in ``store`` every ``BEAT_SECONDS`` until :meth:`close`."""

    def __init__(self, store: dist.Store, key: str, interval: float = BEAT_SECONDS) -> None:
        self._store = store
        self._key = key
        self._interval = interval
        self._stop = threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._run, name="slipstream-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store's host is gone: waits on it fail on their own
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10 * self._interval)


class LivenessWatch:
    """When each peer's heartbeat counter last moved, seen from this process."""

    def __init__(
        self,
        store: dist.Store,
        key_of: Callable[[int], str],
        silent_after: float = SILENT_AFTER_SECONDS,
    ) -> None:
        self._store = store
        self._key_of = key_of
        self.silent_after = silent_after
        self._seen: dict[int, tuple[int, float]] = {}

    def silent(self, ranks: list[int]) -> dict[int, float]:
        """Of ``ranks``, those that beat once but not in the last ``silent_after`` seconds,
        with how long they have been silent."""
        now = time.monotonic()
        quiet = {}
        for rank in ranks:
            key = self._key_of(rank)
            if not self._store.check([key]):
                continue
            count = int(self._store.get(key))
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now)
            elif now - last[1] >= self.silent_after:
                quiet[rank] = now - last[1]
        return quiet
