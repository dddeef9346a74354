"""Process groups of slipstream's own: gloo, over ranks of the job's world.

slipstream moves checkpoint bytes between ranks (read-once loads, local-tier replicas) on
groups it makes for itself, never on the job's: a group of its own is used only by the
slipstream piece that made it, so its collectives and point-to-point transfers can never
interleave with the job's own, whichever thread runs them. Such a group is made by every
rank of it together, on the callers' threads (``torch.distributed.new_group``), and lives
inside the job's trust boundary: its connections are set up through the job's store, as
every group of the job's is.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist


def new_gloo_group(global_ranks: Sequence[int], timeout: float, desc: str) -> dist.ProcessGroup:
    """A new gloo group over ``global_ranks`` (every one of them calls this together, in
    the same order relative to its other groups); ``timeout`` bounds each of its
    operations, ``desc`` names it in torch's logs."""
    ranks = sorted(global_ranks)
    whole = ranks == list(range(dist.get_world_size()))
    group: dist.ProcessGroup | None = dist.new_group(
        ranks,
        timeout=timedelta(seconds=timeout),
        backend="gloo",
        use_local_synchronization=not whole,
        group_desc=desc,
    )
    assert group is not None, "every rank calling is a member"
    return group
