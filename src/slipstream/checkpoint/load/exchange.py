"""The process group a read-once load moves bytes over.

slipstream makes a gloo group of its own for this (``torch.distributed.new_group``), never
using the job's: its collectives run on the caller's thread, during a load every rank of
the group calls together, so they can never interleave with the job's own collectives or
run from a background thread. A group is made once per set of ranks of one world (the
default group's store names the world: a job that destroys and re-creates its process
groups gets a new one) and only by a load whose ranks share bytes; a shared load that
fails drops it on every rank (:func:`forget_group`), so none reuses a group a failure may
have left mid-collective.

Invariant: every operation on the group is bounded by the load's timeout (the group's).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ...core.gloo_groups import new_gloo_group

DEFAULT_TIMEOUT_S = 600.0
"""The group's timeout where the load has none."""


_groups: dict[tuple[int, ...], tuple[Any, dist.ProcessGroup]] = {}
_groups_lock = threading.Lock()


def exchange_group(global_ranks: Sequence[int], timeout: float | None) -> dist.ProcessGroup:
    """slipstream's gloo group over ``global_ranks`` (every one of them calls this together,
    on its caller's thread), made on first use in this world."""
    ranks = tuple(global_ranks)
    store = dist.distributed_c10d._get_default_store()
    with _groups_lock:
        found = _groups.get(ranks)
        if found is not None and found[0] is store:
            return found[1]
    group = new_gloo_group(
        ranks, DEFAULT_TIMEOUT_S if timeout is None else timeout, "slipstream_read_once"
    )
    with _groups_lock:
        _groups[ranks] = (store, group)
    return group


def forget_group(global_ranks: Sequence[int]) -> None:
    """Drop (and destroy) the group over ``global_ranks``, after a load that may have left
    it with a collective half done; the next load that shares bytes makes a new one. Every
    rank calls it together (each saw the same load fail), so all make the new one."""
    with _groups_lock:
        found = _groups.pop(tuple(global_ranks), None)
    if found is not None and found[0] is dist.distributed_c10d._get_default_store():
        dist.destroy_process_group(found[1])


def gather_objects(group: dist.ProcessGroup, own: Any) -> list[Any]:
    """Every rank's ``own``, by rank of ``group``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, own, group=group)
    return out
