"""Two-phase handles: ``staged`` (the source may change now) then ``done``.

Both phases are plain :class:`concurrent.futures.Future` objects so callers compose them
with what they already know (``result(timeout)``, ``add_done_callback``, ``wait``).

Invariant: ``done`` never resolves successfully before ``staged`` has; an error in staging
fails both.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class TwoPhaseHandle:
    staged: Future = field(default_factory=Future)
    done: Future = field(default_factory=Future)

    def set_staged(self) -> None:
        if not self.staged.done():
            self.staged.set_result(None)

    def set_done(self, value: object = None) -> None:
        self.set_staged()
        if not self.done.done():
            self.done.set_result(value)

    def fail(self, exc: BaseException) -> None:
        """Fail whichever phases have not finished yet."""
        for fut in (self.staged, self.done):
            if not fut.done():
                fut.set_exception(exc)

    def wait(self, timeout: float | None = None) -> object:
        return self.done.result(timeout)


def completed_future(value: object = None) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
