"""Counting a simulated job's store calls, by rank: the scale harnesses' common part.

Every ``torch.distributed.Store`` call made from Python (the methods of ``TCPStore`` and
``PrefixStore`` patched at class level, so clones and prefix stores are counted alike) is
charged to the rank its thread was labelled with (:func:`label_thread`), ``None`` for the
threads of no rank (a process's liveness thread: background traffic).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

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


QUICK_RESOLVER = "timeout:1 attempts:1"
"""The resolver's options for the harness's processes (glibc's ``RES_OPTIONS``): a TCPStore
looks up the name of each connection's address, which on a host whose name server drops
queries costs a connection the resolver's retry (5 s by default, 1 s with these)."""


@contextlib.contextmanager
def store_host() -> Iterator[int]:
    """:func:`start_store_host` for the block's length: yields the port, then ends the child.
    The host, and every process forked after, resolve with :data:`QUICK_RESOLVER`."""
    os.environ.setdefault("RES_OPTIONS", QUICK_RESOLVER)
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
    """The simulated ranks ``ranks``, one long-lived thread each (a rank's threads, and so
    its clients, live across ops as a process's do): each makes its state with
    ``make(rank)``, then runs every op :meth:`run` hands it, all ranks together; ``close``
    is given each state as the threads end. ``states`` follows the order of ``ranks``."""

    def __init__(
        self,
        ranks: Sequence[int],
        make: Callable[[int], S],
        close: Callable[[S], None] = lambda _: None,
    ) -> None:
        self.ranks = list(ranks)
        self.states: list[S | None] = [None] * len(self.ranks)
        self.errors: list[BaseException] = []
        self._make, self._close = make, close
        self._work: Callable[[S], None] | None = None
        self._start = threading.Barrier(len(self.ranks) + 1)
        self._end = threading.Barrier(len(self.ranks) + 1)
        self._threads = [
            threading.Thread(target=self._body, args=(i, r), daemon=True)
            for i, r in enumerate(self.ranks)
        ]
        for t in self._threads:
            t.start()
        self._end.wait()  # every rank has its state
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} rank(s) failed: {self.errors[0]!r}")

    def _body(self, index: int, rank: int) -> None:
        label_thread(rank)
        try:
            state = self.states[index] = self._make(rank)
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


class RankGroup(Protocol):
    """One process's simulated ranks: runs an op on every one of them (``None``: ends them),
    returning the calls counted meanwhile and the wall time to the last rank's end."""

    def run(
        self, counter: CallCounter, work: Callable[[Any], None] | None
    ) -> tuple[Counter[int | None], float]: ...


SPREAD_SILENT_AFTER_S = 600.0
"""How long a simulated rank may be silent before it is judged dead when the ranks are
spread over processes (:class:`RankProcesses`): there, one thread of each process beats for
hundreds of ranks on a host whose 2 cores thousands of threads share, so a beat may come
seconds late, which a job's ranks, each beating for itself, do not; the looks and their
reads are the same whatever the bound. The in-process harness keeps the channels' own bound
(the tests of a silent rank use it)."""

ANSWER_S = 1800.0
"""How long a process of :class:`RankProcesses` may take to answer a command."""


def process_shares(n: int, processes: int) -> list[list[int]]:
    """Rank 0 (the coordinator) alone, as a job's rank 0 has a process of its own, and ranks
    1 to ``n - 1`` dealt among ``processes - 1`` more (one process: every rank in it)."""
    if processes <= 1 or n <= 1:
        return [list(range(n))]
    others = min(processes - 1, n - 1)
    return [[0]] + [list(range(1 + p, n, others)) for p in range(others)]


