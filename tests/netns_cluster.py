"""A cluster on one machine: nodes that are network, PID and mount namespaces of their own.

:class:`Cluster` makes a bridge in a network namespace of its own and ``n`` nodes, each a
network namespace joined to the bridge by a veth link (address ``10.213.0.{i+1}`` on its
``eth0``, none on the machine's own network), with a PID and a mount namespace of its own
(its own ``/proc`` and an empty ``/dev/shm``), held by one ``sleep`` as the namespace's first
process. :func:`spawn` runs test ranks inside nodes: each rank is forked from the tests'
forkserver (``dist_utils``), enters its node's namespaces and forks once more, so its process
is a member of the node's PID namespace (and dies with it).

The faults a node has: :meth:`Node.cut` takes its link down (no process exits, no
connection is reset: to its peers the node has vanished), :meth:`Node.freeze` stops every
process of it with ``SIGSTOP``, :meth:`Node.kill` kills its namespace's first process, and
with it every process of the node.

:func:`unavailable` says why namespaces cannot be made here (not root, no ``ip``); the tests
skip with that line, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from dist_utils import supervise, worker_context

#: Where a rank in a node marks the moment of its fault (:func:`trigger`); the test's
#: :class:`Fault` watches it from outside (the nodes share the machine's file system).
MARKS_ENV = "SLIPSTREAM_TEST_CLUSTER_MARKS"

SUBNET = "10.213.0"
STORE_PORT = 29511
#: The interface of every node, for torch's own gloo groups (``GLOO_SOCKET_IFNAME``).
INTERFACE = "eth0"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why nodes cannot be made on this machine, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "the cluster tests make network and PID namespaces, which needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the cluster tests need {tool!r} (iproute2 / util-linux)"
    return None


def require_namespaces() -> None:
    """Skip the calling test where nodes cannot be made, except in CI (it fails there)."""
    why = unavailable()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the cluster tests: {why}")
    pytest.skip(why)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Node:
    """One node of a :class:`Cluster`: its namespaces, its address and its faults."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        self.index = index
        self.addr = f"{SUBNET}.{index + 1}"
        self.netns = f"{cluster.name}-n{index}"
        self._bridge_ns = cluster.bridge_ns
        self._port = f"b{index}"
        _ip("netns", "add", self.netns)
        _ip("-n", self._bridge_ns, "link", "add", self._port, "type", "veth", "peer", "name",
            INTERFACE, "netns", self.netns)  # fmt: skip
        _ip("-n", self._bridge_ns, "link", "set", self._port, "master", "br0", "up")
        _ip("-n", self.netns, "addr", "add", f"{self.addr}/24", "dev", INTERFACE)
        _ip("-n", self.netns, "link", "set", INTERFACE, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        self._holder = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--mount", "--fork",
             "--mount-proc", "--propagation", "private", "sh", "-c",
             "mount -t tmpfs -o size=2g tmpfs /dev/shm && exec sleep infinity"],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.pid = self._first_process()

    def _first_process(self, timeout: float = 20.0) -> int:
        """The outside pid of the node's first process, once it is the ``sleep`` (so its
        ``/dev/shm`` is mounted)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in _descendants(self._holder.pid):
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        if f.read().strip() == "sleep":
                            return pid
                except OSError:
                    continue
            if self._holder.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"node {self.index}'s namespaces did not come up within {timeout} s")

    def processes(self) -> list[int]:
        """The outside pids of every process in the node's PID namespace."""
        try:
            mine = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return []
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.readlink(f"/proc/{name}/ns/pid") == mine:
                        found.append(int(name))
                except OSError:
                    continue
        return found

    def cut(self) -> None:
        """Take the node's link down: it vanishes from the network, its processes run on."""
        _ip("-n", self._bridge_ns, "link", "set", self._port, "down")

    def heal(self) -> None:
        _ip("-n", self._bridge_ns, "link", "set", self._port, "up")

    def freeze(self) -> None:
        """Stop every process of the node (``SIGSTOP``)."""
        for pid in self.processes():
            _signal(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.processes():
            _signal(pid, signal.SIGCONT)

    def kill(self) -> None:
        """Kill the node whole: its first process, and with it every process of its PID
        namespace."""
        _signal(self.pid, signal.SIGKILL)

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Run ``argv`` inside the node's namespaces (a server of the test's, say)."""
        enter = ["nsenter", "-t", str(self.pid), "-n", "-m", "-p", f"--wd={os.getcwd()}"]
        return subprocess.Popen([*enter, *argv], **kwargs)

    def close(self) -> None:
        self.thaw()
        self.kill()
        self._holder.wait(10)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


class Cluster:
    """``n`` nodes on a bridge of their own (see the module doc); a context manager that
    takes every namespace down again."""

    def __init__(self, n: int) -> None:
        self.name = f"ss{uuid.uuid4().hex[:6]}"
        self.bridge_ns = f"{self.name}-br"
        self.nodes: list[Node] = []
        _ip("netns", "add", self.bridge_ns)
        try:
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(n):
                self.nodes.append(Node(self, i))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        subprocess.run(["ip", "netns", "del", self.bridge_ns], capture_output=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FAULTS = ("cut", "freeze", "kill")


def trigger(name: str) -> None:
    """From inside a node: the fault named ``name`` is due now (:class:`Fault`), and this
    process waits for it (returns only if the fault is not one that stops it)."""
    path = os.path.join(os.environ[MARKS_ENV], f"trigger-{name}")
    with open(path + ".tmp", "w") as f:
        f.write(str(time.monotonic()))
    os.rename(path + ".tmp", path)


def wait_forever() -> None:
    """Block a rank whose node is being faulted until the test ends it."""
    while True:
        time.sleep(1)


class Fault:
    """A thread that, when a rank calls :func:`trigger` with ``name``, applies ``kind`` (one
    of :data:`FAULTS`) to ``node`` and records the moment (:attr:`at`, ``time.monotonic()``,
    the clock every namespace shares); once every rank of ``survivors`` has reported done
    (:func:`spawn` marks it) or ``linger`` seconds passed, it kills the node so the run ends.
    """

    def __init__(
        self, marks: str, name: str, node: Node, kind: str, survivors: Sequence[int],
        linger: float = 60.0,
    ) -> None:  # fmt: skip
        if kind not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {kind!r}")
        self.at: float | None = None
        self._marks, self._name, self._node, self._kind = marks, name, node, kind
        self._survivors, self._linger = list(survivors), linger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fault-{name}")
        self._thread.start()

    def _run(self) -> None:
        path = os.path.join(self._marks, f"trigger-{self._name}")
        while not os.path.exists(path):
            if self._stop.wait(0.005):
                return
        if self._kind == "cut":
            self._node.cut()
        elif self._kind == "freeze":
            self._node.freeze()
        else:
            self._node.kill()
        self.at = time.monotonic()
        end = self.at + self._linger
        done = [os.path.join(self._marks, f"done-{r}") for r in self._survivors]
        while time.monotonic() < end and not all(map(os.path.exists, done)):
            if self._stop.wait(0.05):
                break
        self._node.kill()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        found += kids
        todo += kids
    return found


def _enter(node_pid: int) -> None:
    """Move this (single-threaded) process into the network and mount namespaces of the
    node whose first process is ``node_pid``; its children are born in the node's PID
    namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    cwd = os.getcwd()
    kinds = {"pid": _CLONE_NEWPID, "net": _CLONE_NEWNET, "mnt": _CLONE_NEWNS}
    fds = {kind: os.open(f"/proc/{node_pid}/ns/{kind}", os.O_RDONLY) for kind in kinds}
    try:
        for kind, flag in kinds.items():
            if libc.setns(fds[kind], flag) != 0:
                err = ctypes.get_errno()
                why = os.strerror(err)
                raise OSError(err, f"setns({kind}) into node process {node_pid}: {why}")
    finally:
        for fd in fds.values():
            os.close(fd)
    os.chdir(cwd)


