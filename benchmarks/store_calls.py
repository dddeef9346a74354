"""Counting a simulated job's store calls, by rank: the scale harnesses' common part.

Every ``torch.distributed.Store`` call made from Python (the methods of ``TCPStore`` and
``PrefixStore`` patched at class level, so clones and prefix stores are counted alike) is
charged to the rank its thread was labelled with (:func:`label_thread`), ``None`` for the
threads of no rank (a process's liveness thread: background traffic).
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch.distributed as dist

STORE_METHODS = (
    "add",
    "append",
    "check",
    "compare_set",
    "delete_key",
    "get",
    "multi_get",
    "multi_set",
    "num_keys",
    "set",
    "wait",
)

_who = threading.local()


S = TypeVar("S")
"""A simulated rank's state."""


def label_thread(rank: int) -> None:
    """Charge the calling thread's store calls to ``rank``."""
    _who.rank = rank


class CallCounter:
    """Counts every Python call of ``STORE_METHODS`` on ``TCPStore`` and ``PrefixStore``
    (patched at class level, so clones and prefix stores are counted alike), by the rank
    label of the calling thread (``None``: a background thread)."""

    def __init__(self) -> None:
        self.counts: Counter[int | None] = Counter()
        self._lock = threading.Lock()
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> CallCounter:
        for cls in (dist.TCPStore, dist.PrefixStore):
            for name in STORE_METHODS:
                original = getattr(cls, name)
                self._saved.append((cls, name, original))
                setattr(cls, name, self._wrap(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def counted(store: Any, *args: Any, **kwargs: Any) -> Any:
            rank = getattr(_who, "rank", None)
            with counter._lock:
                counter.counts[rank] += 1
            return original(store, *args, **kwargs)

        return counted

    def take(self) -> Counter[int | None]:
        with self._lock:
            taken, self.counts = self.counts, Counter()
        return taken


def start_store_host() -> tuple[subprocess.Popen[str], int]:
    """A child process hosting a TCPStore server (its sockets count against its own file
    limit, not this process's); returns it and the port it listens on."""
    code = (
        "import sys, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "sys.stdin.read()\n"
    )
    host = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert host.stdout is not None
    return host, int(host.stdout.readline())


@contextlib.contextmanager
def store_host() -> Iterator[int]:
    """:func:`start_store_host` for the block's length: yields the port, then ends the child."""
    host, port = start_store_host()
    try:
        yield port
    finally:
        assert host.stdin is not None
        host.stdin.close()
        host.wait(30)


@dataclass
class OpFigures:
    op: str
    ranks: int
    median_rank: float
    max_rank: int
    coordinator: int
    wall_s: float


def figures(op: str, n: int, counts: Counter[int | None], wall: float) -> OpFigures:
    others = [counts.get(r, 0) for r in range(1, n)]
    return OpFigures(op, n, float(statistics.median(others)), max(others), counts.get(0, 0), wall)


class RankThreads(Generic[S]):
    """``n`` simulated ranks, one long-lived thread each (a rank's threads, and so its
    clients, live across ops as a process's do): each makes its state with
    ``make(rank)``, then runs every op :meth:`run` hands it, all ranks together; ``close``
    is given each state as the threads end."""

    def __init__(
        self, n: int, make: Callable[[int], S], close: Callable[[S], None] = lambda _: None
    ) -> None:
        self.n = n
        self.states: list[S | None] = [None] * n
        self.errors: list[BaseException] = []
        self._make, self._close = make, close
        self._work: Callable[[S], None] | None = None
        self._start = threading.Barrier(n + 1)
        self._end = threading.Barrier(n + 1)
        self._threads = [
            threading.Thread(target=self._body, args=(r,), daemon=True) for r in range(n)
        ]
        for t in self._threads:
            t.start()
        self._end.wait()  # every rank has its state
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} rank(s) failed: {self.errors[0]!r}")

    def _body(self, rank: int) -> None:
        label_thread(rank)
        try:
            state = self.states[rank] = self._make(rank)
        except BaseException as exc:
            self.errors.append(exc)
            self._end.wait()
            return
        self._end.wait()
        while True:
            self._start.wait()
            work = self._work
            if work is None:
                self._close(state)
                self._end.wait()
                return
            try:
                work(state)
            except BaseException as exc:
                self.errors.append(exc)
            self._end.wait()

    def run(
        self, counter: CallCounter, work: Callable[[S], None] | None
    ) -> tuple[Counter[int | None], float]:
        """``work(state)`` on every rank, started together (``None``: end every rank's
        thread); returns the calls counted meanwhile and the wall time to the last end.
        Raises naming the first failure of any rank."""
        self._work = work
        counter.take()
        self._start.wait()
        began = time.perf_counter()
        self._end.wait()
        wall = time.perf_counter() - began
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} rank(s) failed, the first: {self.errors[0]!r}")
        return counter.take(), wall