class RankProcesses:
    """The ``n`` simulated ranks of a job spread over forked processes
    (:func:`process_shares`), so that the ranks' turns at an interpreter lock are shared by
    several, each process running its share as a :class:`RankGroup` made there by
    ``start(ranks)``, with its own clients, liveness thread and :class:`CallCounter`. An op
    is named by its key in ``ops``; every process arms it, then all start at one signal, and
    the wall time runs from that signal to the last rank's end in any process.

    Invariant: every process is joined by :meth:`close`; a process that dies or stops
    answering fails the command that waited for it, naming its ranks."""

    def __init__(
        self,
        n: int,
        processes: int,
        start: Callable[[list[int]], RankGroup],
        ops: dict[str, Callable[[Any], None]],
        switch_interval: float,
    ) -> None:
        context = multiprocessing.get_context("fork")
        self.shares = process_shares(n, processes)
        self._go = context.Event()
        self._pipes = []
        self._procs = []
        for share in self.shares:
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=_serve,
                args=(theirs, self._go, share, start, ops, switch_interval),
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._pipes.append(ours)
            self._procs.append(proc)
        try:
            self._answers("start its ranks")
        except BaseException:
            self._end()
            raise

    def _answers(self, what: str) -> list[Any]:
        """Every process's answer to its last command, each within :data:`ANSWER_S`."""
        answers = []
        for p, (pipe, proc) in enumerate(zip(self._pipes, self._procs, strict=True)):
            ranks = self.shares[p]
            who = f"process {p} (ranks {ranks[0]}..{ranks[-1]}, {len(ranks)} of them)"
            deadline = time.monotonic() + ANSWER_S
            while not pipe.poll(0.25):
                if not proc.is_alive():
                    raise RuntimeError(f"{who} exited ({proc.exitcode}) before it could {what}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{who} did not {what} within {ANSWER_S:.0f} s")
            kind, value = pipe.recv()
            if kind == "error":
                raise RuntimeError(f"{who} failed to {what}: {value}")
            answers.append(value)
        return answers

    def _send(self, command: str, argument: Any = None) -> None:
        for pipe in self._pipes:
            pipe.send((command, argument))

    def run(self, op: str) -> tuple[Counter[int | None], float]:
        """``ops[op]`` on every rank of every process, started together: the calls counted
        and the wall time from the start to the last rank's end."""
        self._send("op", op)
        self._answers(f"arm {op}")
        began = time.monotonic()
        self._go.set()
        try:
            answers = self._answers(f"run {op}")
        finally:
            self._go.clear()
        counts: Counter[int | None] = Counter()
        for found, _ in answers:
            counts.update(found)
        return counts, max(ended for _, ended in answers) - began

    def idle(self, seconds: float) -> Counter[int | None]:
        """The calls every process makes in ``seconds`` with no op running."""
        self._send("idle", seconds)
        counts: Counter[int | None] = Counter()
        for found in self._answers("count its idle calls"):
            counts.update(found)
        return counts

    def close(self) -> None:
        """End every rank, then join every process."""
        try:
            self._send("close")
            self._answers("end its ranks")
        finally:
            self._end()

    def _end(self) -> None:
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for pipe in self._pipes:
            pipe.close()


def _serve(
    pipe: Any,
    go: Any,
    ranks: list[int],
    start: Callable[[list[int]], RankGroup],
    ops: dict[str, Callable[[Any], None]],
    switch_interval: float,
) -> None:
    """A process of :class:`RankProcesses`: its ranks made, then its commands served."""
    sys.setswitchinterval(switch_interval)
    threading.stack_size(256 * 1024)
    try:
        with CallCounter() as counter:
            group = start(ranks)
            pipe.send(("ok", None))
            while True:
                command, argument = pipe.recv()
                if command == "op":
                    pipe.send(("ok", None))
                    if not go.wait(ANSWER_S):
                        raise TimeoutError(f"no start of {argument} within {ANSWER_S:.0f} s")
                    found, _ = group.run(counter, ops[argument])
                    pipe.send(("ok", (found, time.monotonic())))
                elif command == "idle":
                    counter.take()
                    time.sleep(argument)
                    pipe.send(("ok", counter.take()))
                else:
                    group.run(counter, None)
                    pipe.send(("ok", None))
                    return
    except BaseException as exc:
        pipe.send(("error", repr(exc)))
    finally:
        pipe.close()


def measure_ops(
    n: int,
    processes: int,
    start: Callable[[list[int]], RankGroup],
    ops: dict[str, Callable[[Any], None]],
    switch_interval: float,
    warm_up: str | None = None,
    idle_s: float | None = None,
) -> tuple[list[OpFigures], float | None]:
    """Every op of ``ops`` at ``n`` ranks spread over ``processes`` processes, each with
    ``switch_interval`` as its interpreter's (after one untimed ``warm_up`` op), then, with
    ``idle_s``, the idle traffic (calls per rank per second of the background threads)."""
    began = time.perf_counter()
    ranks = RankProcesses(n, processes, start, ops, switch_interval)
    print(f"N={n:5d} ranks connected in {time.perf_counter() - began:.1f} s", flush=True)
    results = []
    per_rank_s = None
    try:
        if warm_up is not None:
            ranks.run(warm_up)
        for op in ops:
            if op == warm_up:
                continue
            counts, wall = ranks.run(op)
            results.append(figures(op, n, counts, wall))
            print(
                f"N={n:5d} {op:28s} rank median {results[-1].median_rank:6.1f} "
                f"max {results[-1].max_rank:6d} coordinator {results[-1].coordinator:7d} "
                f"wall {wall:7.3f} s",
                flush=True,
            )
        if idle_s is not None:
            idle = ranks.idle(idle_s)
            per_rank_s = sum(idle.values()) / n / idle_s
            print(f"N={n:5d} idle: {per_rank_s:.2f} calls per rank per second", flush=True)
    finally:
        ranks.close()
    return results, per_rank_s
