"""Replica placement: a rank's replicas sit on other nodes, one per node, so that losing
any ``replicas`` nodes leaves a copy of every rank's file; the copies a step makes."""

from __future__ import annotations

import itertools

import pytest

from slipstream.checkpoint.tier.nodes import NodeMap
from slipstream.checkpoint.tier.options import LocalTier
from slipstream.checkpoint.tier.replication import step_copies


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


def test_step_copies_send_each_file_to_its_replicas_and_rank_0s_small_files_to_every_node():
    nodes = NodeMap.from_ranks_per_node(6, 2)  # nodes {0, 1}, {2, 3}, {4, 5}
    copies = step_copies(nodes, 1)
    data = {(c.sender, c.receiver) for c in copies if c.file.endswith(".distcp")}
    assert data == {(r, nodes.replica_ranks(r, 1)[0]) for r in range(6)}
    for small in (".metadata", ".slipstream.json"):
        # rank 0's replica rank, and the lowest rank of every other node
        assert sorted(c.receiver for c in copies if c.file == small) == [2, 4]
        assert {c.sender for c in copies if c.file == small} == {0}
    assert step_copies(nodes, 0) == []


def test_the_peer_links_host_option_is_ignored_with_a_warning():
    with pytest.warns(DeprecationWarning, match="LocalTier.host is ignored"):
        LocalTier(host="10.0.0.1")
