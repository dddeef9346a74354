"""Which node each rank runs on, and which ranks hold a rank's replicas.

Replicas follow NVRx's clique idea: rank ``r``'s ``j``-th replica lives on the node ``j``
nodes after its own (cyclically), on the rank with the same local index there. With
``replicas`` below the number of nodes, a rank's data and its replicas sit on
``replicas + 1`` distinct nodes, so losing any ``replicas`` nodes loses no rank's data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeMap:
    """``node_of[r]`` is rank ``r``'s node (numbered from 0 in order of first rank)."""

    node_of: tuple[int, ...]

    @classmethod
    def from_ranks_per_node(cls, world_size: int, ranks_per_node: int) -> NodeMap:
        """Consecutive blocks of ``ranks_per_node`` ranks per node (torchrun's layout)."""
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        return cls(tuple(r // ranks_per_node for r in range(world_size)))

    @classmethod
    def from_hosts(cls, hosts: Sequence[str]) -> NodeMap:
        """One node per distinct host name, numbered in order of their first rank."""
        numbers: dict[str, int] = {}
        return cls(tuple(numbers.setdefault(h, len(numbers)) for h in hosts))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        return max(self.node_of) + 1 if self.node_of else 0

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        """The lowest rank of ``node``: the one that writes its markers and deletes old steps."""
        return self.ranks_on(node)[0]

    def replica_ranks(self, rank: int, replicas: int) -> list[int]:
        """The ranks holding ``rank``'s replicas, one per node, none on ``rank``'s node."""
        if replicas >= self.nodes and replicas > 0:
            raise ValueError(
                f"replicas={replicas} needs more than {replicas} nodes; this job has "
                f"{self.nodes} (set ranks_per_node to say how ranks map to nodes)"
            )
        node = self.node_of[rank]
        index = self.ranks_on(node).index(rank)
        peers = []
        for j in range(1, replicas + 1):
            there = self.ranks_on((node + j) % self.nodes)
            peers.append(there[index % len(there)])
        return peers
