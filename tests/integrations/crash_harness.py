"""Crash-anywhere trials: training runs killed with SIGKILL at a random point of a save in
flight, each next run resuming, through the integration's own resume path, from what the
last one left.

A *run* is a training function ``fn(report, root, steps)`` forked from a zygote: a process
that imported torch and the frameworks once (importing them costs seconds, a fork
milliseconds) and runs no torch operation itself, so forking it is safe. A run calls
``report`` with:

- ``("resumed", step, digest, checkpoint, complete)`` once, after its resume (``step`` 0
  and ``checkpoint`` ``None`` when it found nothing to resume from): the step it resumed
  at, the digest of the training state it loaded, the checkpoint it loaded and whether
  that was complete (committed) when it was loaded;
- ``("step", step, digest)`` after each optimizer step;
- ``("saved", step)`` when a save call has returned (its write is in flight);
- ``("done", digest)`` at the end of training, after every save finished.

:func:`crash_trials` first runs ``fn`` once without a kill (the reference: the digest of
the training state after each step), then runs it again and again in one directory, each
run killed after a random number of saves and a random delay, the next run resuming; a run
that reaches the end starts a new chain in a new directory. It checks that every resume
loaded a complete checkpoint (``complete(checkpoint)``) whose state equals, bit for bit,
the reference's state at that step, and that every chain ends bit-exact with the
reference.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from dist_utils import worker_context


def state_digest(*objects: Any) -> str:
    """A digest of the tensors (and plain values) of modules' and optimizers' state."""
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                feed(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                feed(v)
        else:
            h.update(repr(value).encode())

    for obj in objects:
        feed(obj.state_dict() if hasattr(obj, "state_dict") else obj)
    return h.hexdigest()


def _zygote(conn: Any, modules: list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)
    while True:
        request = conn.recv()
        if request is None:
            return
        fn, args = request
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = _child(write, fn, args)
            os._exit(code)
        os.close(write)
        conn.send(("pid", pid))
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                conn.send(("line", line))
        _, status = os.waitpid(pid, 0)
        conn.send(("exit", status))


def _child(write: int, fn: Callable[..., None], args: tuple[Any, ...]) -> int:
    torch.set_num_threads(1)

    def report(*message: Any) -> None:
        os.write(write, (repr(message) + "\n").encode())

    try:
        fn(report, *args)
        return 0
    except BaseException:
        report("error", traceback.format_exc())
        return 1


@dataclass
class RunResult:
    messages: list[tuple[Any, ...]] = field(default_factory=list)
    killed: bool = False
    status: int = 0

    def first(self, kind: str) -> tuple[Any, ...] | None:
        return next((m for m in self.messages if m[0] == kind), None)


class Zygote:
    """A forked-from process holding ``modules`` imported; :meth:`run` forks one run."""

    def __init__(self, modules: list[str]) -> None:
        ctx = worker_context()
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_zygote, args=(child, modules), daemon=True)
        self._process.start()
        child.close()

    def run(
        self,
        fn: Callable[..., None],
        args: tuple[Any, ...],
        kill_after: tuple[int, float] | None,
        timeout: float,
    ) -> RunResult:
        """Run ``fn(report, *args)``; with ``kill_after=(n, delay)``, SIGKILL it ``delay``
        seconds after its ``n``-th save call returned. ``killed`` says whether the run died
        of that SIGKILL (its exit status), not whether one was sent: a run may end on its
        own just before."""
        import ast

        self._conn.send((fn, args))
        deadline = time.monotonic() + timeout
        result = RunResult()
        process: int | None = None
        kill_at = None
        kill_sent = False
        saves = 0
        try:
            while True:
                wait = deadline - time.monotonic()
                if kill_at is not None and not kill_sent:
                    wait = min(wait, max(0.0, kill_at - time.monotonic()))
                if self._conn.poll(max(0.0, wait)):
                    kind, value = self._conn.recv()
                    if kind == "pid":
                        process = _open_process(value)
                    elif kind == "line":
                        try:
                            message = ast.literal_eval(value.decode())
                        except (SyntaxError, ValueError):  # cut by the kill
                            continue
                        result.messages.append(message)
                        if message[0] == "saved" and kill_after is not None and kill_at is None:
                            saves += 1
                            if saves == kill_after[0]:
                                kill_at = time.monotonic() + kill_after[1]
                    else:
                        result.status = value
                        result.killed = (
                            os.WIFSIGNALED(value) and os.WTERMSIG(value) == signal.SIGKILL
                        )
                        return result
                elif kill_at is not None and time.monotonic() >= kill_at and not kill_sent:
                    _kill(process)
                    kill_sent = True
                elif time.monotonic() >= deadline:
                    _kill(process)
                    raise AssertionError(f"run {fn.__name__}{args} did not finish in {timeout} s")
        finally:
            if process is not None:
                os.close(process)

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)


def _open_process(pid: int) -> int | None:
    """A handle on a run's process (a pidfd) that no other process can take over once the
    zygote has reaped it and its pid is free again; ``None`` if it is already gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _kill(process: int | None) -> None:
    """SIGKILL a run's process, unless it has already ended."""
    if process is None:
        return
    try:
        signal.pidfd_send_signal(process, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _errors(result: RunResult) -> str:
    return "\n".join(m[1] for m in result.messages if m[0] == "error")


@dataclass
class TrialReport:
    kills: int = 0
    chains: int = 0
    cut_short: int = 0
    """Kills after which a save was found cut short (an incomplete checkpoint on disk)."""
    resumed_at: list[int] = field(default_factory=list)


def crash_trials(
    zygote: Zygote,
    fn: Callable[..., None],
    base: str,
    steps: int,
    *,
    trials: int,
    seed: int,
    cut_short: Callable[[str], bool],
    max_delay: float,
    timeout: float = 120.0,
) -> TrialReport:
    """Run the trials (see the module's docstring) under ``base``; return what happened.
    ``cut_short(root)`` says whether a killed run left a save cut short in ``root``."""
    reference = zygote.run(fn, (os.path.join(base, "reference"), steps), None, timeout)
    assert reference.status == 0, _errors(reference)
    digests = {0: None} | {m[1]: m[2] for m in reference.messages if m[0] == "step"}
    done = reference.first("done")
    assert done is not None and len(digests) == steps + 1, reference.messages
    final = done[1]

    rng = random.Random(seed)
    report = TrialReport()
    chain_root = None
    while report.kills < trials or chain_root is not None:
        if chain_root is None:
            chain_root = os.path.join(base, f"chain{report.chains}")
            report.chains += 1
        kill = (rng.randint(1, 3), rng.uniform(0, max_delay)) if report.kills < trials else None
        result = zygote.run(fn, (chain_root, steps), kill, timeout)
        resumed = result.first("resumed")
        assert resumed is not None, (result.messages, _errors(result))
        _, step, digest, checkpoint, complete = resumed
        if step:
            assert checkpoint is not None and complete, (
                f"run resumed at step {step} from {checkpoint}, which is not complete"
            )
            assert digest == digests[step], (
                f"the state resumed at step {step} from {checkpoint} differs from the "
                "uninterrupted run's at that step"
            )
            report.resumed_at.append(step)
        if result.killed:
            report.kills += 1
            report.cut_short += cut_short(chain_root)
            continue
        assert result.status == 0, _errors(result)
        end = result.first("done")
        assert end is not None and end[1] == final, "the resumed run did not end bit-exact"
        chain_root = None
    return report
