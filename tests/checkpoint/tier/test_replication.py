"""One step's copies between two ranks (:class:`StepReplication` over a :class:`TierLink`),
each rank's node a directory of its own: the bytes arrive whole, and a failure on either
end becomes a no in the exchanges, so the other end returns at once instead of waiting.

- Both files copied: each rank's replica is byte for byte the other's file.
- The receiver cannot make room (``posix_fallocate`` fails with ENOSPC, as a full
  ``/dev/shm`` does): its error names the file and the OS's reason, nothing is left under
  the file's name, and the sender's part succeeds.
- The sender's part failed before it sends: the receiver gets nothing and no error, the
  sender's own error comes back first.
"""

from __future__ import annotations

import errno
import os
import time

import torch.distributed as dist
from dist_utils import run_workers

from slipstream.checkpoint.save.channel import RankChannel
from slipstream.checkpoint.storage import LocalStorage
from slipstream.checkpoint.tier.link import TierLink
from slipstream.checkpoint.tier.nodes import NodeMap
from slipstream.checkpoint.tier.replication import StepReplication, step_copies
from slipstream.core.waits import Deadline

TIMEOUT = 30.0
SIZE = 3 * 2**20 + 17


def _payload(rank: int) -> bytes:
    return bytes((i * 7 + rank) % 251 for i in range(SIZE))


def _copy_once(rank: int, world: int, base: str) -> None:
    location = LocalStorage(os.path.join(base, f"node{rank}", "step_1"), direct_io=False)
    location.prepare()
    with open(os.path.join(location.path, f"__{rank}_0.distcp"), "wb") as f:
        f.write(_payload(rank))
    store = dist.distributed_c10d._get_default_store()
    channel = RankChannel(dist.PrefixStore("replication-test", store), rank, world, "ns")
    link = TierLink(channel, TIMEOUT)
    copies = [c for c in step_copies(NodeMap.from_ranks_per_node(2, 1), 1) if "distcp" in c.file]
    replica = os.path.join(location.path, f"__{1 - rank}_0.distcp")

    def step(failed: str | None = None) -> tuple[list[str], float]:
        if os.path.exists(replica):
            os.remove(replica)
        dist.barrier()
        started = time.monotonic()
        errors = StepReplication(link, copies, rank, location, "step_1", failed).run(
            Deadline(TIMEOUT)
        )
        return errors, time.monotonic() - started

    errors, _ = step()
    assert errors == [], errors
    with open(replica, "rb") as f:
        assert f.read() == _payload(1 - rank)

    real = os.posix_fallocate
    if rank == 1:

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
    try:
        errors, took = step()
    finally:
        os.posix_fallocate = real
    if rank == 1:
        assert len(errors) == 1 and "could not store rank 0's step_1/__0_0.distcp" in errors[0]
        assert "No space left on device" in errors[0], errors
        assert not os.path.exists(replica)
    else:
        assert errors == [], errors
        with open(replica, "rb") as f:
            assert f.read() == _payload(1)
    assert took < TIMEOUT / 3, took

    errors, took = step("rank 0: RuntimeError: its part failed" if rank == 0 else None)
    if rank == 0:
        assert errors == ["rank 0: RuntimeError: its part failed"], errors
    else:
        assert errors == [] and not os.path.exists(replica), errors
    assert took < TIMEOUT / 3, took
    link.close()
    channel.close()


def test_copies_arrive_whole_and_a_failure_on_either_end_is_a_no_not_a_silence(tmp_path):
    run_workers(_copy_once, 2, str(tmp_path), timeout=90)
