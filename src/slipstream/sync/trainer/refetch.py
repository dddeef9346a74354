"""Serving rollouts that ask again (:mod:`..round.protocol`, refetch) from the host cache.

:class:`RefetchServer`, on the publisher's worker thread, offers the cache's version and,
once the rollout accepts, sends every byte of this rank's buckets over a process group of
just the two of them (over ``cma`` the rollout reads the cache itself). It takes the cache's
lock only to take a hold on the cache's current generation (:meth:`.HostCache.hold`) and
serves from that generation, which stays alive and unchanged, until the rollout
acknowledged or the refetch failed; a publish snapshotting meanwhile writes another buffer.

Invariant: a refetch never fails a publish, nor makes its snapshot wait for the asking
rollout: what goes wrong is the asking rollout's error.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from ...core import tracing
from ...errors import SyncError
from ..group import SyncGroup
from ..round.negotiation import network_sender, separate_min_for, shape_of, unwatched
from ..round.protocol import (
    Ack,
    AgainGo,
    AgainOffer,
    AgainRequest,
    CacheAddress,
    Keys,
    decode,
    encode,
)
from ..round.versions import RolloutVersions
from .host_cache import Generation, HostCache
from .sending import send_cached

logger = logging.getLogger(__name__)

#: How often a ``cached`` publisher's worker looks for rollouts that ask again, in seconds
#: (a look is one store request; a refetch waits at most this long to be noticed).
ASK_AGAIN_POLL = 0.05


class RefetchServer:
    """Serves rollouts that ask again from a :class:`HostCache` (worker thread only)."""

    def __init__(
        self,
        group: SyncGroup,
        cache: HostCache,
        rollout_ranks: Sequence[int],
        kind: str,
        separate_min: int | None | str,
        timeout: float,
        rollout_versions: RolloutVersions,
    ) -> None:
        self.group = group
        self.cache = cache
        self.rank = group.rank
        self.rollout_ranks = list(rollout_ranks)
        # a colocated rollout reads the cache itself; otherwise host weights travel to it
        # point to point (a collective of two costs more per message), device weights by
        # broadcast, as a publish would send them
        if kind == "cma":
            self.kind = "cma"
        else:
            self.kind = "relay" if group.device.type == "cpu" else "broadcast"
        self.separate_min = separate_min
        self.timeout = timeout
        self.rollout_versions = rollout_versions
        self._served = 0
        """Tickets served (or passed over) so far: every trainer serves them in one order."""
        self._waiting: tuple[int, float] | None = None
        """The ticket whose request this server has been waiting for, and since when."""
        self._looked = 0.0

    def set_rollouts(self, rollout_ranks: Sequence[int]) -> None:
        """Serve ``rollout_ranks`` from now on (the list is replaced whole, so the worker
        reads one or the other)."""
        self.rollout_ranks = list(rollout_ranks)

    def poll(self) -> None:
        """Serve every refetch asked since the last look (at most every
        :data:`ASK_AGAIN_POLL` seconds), in ticket order. A request that cannot be served is
        answered with the reason; a failure while serving one is the asking rollout's error
        (it times out or sees a broken transfer), logged here, and never fails a publish.

        Every trainer serving the same order is what keeps two rollouts refetching at once
        from waiting on each other (each trainer holding an offer for one while the other
        waits for its offer). A ticket's request that is not there yet (it is posted just
        after the ticket is taken), or that comes from a rank not yet among this trainer's
        rollouts, is looked for again at the next poll, for up to the timeout; then it is
        passed over (answered, where the rank is known), and the later tickets served."""
        now = time.monotonic()
        if now - self._looked < ASK_AGAIN_POLL:
            return
        self._looked = now
        try:
            count = self.group.count(Keys.ASK_AGAIN_COUNT)
            while self._served < count:
                request = self._request(self._served + 1)
                if request is None:
                    return
                self._served += 1
                try:
                    self._serve(request)
                except (SyncError, RuntimeError) as exc:
                    logger.warning(
                        "trainer rank %d could not serve rollout rank %d's refetch: %s",
                        self.rank,
                        request.rollout,
                        exc,
                    )
        except (SyncError, RuntimeError) as exc:
            logger.warning("trainer rank %d could not look for refetches: %s", self.rank, exc)

    def _request(self, ticket: int) -> AgainRequest | None:
        """The request holding ``ticket`` if it can be served now; ``None`` to look again
        later. Past the timeout, a request still missing is passed over and one from a rank
        that is not a rollout here is answered with why."""
        now = time.monotonic()
        if self._waiting is None or self._waiting[0] != ticket:
            self._waiting = (ticket, now)
        overdue = now - self._waiting[1] > self.timeout
        key = Keys.again_ticket(ticket)
        if not self.group.has(key):
            if overdue:
                logger.warning(
                    "trainer rank %d passed over refetch ticket %d: no request came for it "
                    "within %s s",
                    self.rank,
                    ticket,
                    self.timeout,
                )
                self._served += 1
            return None
        request = decode(AgainRequest, self.group.read(key))
        if request.rollout in self.rollout_ranks:
            return request
        if overdue:
            why = f"rank {request.rollout} is not among trainer rank {self.rank}'s rollouts"
            offer_key = Keys.again_offer(request.rollout, request.n, self.rank)
            self.group.post(offer_key, encode(AgainOffer(error=why)))
            self._served += 1
        return None

    @tracing.spanned("slipstream.sync.refetch.serve")
    def _serve(self, request: AgainRequest) -> None:
        """Answer ``request`` with this rank's offer and, once the rollout accepts, send
        every byte of this rank's buckets from the cache (over ``cma`` the rollout reads
        them itself). The generation offered is held until the rollout acknowledged."""
        r, n = request.rollout, request.n
        offer_key = Keys.again_offer(r, n, self.rank)
        if not self.cache.lock.acquire(blocking=False):
            why = f"trainer rank {self.rank} is snapshotting a newer version; receive() it"
            self.group.post(offer_key, encode(AgainOffer(error=why)))
            return
        try:
            held = self.cache.hold()
        finally:
            self.cache.lock.release()
        if held is None:
            why = f"trainer rank {self.rank} holds no complete version yet"
            self.group.post(offer_key, encode(AgainOffer(error=why)))
            return
        try:
            ack = self._send(request, held)
        finally:
            self.cache.release(held)
        if ack is None:
            return
        self.rollout_versions.record(r, ack.holds)  # not if r was dropped meanwhile
        logger.info(
            "trainer rank %d served version %s again to rollout rank %d from its cache",
            self.rank,
            held.version,
            r,
        )

    def _send(self, request: AgainRequest, held: Generation) -> Ack | None:
        """Offer ``held`` to ``request``'s rollout and, once it accepts, send it; return the
        rollout's acknowledgement (``None``: it declined)."""
        r, n = request.rollout, request.n
        offer = cache_offer(held, self.kind, self.separate_min)
        self.group.post(Keys.again_offer(r, n, self.rank), encode(offer))
        what = f"rollout rank {r} to accept version {offer.version}"
        go = decode(AgainGo, self.group.get_text(Keys.again_go(r, n), r, what, self.timeout))
        if not go.go:
            return None
        assert offer.shape is not None
        if self.kind != "cma":
            tag = f"again-i{request.incarnation}"
            sender = network_sender(
                self.group, [r], offer.shape, self.kind == "relay", tag, self.timeout, unwatched
            )
            try:
                send_cached(held, sender, self.group.device)
                sender.flush()
            except BaseException:  # the pair's group is spent: build anew next time
                sender.close()
                self.group.drop_subgroup([self.rank, r], tag, broken=True)
                raise
            sender.close()
        what = f"rollout rank {r} to acknowledge a refetch"
        return decode(Ack, self.group.get_text(Keys.again_ack(r, n), r, what, self.timeout))


#: Buffers per side of a refetch's transfer (allocated for its duration).
REFETCH_SLOTS = 2


def cache_offer(held: Generation, kind: str, separate_min: int | None | str) -> AgainOffer:
    """The offer of ``held`` (a complete version) over ``kind``: its version and plan, and
    over ``cma`` where the rollout reads it."""
    assert held.version is not None
    plan = held.plan
    shape = shape_of(plan.bucket_bytes, REFETCH_SLOTS, separate_min_for(kind, separate_min))
    offer = AgainOffer(held.version, plan.plan_id, kind, shape)
    if kind == "cma":
        offsets = {str(g): off for g, off in held.offsets.items()}
        offer.cache = CacheAddress(os.getpid(), held.buffer.data_ptr(), offsets)
    return offer
