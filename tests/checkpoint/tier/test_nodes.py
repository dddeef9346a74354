"""Replica placement: a rank's replicas sit on other nodes, one per node, so that losing
any ``replicas`` nodes leaves a copy of every rank's file."""

from __future__ import annotations

import itertools

import pytest

from slipstream.checkpoint.tier.nodes import NodeMap


@pytest.mark.parametrize(("world", "per_node", "replicas"), [(4, 2, 1), (8, 2, 2), (6, 3, 1)])
def test_losing_any_replicas_nodes_leaves_a_copy_of_every_rank(world, per_node, replicas):
    nodes = NodeMap.from_ranks_per_node(world, per_node)
    for lost in itertools.combinations(range(nodes.nodes), replicas):
        for rank in range(world):
            holders = [rank, *nodes.replica_ranks(rank, replicas)]
            assert len({nodes.node_of[r] for r in holders}) == replicas + 1
            assert any(nodes.node_of[r] not in lost for r in holders), (rank, lost)


def test_nodes_from_host_names_and_too_few_nodes_for_the_replicas():
    nodes = NodeMap.from_hosts(["b", "b", "a", "a"])
    assert nodes.node_of == (0, 0, 1, 1) and nodes.leader(1) == 2
    assert nodes.replica_ranks(1, 1) == [3]
    with pytest.raises(ValueError, match="replicas=1 needs more than 1 nodes"):
        NodeMap.from_hosts(["a", "a"]).replica_ranks(0, 1)
