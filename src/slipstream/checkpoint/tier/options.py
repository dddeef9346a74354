"""The options of a :class:`~slipstream.Checkpointer`'s local tier, and where a node's
local tier lives by default (docs/two-tiers.md)."""

from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass

from ..storage import Storage

DEFAULT_SHM = "/dev/shm/slipstream"


@dataclass
class LocalTier:
    """Options of a :class:`~slipstream.Checkpointer`'s local tier (docs/two-tiers.md)."""

    root: str | os.PathLike[str] | Storage | None = None
    """This node's directory (or a :class:`Storage`); ``None``: a directory under
    ``/dev/shm/slipstream`` named after the durable root, so that a restarted job finds it."""
    every: int = 1
    """Save every ``every``-th step to the local tier."""
    keep_last: int = 2
    """Committed local steps each node keeps (its own files and the replicas it holds)."""
    replicas: int = 1
    """Peer ranks on other nodes holding a copy of each rank's file: the job survives the
    loss of that many nodes. Needs more nodes than ``replicas``."""
    ranks_per_node: int | None = None
    """Ranks per node, consecutive (torchrun's layout); ``None``: ranks on one host name
    are one node. Set it to stand several nodes in on one machine."""
    host: str | None = None
    """Deprecated and ignored: replicas move over a gloo group of the tier's own, which
    connects as the job's gloo groups do (``GLOO_SOCKET_IFNAME`` picks the interface)."""
    timeout: float | None = None
    """Seconds a peer may take to answer; ``None``: the saves' timeout."""

    def __post_init__(self) -> None:
        for name in ("every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"LocalTier.{name} must be >= 1, got {getattr(self, name)}")
        if self.replicas < 0:
            raise ValueError(f"LocalTier.replicas must be >= 0, got {self.replicas}")
        if self.host is not None:
            warnings.warn(
                "LocalTier.host is ignored: the local tier has no listener of its own any "
                "more (replicas ride a gloo group; GLOO_SOCKET_IFNAME picks the interface)",
                DeprecationWarning,
                stacklevel=3,
            )


def default_root(durable_url: str) -> str:
    """The node directory a job with durable root ``durable_url`` uses by default."""
    return os.path.join(DEFAULT_SHM, hashlib.sha1(durable_url.encode()).hexdigest()[:16])
