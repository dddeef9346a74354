"""A one-line progress bar for the ``slipstream`` command: drawn on a terminal, silent
otherwise (a pipe, a log file, a test), so scripts see only the final result lines.

Invariant: ``advance`` may be called from any thread; the line is redrawn at most every
``min_interval`` seconds and cleared by ``close``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

_WIDTH = 30


class Progress:
    """Bytes done out of ``total``, as a bar with percentage, size and rate."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval: float = 0.1,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.total, self.done = label, max(total, 0), 0
        self._min_interval = min_interval
        self._started = time.perf_counter()
        self._drawn = 0.0
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.perf_counter()
            if self.enabled and now - self._drawn >= self._min_interval:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        rate = self.done / max(now - self._started, 1e-9) / 2**20
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {100 * fraction:5.1f}% "
            f"{self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB {rate:.0f} MiB/s"
        )
        self.stream.flush()

    def close(self) -> None:
        """Clear the line, for the command's result line to take its place."""
        if self.enabled:
            with self._lock:
                self.stream.write("\r\033[K")
                self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
