"""Blocking waits and liveness for many ranks on one store: one request per wait, one
thread and one read per look per process.

A rank of a large job must not ask its store for more the more ranks there are. Here a wait
is one blocking ``store.wait`` (:func:`block_until`) on a client lent to the waiting thread
for that wait (:class:`WaitingClients`, opened ahead of any wait; a wait that finds none
free polls one ``check`` of all its keys instead), and a process's liveness is one thread with one
client per store (:class:`StoreWatch`): it beats, and while waits are open, reads in one
request the counters of every rank they wait for and the job's log of deaths, posting in a
dead rank's place that it died, which ends every wait on it on every rank.

Invariant: a process makes one beat per rank it runs per beat interval and one read per
look while it waits, whatever its number of channels and waits; a wait makes two requests
(the wait, the read of what it waited for), however long it lasts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

from .control_plane import POLL_FIRST_SECONDS, POLL_MAX_SECONDS, own_client

logger = logging.getLogger(__name__)

STALL_SECONDS = 1.0
"""A liveness thread that runs this much later than it meant to saw its host stand still
(an overloaded or frozen machine): the peers' silence meanwhile is not counted."""
NEVER_SECONDS = 365 * 24 * 3600.0
"""How long a wait without a deadline blocks: a year, for ``store.wait``'s timeout."""


def block_until(client: dist.Store, keys: Sequence[str], seconds: float) -> bool:
    """Block in ``client``'s ``wait`` until every key of ``keys`` exists (``True``), at most
    ``seconds`` (``False``). One request, however long: use a client no other thread needs
    meanwhile (:class:`WaitingClients`)."""
    try:
        client.wait(list(keys), timedelta(seconds=max(seconds, 0.001)))
    except dist.DistStoreError as exc:
        if "timeout" in str(exc).lower():
            return False
        raise
    return True


def poll_until(client: dist.Store, keys: Sequence[str], seconds: float) -> bool:
    """Poll ``client`` until every key of ``keys`` exists (``True``), at most ``seconds``
    (``False``): one ``check`` of all of them per pass, the pauses doubling to
    :data:`POLL_MAX_SECONDS`. For a wait that finds no client of its own free: it shares
    ``client`` with other threads without holding them up."""
    end = time.monotonic() + max(seconds, 0.0)
    pause = POLL_FIRST_SECONDS
    while not client.check(list(keys)):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, POLL_MAX_SECONDS)
    return True


