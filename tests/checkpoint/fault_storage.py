"""A storage backend for tests: wraps a real one and gates or fails operations on demand.

Faults are injected through the storage seam, as a user's own backend would plug in, not
by patching module globals. Every location derived from one :class:`FaultStorage`
(``child``) shares its :class:`Faults`.

Names: a storage operation's ``name`` is the object's name relative to its location
(``".metadata"``, ``"__0_0.distcp"``); ``prepare``, ``list`` and ``delete_all`` (recorded as
``"delete"``) are named by the location's ``url``. Writer operations (``write``,
``append``, ``finish``) are named by the data object's name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from slipstream.checkpoint.storage import DataWriter, Storage

GATE_TIMEOUT = 10.0
OPERATIONS = (
    "prepare",
    "open",
    "write",
    "append",
    "finish",
    "put",
    "get",
    "read",
    "size",
    "exists",
    "list",
    "delete",
)


@dataclass
class _Fault:
    error: BaseException | None = None
    gate: threading.Event | None = None
    hook: Callable[..., None] | None = None
    when: Callable[[str], bool] = lambda name: True
    remaining: int | None = None


@dataclass
class Faults:
    """What to do at each operation: wait on a gate, raise, or call a hook (optionally only
    for names that ``when`` accepts, and only ``times`` times), in the order they were
    added. ``calls`` records (operation, name, thread id) of every call."""

    _faults: dict[str, list[_Fault]] = field(default_factory=dict)
    calls: list[tuple[str, str, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gate(self, operation: str) -> threading.Event:
        """Make ``operation`` wait until the returned event is set."""
        event = threading.Event()
        self._add(operation, _Fault(gate=event))
        return event

    def fail(
        self,
        operation: str,
        error: BaseException,
        when: Callable[[str], bool] = lambda name: True,
        times: int | None = None,
    ) -> None:
        """Make ``operation`` raise ``error`` (for names ``when`` accepts, ``times`` times)."""
        self._add(operation, _Fault(error=error, when=when, remaining=times))

    def hook(
        self,
        operation: str,
        fn: Callable[..., None],
        when: Callable[[str], bool] = lambda name: True,
        times: int | None = None,
    ) -> None:
        """Call ``fn(target, name, *args)`` when ``operation`` is reached, before the backend
        runs it (for names ``when`` accepts, ``times`` times). ``target`` is the wrapped
        backend object: the inner :class:`Storage`, or for ``write``/``append``/``finish``
        the inner :class:`DataWriter`; ``args`` are the operation's own (``write``: start,
        end; ``append``: data, offset; ``open``: the image). ``fn`` may raise to fail the
        operation; it runs on the calling thread, which may be one of several at once."""
        self._add(operation, _Fault(hook=fn, when=when, remaining=times))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _add(self, operation: str, fault: _Fault) -> None:
        assert operation in OPERATIONS, operation
        with self._lock:
            self._faults.setdefault(operation, []).append(fault)

    def hit(self, operation: str, name: str, target: object, *args: object) -> None:
        with self._lock:
            self.calls.append((operation, name, threading.get_ident()))
            faults = list(self._faults.get(operation, []))
        for fault in faults:
            if not fault.when(name):
                continue
            with self._lock:
                if fault.remaining is not None:
                    if fault.remaining <= 0:
                        continue
                    fault.remaining -= 1
            if fault.gate is not None and not fault.gate.wait(GATE_TIMEOUT):
                raise TimeoutError(f"test gate on {operation} was never opened")
            if fault.hook is not None:
                fault.hook(target, name, *args)
            if fault.error is not None:
                raise fault.error

    def names(self, operation: str) -> list[str]:
        return [name for op, name, _ in self.calls if op == operation]


class FaultStorage(Storage):
    """``inner`` with :class:`Faults` applied before each operation reaches it."""

    def __init__(self, inner: Storage, faults: Faults | None = None) -> None:
        self.inner = inner
        self.faults = faults or Faults()
        self.url = inner.url
        self.small_reads_are_cheap = inner.small_reads_are_cheap
        self.splits_shared_reads = inner.splits_shared_reads

    def child(self, name: str) -> FaultStorage:
        return FaultStorage(self.inner.child(name), self.faults)

    def prepare(self) -> None:
        self.faults.hit("prepare", self.url, self.inner)
        self.inner.prepare()

    def open_writer(self, name: str, image: memoryview | int) -> DataWriter:
        self.faults.hit("open", name, self.inner, image)
        return _FaultWriter(self.inner.open_writer(name, image), name, self.faults)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.faults.hit("read", name, self.inner, offset, out)
        self.inner.read_into(name, offset, out)

    def size(self, name: str) -> int:
        self.faults.hit("size", name, self.inner)
        return self.inner.size(name)

    def get(self, name: str) -> bytes | None:
        self.faults.hit("get", name, self.inner)
        return self.inner.get(name)

    def put_atomic(self, name: str, data: bytes) -> None:
        self.faults.hit("put", name, self.inner, data)
        self.inner.put_atomic(name, data)

    def exists(self, name: str) -> bool:
        self.faults.hit("exists", name, self.inner)
        return self.inner.exists(name)

    def list_children(self) -> list[str]:
        self.faults.hit("list", self.url, self.inner)
        return self.inner.list_children()

    def delete(self, name: str) -> None:
        self.faults.hit("delete", name, self.inner)
        self.inner.delete(name)

    def delete_all(self) -> None:
        self.faults.hit("delete", self.url, self.inner)
        self.inner.delete_all()

    def cleanup_incomplete(self, keep: str | None = None) -> None:
        self.inner.cleanup_incomplete(keep)

    def discard_spares(self) -> None:
        self.inner.discard_spares()

    def close(self) -> None:
        self.inner.close()


class _FaultWriter(DataWriter):
    def __init__(self, inner: DataWriter, name: str, faults: Faults) -> None:
        self.inner = inner
        self.name = name
        self.faults = faults
        self.path = inner.path

    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        return self.inner.pieces(piece_bytes)

    def write(self, start: int, end: int) -> None:
        self.faults.hit("write", self.name, self.inner, start, end)
        self.inner.write(start, end)

    def write_at(self, offset: int, data: memoryview) -> None:
        self.faults.hit("write", self.name, self.inner, offset, offset + len(data))
        self.inner.write_at(offset, data)

    def append(self, data: memoryview, offset: int) -> None:
        self.faults.hit("append", self.name, self.inner, data, offset)
        self.inner.append(data, offset)

    def finish(self) -> None:
        self.faults.hit("finish", self.name, self.inner)
        self.inner.finish()

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()
