"""Calls to several vLLM engines at once: :class:`EngineCalls`.

Invariants: every call runs on a thread of its own, named after its engine, which is
joined before :meth:`EngineCalls.join` returns or named in its error as one that did not
answer within the timeout; an engine's error is never dropped: :meth:`EngineCalls.join`
raises :class:`~slipstream.errors.SyncError` naming every engine that failed, after the
trainer's own error where it has one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from ...errors import SyncError


class _EngineFailed(SyncError):
    """Raised in the trainer's own wait once an engine's call failed, to end that wait (the
    engine's error is the one :meth:`EngineCalls.join` reports)."""


class EngineCalls:
    """``calls`` (engine name -> call), each started on its thread as this is built;
    ``what`` names them in errors; ``timeout`` (seconds) bounds them all."""

    def __init__(
        self, what: str, calls: Mapping[str, Callable[[], object]], timeout: float
    ) -> None:
        self.what = what
        self.timeout = timeout
        self.errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + timeout
        self._threads: list[tuple[str, threading.Thread]] = []
        for name, call in calls.items():
            thread = threading.Thread(
                target=self._run, args=(name, call), name=f"slipstream-vllm-{name}", daemon=True
            )
            thread.start()
            self._threads.append((name, thread))

    def _run(self, name: str, call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:
            with self._lock:
                self.errors[name] = exc

    def raise_if_failed(self) -> None:
        """Raise once an engine's call failed (for a wait of the trainer's that the engine
        would have ended, to end at once: :func:`run_all` then reports the engine's error)."""
        with self._lock:
            failed = dict(self.errors)
        if failed:
            raise _EngineFailed(f"{self.what} failed on engine(s): " + _texts(failed))

    def join(self, own: BaseException | None = None) -> None:
        """Wait for every call (until the timeout); raise naming every engine that failed
        or did not answer, the trainer's own error ``own`` first."""
        silent = []
        for name, thread in self._threads:
            thread.join(max(0.0, self._deadline - time.monotonic()))
            if thread.is_alive():
                silent.append(name)
        with self._lock:
            problems = [_texts(self.errors)] if self.errors else []
        problems += [f"{name} did not answer within {self.timeout:.0f} s" for name in silent]
        if own is not None:
            raise SyncError(
                f"{self.what} failed on the trainer: {own}; " + "; ".join(problems)
            ) from own
        if problems:
            raise SyncError(f"{self.what} failed on engine(s): " + "; ".join(problems))


def run_all(
    what: str,
    calls: Mapping[str, Callable[[], object]],
    timeout: float,
    here: Callable[[EngineCalls], object] | None = None,
) -> None:
    """Run ``calls`` at once (see :class:`EngineCalls`) and ``here`` on this thread (given
    the calls, so a wait of its own can end once one failed); raise as
    :meth:`EngineCalls.join` does."""
    running = EngineCalls(what, calls, timeout)
    own: BaseException | None = None
    if here is not None:
        try:
            here(running)
        except _EngineFailed:
            pass
        except BaseException as exc:
            own = exc
    running.join(own)


def _texts(errors: Mapping[str, BaseException]) -> str:
    return "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in errors.items())
