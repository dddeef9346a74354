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

from collections.abc import Callable

import torch.distributed as dist

from ..core import control_plane as core_heartbeat

BEAT_SECONDS = 1.0
SILENT_AFTER_SECONDS = 6.0
"""Silence that marks a rank dead: six missed beats, so a rank is noticed within
:data:`SILENT_AFTER_SECONDS` plus one check (under ten seconds)."""


class Heartbeat(core_heartbeat.Heartbeat):
    """Adds one to ``key`` in ``store`` every ``interval`` seconds until :meth:`close`."""

    def __init__(self, store: dist.Store, key: str, interval: float = BEAT_SECONDS) -> None:
        super().__init__(store, key, interval)


class LivenessWatch(core_heartbeat.LivenessWatch):
    """When each peer's heartbeat counter last moved, seen from this process."""

    def __init__(
        self,
        store: dist.Store,
        key_of: Callable[[int], str],
        silent_after: float = SILENT_AFTER_SECONDS,
    ) -> None:
        super().__init__(store, key_of, silent_after)