def _entry(fn, rank, node_pid, store_addr, args, results, environ):
    """A rank's process: enter the node, fork into its PID namespace, run ``fn`` there."""
    try:
        _enter(node_pid)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        os._exit(1)
    child = os.fork()
    if child == 0:
        os.environ.update(environ)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
        try:
            import torch

            torch.set_num_threads(1)
            results.put((rank, "ok", fn(rank, store_addr, STORE_PORT, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        marks = os.environ.get(MARKS_ENV)
        if marks:
            open(os.path.join(marks, f"done-{rank}"), "w").close()
        os._exit(0)
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def spawn(
    cluster: Cluster,
    fn: Callable[..., Any],
    placement: Sequence[int],
    *args: Any,
    timeout: float = 90.0,
    may_die: Sequence[int] = (),
    environ: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``fn(rank, store_addr, store_port, *args)`` for every rank, rank ``r`` on node
    ``placement[r]``; ``store_addr`` is node 0's address. Returns ``{rank: value}``; a rank
    in ``may_die`` (on a node the test faults) may end without one. ``environ`` is added to
    every rank's environment (pass :data:`MARKS_ENV` for :class:`Fault`)."""
    ctx = worker_context()
    results = ctx.SimpleQueue()
    store_addr = cluster.nodes[0].addr
    extra = dict(environ or {})

    def start(rank: int, life: int):
        node = cluster.nodes[placement[rank]]
        p = ctx.Process(
            target=_entry,
            args=(fn, rank, node.pid, store_addr, args, results, extra),
            daemon=True,
        )
        p.start()
        return p

    out, _ = supervise(start, len(placement), results, timeout)
    missing = [r for r in range(len(placement)) if r not in out and r not in may_die]
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result")
    return out
