"""A rollout on the shared-memory ring that refuses a version (its ``load_weights`` raises:
it posts the refusal in its acknowledgement) and exits at once is reported to the trainer by
its refusal, naming it and its reason, even when the trainer finds its process gone before
it reads what the rollout posted: what a peer posted before it exited wins over its
death."""

from __future__ import annotations

import os
import select
from unittest import mock

import pytest
from sync_procs import long_transfer as weights
from sync_procs import spawn

import slipstream as ss
from slipstream.errors import PeerDiedError
from slipstream.sync.transport import shm

BUCKET = 64 * 1024
REFUSAL = "the engine refused the weights"


def _publish_error(group) -> str:
    """Publish version 1 to rollout 1 over shared memory; the error it fails with."""
    pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, transport="shm")
    try:  # direct: the break may come while publish() still packs
        error = pub.publish(weights(1), version=1).delivered.exception(timeout=60)
    except (ss.SyncError, PeerDiedError) as exc:
        error = exc
    pub.close()
    return f"{type(error).__name__}: {error}"


def _engine_load_weights(batch):
    raise ValueError(REFUSAL)


def _once_exited(pid: int) -> None:
    """Return once process ``pid`` (not a child of ours) has exited, within 30 s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        readable, _, _ = select.select([fd], [], [], 30)
    finally:
        os.close(fd)
    assert readable, f"process {pid} did not exit within 30 s"


def _refuses_then_exits(rank, port):
    """Rollout 1 refuses version 1 (its ``load_weights`` raises on the first batch, so it
    posts its refusal) and exits at once. Every look the trainer's ring takes at its process
    waits until that process has exited: the first look finds it gone."""
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=120)
    if rank == 0:
        alive = shm.process_alive

        def looked_at_once_exited(pid, *args):
            _once_exited(pid)
            return alive(pid, *args)

        with mock.patch.object(shm, "process_alive", looked_at_once_exited):
            out = _publish_error(group)
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1])
    with pytest.raises(ValueError, match=REFUSAL):
        sub.receive(_engine_load_weights)
    os._exit(0)  # at once: no goodbye, no close


def test_a_rollout_that_refuses_a_version_on_shm_and_exits_is_reported_by_its_refusal():
    out = spawn(_refuses_then_exits, 2, timeout=90, may_die=(1,))
    assert not out[0].startswith(PeerDiedError.__name__), out[0]
    assert f"rollout rank 1: {REFUSAL}" in out[0], out[0]
