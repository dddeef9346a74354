"""A receive for a named version (``expect_version``, what an engine's ``update_weights(v)``
passes) refuses a round of another version before applying any byte: the target keeps the
version it held, the trainer's publish reports the refusal naming the rollout, and the
next receive for the right version lands. Over shared memory and over the network."""

from __future__ import annotations

import pytest
import torch
from sync_procs import spawn

import slipstream as ss


def _weights(version: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((4096,), float(version * 10 + i)) for i in range(4)}


def _run(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        with ss.WeightPublisher(group, [0], [1], bucket_bytes=8192, transport=transport) as pub:
            pub.publish(_weights(1), version=1).delivered.result(timeout=60)
            with pytest.raises(ss.SyncError) as refused:
                pub.publish(_weights(2), version=2).delivered.result(timeout=60)
            pub.publish(_weights(3), version=3).delivered.result(timeout=60)
        group.close()
        return str(refused.value)
    model = torch.nn.Module()
    for name, t in _weights(0).items():
        model.register_buffer(name, t.clone())
    seen = {}
    with ss.WeightSubscriber(group, [0], [1]) as sub:
        assert sub.receive(model, expect_version=1) == 1
        with pytest.raises(ss.SyncError) as late:
            sub.receive(model, expect_version=1)  # a late call for version 1 meets round 2
        seen["refused"] = str(late.value)
        seen["kept"] = {n: t.clone() for n, t in model.state_dict().items()}
        assert sub.receive(model, expect_version=3) == 3
        seen["last"] = {n: t.clone() for n, t in model.state_dict().items()}
    group.close()
    return {
        k: v if isinstance(v, str) else {n: t.tolist() for n, t in v.items()}
        for k, v in seen.items()
    }


@pytest.mark.parametrize("transport", ["shm", "relay"])
def test_a_receive_for_another_version_applies_nothing(transport):
    out = spawn(_run, 2, transport, timeout=90)
    trainer, rollout = out[0], out[1]
    assert "rollout rank 1" in trainer and "version 2" in trainer, trainer
    assert "asked for version 1" in rollout["refused"], rollout["refused"]
    for version, held in ((1, rollout["kept"]), (3, rollout["last"])):
        assert held == {n: t.tolist() for n, t in _weights(version).items()}, version