class WaitingClients:
    """Clients of one store for blocking waits, lent to one waiting thread at a time
    (:meth:`lend`), so that a thread blocked on one holds up no other thread. They are
    opened by :meth:`prime`, when a channel is made, never inside a wait: a store's server
    may stall seconds while it accepts a connection, which a wait's deadline must not
    absorb. A wait that finds none free gets ``None`` and polls (:func:`poll_until`). A
    store that cannot be cloned (an in-process store) is its own client, lent to every
    wait."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._free: list[dist.Store] = []
        self._opened = 0
        self._shared = False
        self._lock = threading.Lock()

    def prime(self, count: int = 1) -> None:
        """Open clients until this pool has made ``count`` of them."""
        while True:
            with self._lock:
                if self._shared or self._opened >= count:
                    return
                self._opened += 1
            try:
                client = own_client(self.store)
            except (RuntimeError, NotImplementedError):
                with self._lock:
                    self._shared = True
                return
            with self._lock:
                self._free.append(client)

    def give(self, client: dist.Store) -> None:
        """Add ``client`` to those lent, as one opened (a client no other thread uses while
        it is lent)."""
        with self._lock:
            self._free.append(client)
            self._opened += 1

    @contextlib.contextmanager
    def lend(self) -> Iterator[dist.Store | None]:
        with self._lock:
            shared = self._shared
            if shared:
                client: dist.Store | None = self.store
            else:
                client = self._free.pop() if self._free else None
        try:
            yield client
        finally:
            if client is not None and not shared:
                with self._lock:
                    self._free.append(client)


@dataclass
class Watched:
    """A wait this process has open: the ranks (global) it waits for, each with the key
    its answer goes to, and the text that a rank found dead gets posted there in its place
    (``mark(rank, why)``). ``wake``: the text for the keys of the other ranks still
    missing, so that a wait for all of them ends at once too (``None``: leave them)."""

    keys: dict[int, str]
    mark: Callable[[int, str], str]
    wake: str | None = None


class StoreWatch:
    """This process's one thread and one client of a store for liveness: it beats the
    counters of the ranks this process runs (:meth:`beat`, one ``add`` each every
    ``beat_every`` seconds) and, while waits are open (:meth:`watch`), reads every
    ``look_every`` seconds, in one request, the counters of the ranks they wait for and the
    job's log of deaths (:meth:`notice`). A rank found dead (silent for ``silent_after``
    seconds on this process's clock, or noticed and not beating since) has its answer
    posted for it, write-once (``compare_set``): the wait blocked on that key ends, and so
    does every other process's wait on it, all reading the same word. A rank that never
    beat is not judged; one that beats again is alive again.

    Invariant: whatever the number of channels and waits, a process makes one beat per
    rank it runs per ``beat_every`` and one read per ``look_every`` while it waits."""

    def __init__(
        self,
        store: dist.Store,
        alive_key: Callable[[int], str],
        deaths_key: str,
        beat_every: float,
        look_every: float,
        silent_after: float,
    ) -> None:
        self.store = store
        self._client = own_client(store)
        self._alive_key = alive_key
        self._deaths_key = deaths_key
        self._beat_every = beat_every
        self._look_every = look_every
        self.silent_after = silent_after
        self._lock = threading.Lock()
        self._beats: Counter[int] = Counter()
        self._watched: dict[int, Watched] = {}
        self._ensured: set[int] = set()
        self._seen: dict[int, tuple[int, float]] = {}
        self._log_made = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slipstream-watch", daemon=True)
        self._thread.start()

    def beat(self, rank: int) -> None:
        """Beat ``rank``'s counter (one more holder if it beats already)."""
        with self._lock:
            first = self._beats[rank] == 0
            self._beats[rank] += 1
        if first:
            self._client.add(self._alive_key(rank), 1)

    def unbeat(self, rank: int) -> None:
        with self._lock:
            if self._beats[rank] > 0:
                self._beats[rank] -= 1
            if self._beats[rank] == 0:
                del self._beats[rank]

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._beats and not self._watched

    def watch(self, watched: Watched) -> int:
        """Watch the ranks of ``watched`` until :meth:`unwatch` of the number returned."""
        with self._lock:
            number = id(watched)
            self._watched[number] = watched
        self._wake.set()
        return number

    def unwatch(self, number: int) -> None:
        with self._lock:
            self._watched.pop(number, None)

    def dead_among(self, ranks: Sequence[int], client: dist.Store | None = None) -> dict[int, str]:
        """Which of ``ranks`` are dead now, and why: one read (on ``client``, by default
        this watch's own)."""
        if not ranks:
            return {}
        client = client or self._client
        self._ensure(client, ranks)
        asked = time.monotonic()
        values = client.multi_get([self._deaths_key] + [self._alive_key(r) for r in ranks])
        now = time.monotonic()
        self._forgive(now - asked)  # the store stood still: so did every beat
        notices = _notices(values[0])
        dead = {}
        with self._lock:
            for rank, raw in zip(ranks, values[1:], strict=True):
                count = int(raw)
                if count == 0:
                    continue  # never beat: not judged
                notice = notices.get(rank)
                if notice is not None and notice[0] == count:
                    dead[rank] = notice[1]
                    continue
                last = self._seen.get(rank)
                if last is None or last[0] != count:
                    self._seen[rank] = (count, now)
                elif now - last[1] >= self.silent_after:
                    dead[rank] = f"no heartbeat for {now - last[1]:.1f} s"
        return dead

    def notice(self, rank: int, why: str, client: dist.Store | None = None) -> None:
        """Log that ``rank`` is gone (``why``: what was seen, by whom), for every process's
        watch; void as soon as the rank beats again. A rank that never beat is not logged."""
        client = client or self._client
        self._ensure(client, [rank])
        count = int(client.add(self._alive_key(rank), 0))
        if count:
            entry = json.dumps({"rank": rank, "count": count, "why": why})
            cast(Any, client).append(self._deaths_key, (entry + "\n").encode())

    def _ensure(self, client: dist.Store, ranks: Sequence[int]) -> None:
        """Make the counters of ``ranks`` and the log of deaths exist (a counter at 0: never
        beat), once per rank, so that one ``multi_get`` reads them without blocking."""
        with self._lock:
            new = [r for r in ranks if r not in self._ensured]
            self._ensured.update(new)
            log = not self._log_made
            self._log_made = True
        for rank in new:
            client.add(self._alive_key(rank), 0)
        if log:
            cast(Any, client).append(self._deaths_key, b"")

    def _run(self) -> None:
        next_beat = time.monotonic() + self._beat_every
        last, pause, looked = time.monotonic(), 0.0, 0.0
        while not self._stop.is_set():
            with self._lock:
                watching = list(self._watched.values())
                beats = list(self._beats)
            now = time.monotonic()
            self._forgive(now - last - pause)
            if now >= next_beat:
                next_beat = now + self._beat_every
                try:
                    for rank in beats:
                        self._client.add(self._alive_key(rank), 1)
                except Exception:  # the store's host is gone: waits on it fail on their own
                    return
            if watching and now - looked >= self._look_every:  # one look per interval
                looked = now
                try:
                    self._look(watching)
                except Exception as exc:  # the beats go on; the waits keep their deadline
                    logger.warning("a liveness look on the job's store failed: %r", exc)
            last = time.monotonic()
            wait = min(looked + self._look_every, next_beat) if watching else next_beat
            pause = max(wait - last, 0.0)
            self._wake.wait(pause)
            self._wake.clear()

    def _forgive(self, stalled: float) -> None:
        """This thread ran ``stalled`` seconds later than it meant to: the host (or this
        process) stood still, and the peers with it, so that time is no rank's silence."""
        if stalled < STALL_SECONDS:
            return
        with self._lock:
            self._seen = {r: (count, seen + stalled) for r, (count, seen) in self._seen.items()}

    def _look(self, watching: list[Watched]) -> None:
        """One read for every open wait; the answers of the dead posted in their place."""
        ranks = sorted({r for w in watching for r in w.keys})
        dead = self.dead_among(ranks)
        if not dead:
            return
        for watched in watching:
            found = {r: why for r, why in dead.items() if r in watched.keys}
            for rank, why in found.items():
                self._client.compare_set(watched.keys[rank], "", watched.mark(rank, why))
            if found and watched.wake is not None:
                for rank, key in watched.keys.items():
                    if rank not in found:
                        self._client.compare_set(key, "", watched.wake)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10 * self._look_every)


