"""Which transports a trainer offers its rollouts, by where they are and what the host allows
(no processes)."""

from __future__ import annotations

import pytest
import torch


def test_shared_memory_is_offered_only_where_stores_are_ordered(monkeypatch):
    from types import SimpleNamespace

    from slipstream.sync.round import negotiation

    colocated_host = SimpleNamespace(
        colocated=lambda ranks: True, device=torch.device("cpu"), rank=0
    )
    monkeypatch.setattr(negotiation, "ORDERED_STORES", True)
    assert negotiation.candidates(colocated_host, "auto", [1]) == ["ipc", "shm"]
    colocated_gpu = SimpleNamespace(
        colocated=lambda ranks: True, device=torch.device("cuda"), rank=0
    )
    assert negotiation.candidates(colocated_gpu, "auto", [1]) == ["ipc", "broadcast"]
    monkeypatch.setattr(negotiation, "ORDERED_STORES", False)  # e.g. an ARM host
    assert negotiation.candidates(colocated_host, "auto", [1]) == ["relay"]
    for transport in ("shm", "cma", "ipc"):
        with pytest.raises(ValueError, match="needs an x86 CPU"):
            negotiation.candidates(colocated_host, transport, [1])


def test_auto_relays_host_weights_across_hosts_and_broadcasts_device_weights():
    from types import SimpleNamespace

    from slipstream.sync.round.negotiation import candidates

    for device, picked in (("cpu", "relay"), ("cuda", "broadcast")):
        remote = SimpleNamespace(colocated=lambda ranks: False, device=torch.device(device), rank=0)
        assert candidates(remote, "auto", [1, 2]) == [picked]
        with pytest.raises(ValueError, match="needs every rollout on trainer rank 0's host"):
            candidates(remote, "ipc", [1, 2])
