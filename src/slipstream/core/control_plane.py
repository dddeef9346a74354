"""The control plane: small messages between ranks through a ``torch.distributed`` store.

Checkpoint coordination, the sync group and the shared-memory handshake all wait for keys
that other ranks write. They wait here:

- **Keys** are built by :func:`store_key` from their parts, never written inline.
- **Polling** (:func:`wait_for_keys`, the sync group's): a store client runs one request
  at a time, so a thread blocked in the store's ``wait`` would hold up every other thread
  using that client; it polls ``check`` with a pause that starts short and doubles up to a
  cap (a key that comes at once is seen within a millisecond).
- **Blocking on a client of its own** (:mod:`.store_watch`, checkpoints'): one request
  however long the wait, and no other thread held up.
- **A deadline, and liveness.** A wait ends at its deadline, and earlier as soon as a rank
  it is still waiting for is found dead: a polling wait asks a :data:`DeadRanks` callable
  (e.g. a :class:`LivenessWatch` over :class:`Heartbeat` counters, which also takes a death
  notice posted by a process that saw the rank's connection drop); a blocking one is ended
  by its process's :class:`~.store_watch.StoreWatch`, which beats, looks at every
  waited-for rank in one request, and posts in a dead rank's place that it died. Either
  way the error is one type, :class:`~slipstream.errors.MissingRanksError` (its subclass
  :class:`~slipstream.errors.PeerDiedError` for the dead), naming the ranks, what was
  awaited and for how long.

Invariant: every wait here ends by its deadline, and its error names every rank that did
not answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch.distributed as dist

from ..errors import MissingRanksError, PeerDiedError
from .waits import Deadline

POLL_FIRST_SECONDS = 0.0005
POLL_MAX_SECONDS = 0.02
LIVENESS_EVERY_SECONDS = 0.25
"""How often a wait asks whether the ranks it still waits for are alive, by default."""

DeadRanks = Callable[[Sequence[int]], dict[int, str]]
"""``dead(ranks)``: those of ``ranks`` found dead, each with why (e.g. "no heartbeat for
3.1 s"); ranks not known dead are left out."""


def store_key(*parts: object) -> str:
    """The store key made of ``parts`` joined by ``/`` (numbers written in decimal)."""
    if not parts:
        raise ValueError("a store key needs at least one part")
    return "/".join(str(p) for p in parts)


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank(s) [1, 3]``."""
    return f"rank(s) {sorted(ranks)}"


def died_error(dead: Mapping[int, str], what: str, waited: float, waiter: str) -> PeerDiedError:
    """The error for ``dead`` (rank: why) found while ``waiter`` waited for ``what``."""
    why = "; ".join(f"rank {r}: {reason}" for r, reason in sorted(dead.items()))
    return PeerDiedError(
        f"{ranks_text(list(dead))} died while {waiter} waited {waited:.1f} s for {what} ({why})",
        list(dead),
        what,
        waited,
    )


def wait_for_keys(
    store: dist.Store,
    keys: Mapping[int, str],
    what: str,
    deadline: Deadline,
    waiter: str,
    dead: DeadRanks | None = None,
    idle: Callable[[], None] | None = None,
    drop_dead: bool = False,
    look_every: float = LIVENESS_EVERY_SECONDS,
) -> dict[int, str]:
    """Wait until every ``keys[rank]`` exists in ``store``: one ``check`` of all of them per
    poll; each key on its own only for the ranks a look found dead and at the deadline.

    ``what`` says what is awaited and ``waiter`` who waits, for the error. Every
    ``look_every`` seconds, ``dead`` (when given) is asked about the ranks still missing (a
    look costs store requests per missing rank: many ranks call for a longer interval).
    One found dead raises :class:`PeerDiedError` at once, or with ``drop_dead`` is no
    longer waited for. ``idle`` runs between polls. Returns the ranks dropped as dead
    (rank: why). Raises :class:`MissingRanksError` naming the missing ranks once
    ``deadline`` expired.
    """
    start = time.monotonic()
    pending = dict(keys)
    dropped: dict[int, str] = {}
    pause = POLL_FIRST_SECONDS
    next_look = start + look_every
    while True:
        if not pending or store.check(list(pending.values())):
            return dropped
        now = time.monotonic()
        looking = dead is not None and now >= next_look
        if deadline.expired():  # which ones are still missing, one by one
            for rank, key in list(pending.items()):
                if store.check([key]):
                    del pending[rank]
            if not pending:
                return dropped
        if dead is not None and looking:
            next_look = now + look_every
            found = dead(sorted(pending))  # of those, the ones that answered before they died:
            found = {r: why for r, why in found.items() if not store.check([pending[r]])}
            if found and not drop_dead:
                raise died_error(found, what, now - start, waiter)
            for rank, why in found.items():
                pending.pop(rank, None)
                dropped[rank] = why
            if not pending:
                return dropped
        if deadline.expired():
            missing = sorted(pending)
            limit = f"{deadline.timeout:.1f} s" if deadline.timeout is not None else "the deadline"
            raise MissingRanksError(
                f"{ranks_text(missing)} did not answer within {limit} while {waiter} "
                f"waited for {what}",
                missing,
                what,
                time.monotonic() - start,  # read after the deadline was found passed
            )
        if idle is not None:
            idle()
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_SECONDS)


def own_client(store: dist.Store) -> dist.Store:
    """A new client of ``store`` (its own connection to a TCP store's server; a prefix
    store keeps its prefix): a request on it never queues behind another client's."""
    client: dist.Store = cast(Any, store).clone()
    return client


class Heartbeat:
    """Adds one to ``key`` in ``store`` every ``interval`` seconds, from a thread it owns,
    until :meth:`close` (which joins it). Use a store client of its own: a beat must never
    queue behind another thread's request."""

    def __init__(self, store: dist.Store, key: str, interval: float) -> None:
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
    """When each peer's heartbeat counter last moved, seen from this process (so hosts'
    clocks need not agree). A rank that never beat is not judged; one that beats again
    (a restarted process on the same key) is alive again.

    With ``notice_of``, a rank is also dead as soon as another process posted a death
    notice for it (:meth:`notice`: it saw the rank's connection drop) and its counter has
    not moved since: a process that is gone is named at once by every watcher, without
    waiting out ``silent_after``; one that beats again voids the notice."""

    def __init__(
        self,
        store: dist.Store,
        key_of: Callable[[int], str],
        silent_after: float,
        notice_of: Callable[[int], str] | None = None,
    ) -> None:
        self._store = store
        self._key_of = key_of
        self._notice_of = notice_of
        self.silent_after = silent_after
        self._seen: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def _count(self, rank: int) -> int | None:
        key = self._key_of(rank)
        if not self._store.check([key]):
            return None
        return int(self._store.get(key))

    def silent(self, ranks: Sequence[int]) -> dict[int, float]:
        """Of ``ranks``, those that beat once but not in the last ``silent_after`` seconds,
        with how long they have been silent."""
        now = time.monotonic()
        quiet = {}
        for rank in ranks:
            count = self._count(rank)
            if count is None:
                continue
            with self._lock:
                last = self._seen.get(rank)
                if last is None or last[0] != count:
                    self._seen[rank] = (count, now)
                elif now - last[1] >= self.silent_after:
                    quiet[rank] = now - last[1]
        return quiet

    def notice(self, rank: int, why: str) -> None:
        """Post that ``rank`` is gone (``why``: what was seen, by whom), for every watcher
        of these counters; void as soon as the rank beats again."""
        if self._notice_of is None:
            return
        count = self._count(rank)
        if count is not None:
            self._store.set(self._notice_of(rank), json.dumps({"count": count, "why": why}))

    def _noticed(self, ranks: Sequence[int]) -> dict[int, str]:
        if self._notice_of is None:
            return {}
        found = {}
        for rank in ranks:
            key = self._notice_of(rank)
            if not self._store.check([key]):
                continue
            notice = json.loads(self._store.get(key))
            if self._count(rank) == notice["count"]:
                found[rank] = str(notice["why"])
        return found

    def dead(self, ranks: Sequence[int]) -> dict[int, str]:
        """:meth:`silent` as a :data:`DeadRanks`, and the ranks a notice names."""
        found = self._noticed(ranks)
        for r, s in self.silent([r for r in ranks if r not in found]).items():
            found[r] = f"no heartbeat for {s:.1f} s"
        return found
