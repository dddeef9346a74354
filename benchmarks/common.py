"""What every benchmark needs: timing, medians, peak memory, the machine, and the JSON result.

A benchmark builds a :class:`Result` and calls :meth:`Result.write`; ``report.py`` renders
every result file into BENCHMARKS.md. The JSON schema (one file per benchmark)::

    {
      "benchmark": "checkpoint",            # name, also the section title
      "title": "...",                        # one line: what was measured
      "command": "python benchmarks/...",    # exactly what produced the file
      "date": "2026-11-22T21:00:00Z",
      "machine": {"cores": 2, "memory_gib": 23.4, "torch": "2.13.0+cpu", "device": "cpu", ...},
      "setup": {"...": "..."},               # sizes, repetitions, anything a reader needs
      "tables": [{"title": "...", "columns": ["peer", "blocked s", ...], "rows": [[...], ...]}],
      "floors": [{"claim": "...", "measured": 0.03, "floor": "<= 0.05", "passed": true}],
      "notes": ["free text, one paragraph per entry"]
    }
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import gc
import json
import os
import platform
import random
import resource
import shutil
import socket
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Live:
    """Bytes of tensors handed to :meth:`track` whose memory is still alive (held by the
    tensor or any view of it), and their peak: weak references to their storages, nothing
    kept."""

    def __init__(self) -> None:
        self.bytes = 0
        self.peak = 0

    def _gone(self, n: int) -> None:
        self.bytes -= n

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.bytes += n
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(t.untyped_storage(), self._gone, n)  # its memory, views included
        return t


def status_bytes(field: str) -> int:
    """A size field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_high_water() -> None:
    """Give freed heap pages back to the kernel (so the resident size counts only live
    memory), then reset the resident high-water mark (``VmHWM``) to it."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def drop_page_cache(paths: Sequence[str | os.PathLike]) -> None:
    """Evict ``paths`` (files, or directories walked) from the page cache, without root.

    ``POSIX_FADV_DONTNEED`` on each file after an ``fsync``: the next read comes from disk.
    """
    for root in paths:
        root = os.fspath(root)
        files = (
            [root]
            if os.path.isfile(root)
            else [os.path.join(d, f) for d, _, names in os.walk(root) for f in names]
        )
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@contextlib.contextmanager
def scratch(path: str | os.PathLike) -> Iterator[Path]:
    """An empty directory at ``path`` for the benchmark's files, removed (with whatever a
    run left there) on the way out, however the run ends."""
    root = Path(path)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def join_all(procs: Sequence[Any]) -> None:
    """Join every rank process of a run, killing any still alive after two minutes."""
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a store or a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, result)`` of one call, after a garbage collection."""
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def interleave(
    runners: dict[str, Callable[[int], dict[str, float]]],
    repeats: int,
    warmup: int = 1,
    shuffle_seed: int | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Run each runner ``warmup + repeats`` times, interleaved A B C A B C ...

    With ``shuffle_seed`` every round runs the runners in a new order drawn from a random
    generator with that seed (A B C, C A B, B C A ...), so no runner always follows the same
    one or always comes late in a round: where a runner's time depends on what ran before it
    (a write after other writes, on a disk), that cost is spread over every runner instead of
    landing on the same one each round.

    A runner takes the repetition index and returns named measurements (seconds, MiB...).
    Warm-up repetitions are run but not kept. Returns name -> metric -> list of values.
    """
    kept: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
    order = list(runners.items())
    rng = random.Random(shuffle_seed)
    for rep in range(warmup + repeats):
        if shuffle_seed is not None:
            rng.shuffle(order)
        for name, run in order:
            metrics = run(rep)
            if rep < warmup:
                continue
            for metric, value in metrics.items():
                kept[name].setdefault(metric, []).append(value)
    return kept


def machine() -> dict[str, Any]:
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)


@dataclass
class Floor:
    """A target the benchmark checks, what was measured, and whether it held."""

    claim: str
    measured: float
    floor: str
    passed: bool


@dataclass
class Result:
    benchmark: str
    title: str
    setup: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    floors: list[Floor] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: str = field(default_factory=lambda: "python " + " ".join(sys.argv))
    date: str = field(
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    machine: dict[str, Any] = field(default_factory=machine)

    def floor(self, claim: str, measured: float, floor: str, passed: bool) -> None:
        self.floors.append(Floor(claim, round(float(measured), 4), floor, bool(passed)))

    def note_load(self, when: str) -> None:
        """Record the host's 1, 5 and 15 minute load averages ``at {when}`` in the setup:
        how busy the shared machine was around the measurements."""
        loads = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        self.setup[f"load average at {when}"] = loads

    def write(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")
        print(f"wrote {path}")


def fmt(value: float, digits: int = 3) -> str:
    """A number for a table cell: 3 significant digits, no scientific notation below 1e6."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.{max(0, digits - 1)}f}".rstrip("0").rstrip(".") or "0"
    return f"{value:.{digits}g}"
