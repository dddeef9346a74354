"""Whether a vLLM worker holds an update session open, as it tells a trainer that joins.

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


def session_key(rank: int) -> str:
    """Where the worker at ``rank`` of a sync group posts its :class:`Session` on joining."""
    return f"vllm/session/{rank}"
