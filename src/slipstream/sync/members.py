"""A rank's process as the sync group knows it, and whether it still runs: :class:`Member`.

Every rank posts, when it joins, where it runs (:func:`host_identity`), its pid and when
that process started (:func:`process_start`); a rank on this host is judged by its process
(:func:`process_alive`), one elsewhere by its heartbeat (:mod:`.liveness`).

Invariant: a pid that now names a later process never counts as the member's.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass


def host_identity() -> str:
    """Where this process runs: hostname, boot id, PID namespace and ``/dev/shm``.

    Two processes have equal identities exactly when they share a kernel, see each other's
    pids (so one can judge the other's liveness by its pid, and read its memory) and share
    ``/dev/shm`` (so a ring file one maps the other can map): containers and pods on one
    machine share the hostname and the boot id, not the namespaces.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pid_space = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_space = ""
    try:
        shm = f"shm:{os.stat('/dev/shm').st_dev}"
    except OSError:
        shm = ""
    return f"{socket.gethostname()}/{boot}/{pid_space}/{shm}"


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/{pid}/stat`` after the command name (state first), or
    ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` of this host started (clock ticks since boot): a pid reused by a
    later process has a later start. ``None`` where it cannot be read."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


@dataclass(frozen=True)
class Member:
    """One rank's current process: its host identity (:func:`host_identity`), pid, start
    (:func:`process_start`) and incarnation (1 for the first process at that rank, 2 for the
    one that replaced it, ...)."""

    host: str
    pid: int
    incarnation: int
    start: int | None = None

    @classmethod
    def of_hello(cls, raw: bytes) -> Member:
        """The member a rank's hello (posted by :func:`~.group.init_group`) describes."""
        hello = json.loads(raw)
        return cls(hello["host"], hello["pid"], hello["incarnation"], hello.get("start"))

    def gone(self) -> str | None:
        """Why this member's process is gone, judged from this host (which must be the
        member's): it exited, or its pid now names a later process; ``None`` while it runs."""
        if not process_alive(self.pid, self.start):
            return f"its process (pid {self.pid}) is gone"
        return None


def process_alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` of this host still runs (possibly another user's) and, with
    ``start``, is the process that started then (:func:`process_start`), not a later one
    given the same pid. One that exited but was not yet reaped (a zombie) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    if not fields:
        return True
    if fields[0] in ("Z", "X"):
        return False
    return start is None or len(fields) <= 19 or int(fields[19]) == start