class StoreWatches:
    """One :class:`StoreWatch` per store in this process, shared by its holders: made on
    the first :meth:`acquire`; once the last holder let go it lingers ``linger`` seconds
    (beating on), so that a process closing a ``Checkpointer`` and opening the next does
    not fall silent in between, and is then closed unless held again."""

    def __init__(self, make: Callable[[dist.Store], StoreWatch], linger: float) -> None:
        self._make = make
        self._linger = linger
        self._lock = threading.Lock()
        self._watches: dict[int, tuple[StoreWatch, int]] = {}

    def acquire(self, store: dist.Store) -> StoreWatch:
        with self._lock:
            found = self._watches.get(id(store))
            if found is None or found[0].store is not store:
                found = (self._make(store), 0)
            self._watches[id(store)] = (found[0], found[1] + 1)
            return found[0]

    def release(self, store: dist.Store) -> None:
        with self._lock:
            found = self._watches.get(id(store))
            if found is None:
                return
            self._watches[id(store)] = (found[0], max(found[1] - 1, 0))
            if found[1] > 1:
                return
        timer = threading.Timer(self._linger, self._expire, (store, found[0]))
        timer.daemon = True
        timer.start()

    def _expire(self, store: dist.Store, watch: StoreWatch) -> None:
        with self._lock:
            found = self._watches.get(id(store))
            if found is None or found[0] is not watch or found[1] > 0:
                return
            del self._watches[id(store)]
        watch.close()


def _notices(raw: bytes) -> dict[int, tuple[int, str]]:
    """The log of deaths: each rank's last notice, (its counter then, why)."""
    found = {}
    for line in raw.decode().splitlines():
        if line.strip():
            entry = json.loads(line)
            found[int(entry["rank"])] = (int(entry["count"]), str(entry["why"]))
    return found
