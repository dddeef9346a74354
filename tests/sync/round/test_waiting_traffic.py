"""A rollout waiting for a round asks its store about once a second, not dozens of times.

Three processes of one sync group on this host: rank 0 hosts the store, rank 1 is the lead
trainer, rank 2 a rollout that waits (as :meth:`.RolloutRound.join` does) for the round the
lead starts. While it waits, every ``torch.distributed.Store`` call of the rollout's process
is counted (``TCPStore`` and ``PrefixStore`` patched at class level), the beats of its
heartbeat thread apart, and what the process writes to stderr is kept: a wait must not log
(c10d logs each ``store.wait`` that times out). A lead that dies while the rollout waits is
still named at once.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from sync_procs import spawn

WAIT_S = 4.0
ROUND_KEY_RANK = 1


def _count_calls() -> tuple[Counter[str], list[Any]]:
    """Patch the store classes so that every call, from any thread but the heartbeat's, is
    counted by method; returns the counter and what to put back."""
    import torch.distributed as dist

    calls: Counter[str] = Counter()
    lock = threading.Lock()
    saved = []
    for cls in (dist.TCPStore, dist.PrefixStore):
        for name in ("add", "append", "check", "compare_set", "get", "multi_get", "set", "wait"):
            original = getattr(cls, name)
            saved.append((cls, name, original))

            def counted(store, *args, _original=original, _name=name, **kwargs):
                if threading.current_thread().name != "slipstream-heartbeat":
                    with lock:
                        calls[_name] += 1
                return _original(store, *args, **kwargs)

            setattr(cls, name, counted)
    return calls, saved


def _waiting_rank(rank: int, port: int, lead_dies: bool) -> Any:
    from slipstream.errors import PeerDiedError
    from slipstream.sync.group import init_group
    from slipstream.sync.round.protocol import Keys

    group = init_group("127.0.0.1", port, 3, rank, timeout=60.0)
    channel = group.open_channel("traffic", [1], [2])
    if rank == 0:
        channel.get_text("done", 2, "the rollout to finish", 60.0)
        group.close()
        return None
    if rank == 1:
        channel.get_text("waiting", 2, "the rollout to wait", 60.0)
        time.sleep(WAIT_S)
        if lead_dies:
            os._exit(0)
        channel.post(Keys.round(0), "started")
        group.close()
        return None
    calls, saved = _count_calls()
    err = tempfile.TemporaryFile()
    stderr = os.dup(2)
    os.dup2(err.fileno(), 2)
    began = time.monotonic()
    channel.post("waiting", "1")
    try:
        text = channel.get_text(Keys.round(0), ROUND_KEY_RANK, "the lead to start round 0", 60.0)
        outcome: Any = text.decode()
    except PeerDiedError as exc:
        outcome = (exc.ranks, str(exc))
    waited = time.monotonic() - began
    os.dup2(stderr, 2)
    for cls, name, original in saved:
        setattr(cls, name, original)
    err.seek(0)
    logged = err.read().decode(errors="replace")
    channel.post("done", "1")
    group.close()
    return outcome, dict(calls), waited, logged


def test_a_waiting_rollout_asks_about_once_a_second_and_logs_nothing() -> None:
    out = spawn(_waiting_rank, 3, False, timeout=90.0)
    outcome, calls, waited, logged = out[2]
    assert outcome == "started"
    assert waited >= WAIT_S - 0.5, waited
    per_second = sum(calls.values()) / waited
    assert per_second <= 2.0, f"{per_second:.1f} store calls per second while waiting: {calls}"
    assert logged == "", logged


def test_a_lead_that_dies_while_a_rollout_waits_is_named_at_once() -> None:
    out = spawn(_waiting_rank, 3, True, timeout=90.0, may_die=(1,))
    outcome, calls, waited, logged = out[2]
    ranks, message = outcome
    assert ranks == [1] and "rank(s) [1] died" in message, message
    assert waited < WAIT_S + 2.0, waited  # the process is gone: found within a look or two
    assert logged == "", logged
