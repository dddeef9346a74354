"""The local tier's gloo group, over which its replicas and recoveries move.

Every rank of a local tier makes one :class:`TierLink` when the tier opens (all together,
on the caller's thread). Its group carries the tier's replicas (on the tier's replication
thread) and its recoveries (on the caller's thread, in a load every rank runs together,
which first waits for every local save in flight): never both at once, and no other code
uses the group. There is no listening socket or handshake of slipstream's own: the
group's connections are torch.distributed's, set up through the job's store.

Invariant: a transfer's wait on a peer ends once that peer is found dead
(:mod:`..peer_transfers`); :meth:`TierLink.close` joins, as far as it can, the waiters a
death left behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch.distributed as dist

from ...core.gloo_groups import new_gloo_group
from ...core.waits import Deadline
from .. import peer_transfers
from ..peer_transfers import Move
from ..save.channel import RankChannel

logger = logging.getLogger(__name__)

ABANDONED_JOIN_SECONDS = 1.0
"""How long :meth:`TierLink.close` waits for each waiter a death left behind."""


class TierLink:
    """The tier's gloo group over the ranks of ``channel`` (none for a single rank, which
    has no peer to move anything to)."""

    def __init__(self, channel: RankChannel, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout
        self.group = (
            new_gloo_group(channel.global_ranks, timeout, "slipstream_local_tier")
            if channel.world_size > 1
            else None
        )
        self._lock = threading.Lock()
        self._abandoned: list[threading.Thread] = []

    def move(self, moves: Sequence[Move], deadline: Deadline) -> int:
        """Every move at once, waited for (:func:`..peer_transfers.move`); returns the
        bytes received."""
        if not moves:
            return 0
        assert self.group is not None, "a single rank has no peer to move bytes to"
        with self._lock:  # one batch at a time
            return peer_transfers.move(self.group, self.channel, moves, deadline, self._abandoned)

    def close(self) -> None:
        """Drop the group, then join the waiters a death left behind (one still blocked is
        left to end at the group's timeout, logged)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
        for waiter in self._abandoned:
            waiter.join(ABANDONED_JOIN_SECONDS)
            if waiter.is_alive():
                logger.info(
                    "rank %d: a local-tier transfer to a dead peer ends at the group's "
                    "timeout (%.0f s)", self.channel.rank, self.timeout,
                )  # fmt: skip
