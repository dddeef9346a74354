"""What each rollout holds, as the trainer last heard it: :class:`RolloutVersions`.

Three threads write it: the caller's (:meth:`..publisher.WeightPublisher.set_rollouts`
changes who is a rollout), the publisher's worker (a round's acknowledgements, the ranks a
round left out) and the refetch server on that worker (a refetch's acknowledgement).

Invariant: only the current rollout ranks have an entry; a version heard from a rank that
was dropped meanwhile (a refetch that ends after :meth:`RolloutVersions.set_members`) is not
recorded, so a dropped rank never comes back but through ``set_members``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class RolloutVersions:
    """Rollout rank -> the version it holds completely (``None``: none), under one lock."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int | None] = dict.fromkeys(ranks)

    def set_members(self, ranks: Sequence[int]) -> None:
        """The rollouts from now on: a rank added holds nothing yet, a rank kept keeps its
        version, a rank dropped is forgotten."""
        with self._lock:
            self._held = {r: self._held.get(r) for r in ranks}

    def record(self, rank: int, version: int | None) -> None:
        """``rank`` holds ``version``; ignored when ``rank`` is no longer a rollout."""
        with self._lock:
            if rank in self._held:
                self._held[rank] = version

    def snapshot(self) -> dict[int, int | None]:
        """A copy of the table, consistent at one moment."""
        with self._lock:
            return dict(self._held)
