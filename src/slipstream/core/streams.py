"""Device-agnostic streams and events.

On an accelerator (CUDA or anything ``torch.accelerator`` knows) these are real
``torch.Stream``/``torch.Event`` objects. On CPU every operation is synchronous, so a
stream is ``None`` and events are no-ops: the same calling code runs everywhere, and on CPU
ordering comes from threads and futures instead.

Invariant kept by callers: work put on a side stream first waits on an event recorded on
the producing stream, so it never reads a tensor that queued compute may still write.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def is_accelerator(device: torch.device | str) -> bool:
    """True when ``device`` runs work asynchronously on streams."""
    return torch.device(device).type not in ("cpu", "meta")


def new_stream(device: torch.device | str) -> torch.Stream | None:
    """A new side stream on ``device``, or ``None`` on CPU."""
    device = torch.device(device)
    if not is_accelerator(device):
        return None
    return torch.Stream(device=device)


def current_stream(device: torch.device | str) -> torch.Stream | None:
    """The stream the caller's work on ``device`` is queued on, or ``None`` on CPU."""
    device = torch.device(device)
    if not is_accelerator(device):
        return None
    return torch.accelerator.current_stream(device)


def record_event(stream: torch.Stream | None) -> torch.Event | None:
    """Record an event at the current tail of ``stream`` (``None`` on CPU)."""
    if stream is None:
        return None
    return stream.record_event()


def wait_event(stream: torch.Stream | None, event: torch.Event | None) -> None:
    """Make future work on ``stream`` wait for ``event`` without blocking the host."""
    if stream is not None and event is not None:
        stream.wait_event(event)


def on_stream(stream: torch.Stream | None) -> AbstractContextManager[object]:
    """Context in which queued work goes to ``stream`` (a no-op context on CPU)."""
    if stream is None:
        return nullcontext()
    return stream


def synchronize_event(event: torch.Event | None) -> None:
    """Block the calling thread until the work before ``event`` has run (no-op on CPU)."""
    if event is not None:
        event.synchronize()
