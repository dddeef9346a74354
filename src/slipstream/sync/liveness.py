"""Which of the sync group's ranks are dead, in one read, and waits that block until an
answer or a death: :class:`SyncWatch`.

A rank of the group posts where it runs (``hello/{r}``, a :class:`~.members.Member`) and
beats a counter (``alive/{r}``). A rank on this host is dead when its process is gone; one
elsewhere when its counter has been still for ``silent_after`` seconds on this process's
clock (hosts' clocks need not agree). A rank that never joined or never beat is not judged.
:meth:`SyncWatch.dead_among` reads every rank asked about in one ``multi_get``.

A wait for one rank's key blocks in one ``store.wait`` to its deadline, on a client of its
own (:class:`~slipstream.core.store_watch.WaitingClients`), and is watched
(:meth:`SyncWatch.watch`): while such waits are open, this process's watch thread looks at
the ranks they wait for every ``look_every`` seconds, one read per look for all of them, and
posts in a dead rank's key, write-once (``compare_set``), a word naming it
(:func:`dead_word`): the blocked wait wakes at once, and so does every other process's wait
on that key; whoever reads the key reads the death (:func:`read_dead_word`). The rank's own
answer, posted later, takes the word's place.

Invariant: a process makes one read per look however many waits it has open, and none
while it has none; every word it posts names a rank it found dead.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .members import Member, host_identity

logger = logging.getLogger(__name__)

LOOK_SECONDS = 1.0
"""How often a process with blocking waits open looks at the ranks they wait for."""
_DEAD = "slipstream_dead"


def dead_word(rank: int, why: str) -> str:
    """What the watch posts in ``rank``'s place once it found the rank dead (``why``)."""
    return json.dumps({_DEAD: why, "rank": rank})


def read_dead_word(raw: bytes) -> tuple[int, str] | None:
    """``(rank, why)`` when ``raw`` is a word :func:`dead_word` posted, else ``None``."""
    if not raw.startswith(b'{"' + _DEAD.encode()):
        return None
    found = json.loads(raw)
    return int(found["rank"]), str(found[_DEAD])


@dataclass(frozen=True)
class Awaited:
    """A blocking wait this process has open: for ``rank``'s answer at ``key`` (a key of
    the group's root store, where the watch posts)."""

    rank: int
    key: str


class SyncWatch:
    """This process's judge of the group's ranks and watcher of its blocking waits (see the
    module doc). ``client`` is a client of the group's root store of its own (the watch's
    thread posts on it); ``hello_key``/``alive_key`` name a rank's hello and counter."""

    def __init__(
        self,
        client: dist.Store,
        hello_key: Callable[[int], str],
        alive_key: Callable[[int], str],
        silent_after: float,
        look_every: float = LOOK_SECONDS,
    ) -> None:
        self._client = client
        self._hello_key = hello_key
        self._alive_key = alive_key
        self.silent_after = silent_after
        self._look_every = look_every
        self._here = host_identity()
        self._lock = threading.Lock()
        self._joined: set[int] = set()
        self._members: dict[bytes, Member] = {}
        """Each hello read, as the member it describes (a rank's hello changes only when
        its process is replaced)."""
        self._seen: dict[int, tuple[int, float]] = {}
        self._awaited: dict[int, Awaited] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slipstream-sync-watch", daemon=True)
        self._thread.start()

    def watch(self, awaited: Awaited) -> int:
        """Look after ``awaited`` until :meth:`unwatch` of the number returned."""
        with self._lock:
            number = id(awaited)
            self._awaited[number] = awaited
        self._wake.set()
        return number

    def unwatch(self, number: int) -> None:
        with self._lock:
            self._awaited.pop(number, None)

    def dead_among(self, ranks: Sequence[int], client: dist.Store | None = None) -> dict[int, str]:
        """Those of ``ranks`` found dead, with why: one read (on ``client``, by default this
        watch's own), and while some have not been seen joined yet, a look for their hellos."""
        client = client or self._client
        joined = self._joined_among(ranks, client)
        if not joined:
            return {}
        values = client.multi_get(
            [self._hello_key(r) for r in joined] + [self._alive_key(r) for r in joined]
        )
        now = time.monotonic()
        dead = {}
        n = len(joined)
        judged: dict[Member, str | None] = {}  # ranks of one process: it is looked at once
        with self._lock:
            for rank, hello, raw in zip(joined, values[:n], values[n:], strict=True):
                member = self._members.get(hello)
                if member is None:
                    member = self._members[hello] = Member.of_hello(hello)
                if member.host == self._here:
                    if member not in judged:
                        judged[member] = member.gone()
                    why = judged[member]
                    if why is not None:
                        dead[rank] = why
                    continue
                count = int(raw)
                last = self._seen.get(rank)
                if count == 0:
                    continue  # never beat: not judged
                if last is None or last[0] != count:
                    self._seen[rank] = (count, now)
                elif now - last[1] >= self.silent_after:
                    dead[rank] = f"no heartbeat for {now - last[1]:.1f} s"
        return dead

    def _joined_among(self, ranks: Sequence[int], client: dist.Store) -> list[int]:
        """Those of ``ranks`` that joined (a rank beats before it posts its hello, so one
        ``multi_get`` reads the hello and the counter of each without blocking): one look
        for the hellos of all the ranks not seen joined yet, then one per rank while some
        are missing."""
        with self._lock:
            unknown = [r for r in ranks if r not in self._joined]
        if unknown and client.check([self._hello_key(r) for r in unknown]):
            found = unknown
        else:
            found = [r for r in unknown if client.check([self._hello_key(r)])]
        with self._lock:
            self._joined.update(found)
            return [r for r in ranks if r in self._joined]

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            with self._lock:
                waiting = bool(self._awaited)
            if not waiting:
                self._wake.wait()
                self._wake.clear()
                continue
            if self._stop.wait(self._look_every):
                return
            with self._lock:
                awaited = list(self._awaited.values())
            if not awaited:
                continue
            try:
                self._look(awaited)
                failing = False
            except Exception as exc:  # the waits keep their deadline; the store's loss ends them
                if not failing:
                    logger.warning("a liveness look on the sync group's store failed: %r", exc)
                failing = True

    def _look(self, awaited: list[Awaited]) -> None:
        """One read for every open wait; a word in the place of each dead rank's answer."""
        dead = self.dead_among(sorted({a.rank for a in awaited}))
        for a in awaited:
            if a.rank in dead:
                self._client.compare_set(a.key, "", dead_word(a.rank, dead[a.rank]))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10 * self._look_every)
