"""Where time goes: named ranges in ``torch.profiler`` traces, and a trace file of slipstream's
own threads.

Every stage slipstream runs (a save's staging copy, write and commit; a load's planning and
reads; FSDP's all-gathers, releases and reduce-scatters; weight publishing and receiving) is
wrapped in :class:`span`. While a profiler runs, a span is a
``torch.profiler.record_function`` range, so it shows in a trace the user takes with
``torch.profiler``; otherwise it costs an attribute check. While a trace file is being recorded
(:func:`start`, or the ``SLIPSTREAM_TRACE`` environment variable naming the file), each span
is also kept as a complete event of the Trace Event Format (``"ph": "X"``) with the thread it
ran on, and :func:`flush` (called at exit) writes them as a JSON file that Perfetto and
``chrome://tracing`` open.

Invariants:
- recording is thread-safe and bounded: at most ``max_events`` events are kept (the oldest
  are dropped first, and the file says how many);
- timestamps come from the system-wide monotonic clock, so files written by processes of one
  host line up when merged (:func:`merge`);
- the file is written whole and atomically (a temporary file renamed over it).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import torch
import torch.autograd.profiler as _autograd_profiler

_T = TypeVar("_T")
_P = ParamSpec("_P")

ENV_VAR = "SLIPSTREAM_TRACE"
"""Environment variable naming the trace file to record; ``{pid}`` in it is replaced by the
process id, so several processes of one job can share the setting."""
DEFAULT_MAX_EVENTS = 200_000
_VIRTUAL_TID_BASE = 1 << 30
"""Thread ids at and above this stand for tracks that are no thread (async collectives)."""


@dataclass
class _Recording:
    template: str
    path: str
    max_events: int
    events: collections.deque[dict[str, Any]]
    threads: dict[int, str] = field(default_factory=dict)
    tracks: dict[str, int] = field(default_factory=dict)
    process_name: str | None = None
    recorded: int = 0


_lock = threading.Lock()
_recording: _Recording | None = None


def _now_us() -> float:
    return time.monotonic_ns() / 1000.0


def start(path: str | os.PathLike[str], *, max_events: int = DEFAULT_MAX_EVENTS) -> None:
    """Record spans from now on, to be written to ``path`` by :func:`flush` (and at exit).

    Starting again replaces the previous recording without writing it.
    """
    global _recording
    if max_events < 1:
        raise ValueError(f"max_events must be >= 1, got {max_events}")
    template = os.fspath(path)
    path = template.replace("{pid}", str(os.getpid()))
    with _lock:
        _recording = _Recording(template, path, max_events, collections.deque(maxlen=max_events))


def is_recording() -> bool:
    """True while spans are being kept for a trace file."""
    return _recording is not None


def set_process_name(name: str) -> None:
    """The name this process shows under in the trace file (``"rank 0"``, ``"rollout"``)."""
    with _lock:
        if _recording is not None:
            _recording.process_name = name


def _add(rec: _Recording, event: dict[str, Any]) -> None:
    with _lock:
        if rec is not _recording:
            return
        rec.events.append(event)
        rec.recorded += 1


def _thread_id(rec: _Recording) -> int:
    tid = threading.get_native_id()
    if tid not in rec.threads:
        with _lock:
            rec.threads.setdefault(tid, threading.current_thread().name)
    return tid


class span:
    """A named range around the body: a ``torch.profiler`` range while a profiler runs, and
    a complete event on the calling thread while a trace file is being recorded; next to
    nothing otherwise. ``args`` are shown with the event (keep them small: names, sizes,
    steps)."""

    __slots__ = ("_args", "_begin", "_name", "_range", "_rec")

    def __init__(self, name: str, **args: Any) -> None:
        self._name = name
        self._args = args
        self._range: Any = None
        self._rec: _Recording | None = None
        self._begin = 0.0

    def __enter__(self) -> None:
        # torch's own fast check: a module global its profilers set at start and clear at
        # stop (a torch without it gets a range every time)
        if getattr(_autograd_profiler, "_is_profiler_enabled", True):
            self._range = torch.profiler.record_function(self._name)
            self._range.__enter__()
        self._rec = _recording
        if self._rec is not None:
            self._begin = _now_us()

    def __exit__(self, *exc_info: object) -> None:
        rec = self._rec
        if rec is not None:
            end = _now_us()
            event = {
                "name": self._name,
                "cat": "slipstream",
                "ph": "X",
                "ts": self._begin,
                "dur": end - self._begin,
                "pid": os.getpid(),
                "tid": _thread_id(rec),
            }
            if self._args:
                event["args"] = {k: _jsonable(v) for k, v in self._args.items()}
            _add(rec, event)
        if self._range is not None:
            self._range.__exit__(*exc_info)
            self._range = None


def traced(name: str, fn: Callable[[], _T], **args: Any) -> Callable[[], _T]:
    """``fn`` run inside :class:`span` ``(name, **args)``: for work handed to a thread pool."""

    def run() -> _T:
        with span(name, **args):
            return fn()

    return run


def spanned(name: str) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """Decorator: every call of the function runs inside :class:`span` ``(name)``."""

    def wrap(fn: Callable[_P, _T]) -> Callable[_P, _T]:
        @wraps(fn)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            with span(name):
                return fn(*args, **kwargs)

        return run

    return wrap


def record_interval(
    name: str, track: str, begin_ns: int, end_ns: int, args: Mapping[str, Any] | None = None
) -> None:
    """Keep a complete event that no thread ran (an async collective, from issue to
    completion) on the named ``track``, with times from ``time.monotonic_ns()``. A no-op
    while no trace file is being recorded."""
    rec = _recording
    if rec is None:
        return
    with _lock:
        tid = rec.tracks.setdefault(track, _VIRTUAL_TID_BASE + len(rec.tracks))
    event = {
        "name": name,
        "cat": "slipstream",
        "ph": "X",
        "ts": begin_ns / 1000.0,
        "dur": max(0, end_ns - begin_ns) / 1000.0,
        "pid": os.getpid(),
        "tid": tid,
    }
    if args:
        event["args"] = {k: _jsonable(v) for k, v in args.items()}
    _add(rec, event)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def trace_events() -> list[dict[str, Any]]:
    """The recording so far as Trace Event Format events: thread and process names
    (``"ph": "M"``) first, then the complete events ordered by start time."""
    rec = _recording
    return [] if rec is None else _snapshot(rec)[0]


def _snapshot(rec: _Recording) -> tuple[list[dict[str, Any]], int]:
    """:func:`trace_events` of ``rec`` and how many events it dropped, taken together."""
    pid = os.getpid()
    with _lock:
        events = sorted(rec.events, key=lambda e: (e["ts"], -e["dur"]))
        dropped = rec.recorded - len(rec.events)
        threads = dict(rec.threads)
        tracks = dict(rec.tracks)
        process = rec.process_name or f"slipstream pid {pid}"
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}
    ]
    for tid, name in sorted(threads.items()):
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        )
    for name, tid in sorted(tracks.items(), key=lambda kv: kv[1]):
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        )
    return meta + events, dropped


def flush() -> str | None:
    """Write the recording so far to its file (replacing it atomically); returns the path,
    or None when nothing is being recorded. Recording goes on."""
    rec = _recording
    if rec is None:
        return None
    events, dropped = _snapshot(rec)
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "slipstream", "dropped_events": dropped},
    }
    _write_json(rec.path, doc)
    return rec.path


def stop() -> str | None:
    """Write the recording (see :func:`flush`) and stop recording; returns the path."""
    global _recording
    path = flush()
    with _lock:
        _recording = None
    return path


def merge(paths: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str]) -> str:
    """Concatenate trace files of several processes of one host into ``out`` (their
    timestamps share one clock); returns ``out``."""
    events: list[dict[str, Any]] = []
    dropped = 0
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        events.extend(doc["traceEvents"])
        dropped += int(doc.get("otherData", {}).get("dropped_events", 0))
    meta = [e for e in events if e["ph"] == "M"]
    rest = sorted((e for e in events if e["ph"] != "M"), key=lambda e: (e["ts"], -e["dur"]))
    doc = {
        "traceEvents": meta + rest,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "slipstream", "dropped_events": dropped},
    }
    _write_json(os.fspath(out), doc)
    return os.fspath(out)


def _write_json(path: str, doc: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _flush_at_exit() -> None:
    if _recording is not None:
        flush()


def _after_fork_in_child() -> None:
    """A forked child records to a file of its own when the path names ``{pid}``, and not
    at all otherwise (it would overwrite its parent's file)."""
    global _lock, _recording
    _lock = threading.Lock()
    rec = _recording
    _recording = None
    if rec is not None and "{pid}" in rec.template:
        start(rec.template, max_events=rec.max_events)


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
if os.environ.get(ENV_VAR):
    start(os.environ[ENV_VAR])
