"""What a vLLM worker and its trainer tell each other through the sync group's store,
beside vLLM's own calls: the worker's :class:`Session` as it joins, its :class:`Holding` as
it joins and whenever it changes, and the version the trainer publishes now.

Kept apart from :mod:`.engine` (the worker's end, which imports vLLM) so that the trainer's
end reads it where vLLM is not installed.
"""

from __future__ import annotations

import enum


class Session(enum.Enum):
    """Whether vLLM holds this worker's update session open: the worker tells a trainer
    that joins (at :func:`session_key`), so it closes one a dead trainer left open with
    ``finish_weight_update`` (never by a call vLLM would refuse: a refused collective call
    of a tensor-parallel engine leaves the other workers' answers unread, and the next
    call reads them)."""

    OPEN = "open"
    CLOSED = "closed"


class Holding(enum.Enum):
    """Whether this worker's model holds one complete version (COMPLETE), or a load that
    failed part-way and could not be undone left it a mix of two (NONE) until a version
    lands whole. A trainer keeps generation paused on an engine any of whose workers holds
    NONE."""

    COMPLETE = "complete"
    NONE = "none"


def session_key(rank: int) -> str:
    """Where the worker at ``rank`` of a sync group posts its :class:`Session` on joining."""
    return f"vllm/session/{rank}"


def holding_key(rank: int) -> str:
    """Where the worker at ``rank`` posts its :class:`Holding` on joining and on a change."""
    return f"vllm/holding/{rank}"


#: Where the trainer posts the version it publishes, before any engine call for it: an
#: ``update_weights`` for another version (a call that outlived its timeout) is refused
#: by the worker before it joins any round.
PUBLISHING_KEY = "vllm/publishing"
