"""A tensor-parallel rollout that dies in a routed round (each rank sent its own bytes, point
to point) is named within seconds by the trainer and by the other rank, and the survivor
still holds the version before it whole: over relay and broadcast, in ``direct`` and
``cached`` mode.

Rank 0 publishes to rollout ranks 1 and 2, one tensor-parallel model over their own mesh
(``ColwiseParallel`` and ``RowwiseParallel``); rank 2 is SIGKILLed inside its third write of
its own bytes of version 2 (mid-transfer). The group's timeout is 60 s, so a death noticed
only by a timeout shows. The bound is the sync group's 5 s, measured from the victim's
recorded time of death."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port
from sync_procs import spawn
from torch import nn

import slipstream as ss
from slipstream.errors import PeerDiedError

BUCKET = 16 * 1024
GROUP_TIMEOUT = 60.0
NAMED_WITHIN = 5.0
VICTIM = 2
DIES_AT_WRITE = 3


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64))


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(t.shape, generator=g) for n, t in _model().state_dict().items()}


def _trainer(group, mode, transport):
    pub = ss.WeightPublisher(
        group, [0], [1, 2], bucket_bytes=BUCKET, mode=mode, transport=transport
    )
    assert pub.publish(_weights(1), version=1).delivered.result(timeout=GROUP_TIMEOUT) == 1
    try:
        pub.publish(_weights(2), version=2).delivered.result(timeout=2 * GROUP_TIMEOUT)
        error: BaseException | None = None
    except PeerDiedError as exc:
        error = exc
    took = time.time() - group.get_json("test/died_at", VICTIM, "the victim's death", 30)
    pub.close()
    outcome = group.get_json("test/outcome", 1, "the survivor's outcome", 30)
    group.close()
    return {"error": repr(error), "ranks": getattr(error, "ranks", None), "took": took, **outcome}


def _rollout(group, rank, mesh_port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from slipstream.sync.rollout.apply import ModuleTarget

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{mesh_port}", rank=rank - 1, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    sub = ss.WeightSubscriber(group, [0], [1, 2])
    assert sub.receive(model) == 1
    if rank == VICTIM:
        write = ModuleTarget.write_kept
        calls = [0]

        def dying(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == DIES_AT_WRITE:
                group.set_json("test/died_at", time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, *args, **kwargs)

        ModuleTarget.write_kept = dying
        sub.receive(model)
        raise AssertionError("the victim outlived its receive")
    try:
        sub.receive(model, atomic=True)
        outcome: dict = {"survivor": "received"}
    except PeerDiedError as exc:
        took = time.time() - group.get_json("test/died_at", VICTIM, "the victim's death", 30)
        outcome = {"survivor": repr(exc), "survivor_ranks": exc.ranks, "survivor_took": took}
    want = _weights(1)["0.weight"].chunk(2)[0]
    outcome["holds_version_1"] = bool(np.array_equal(model[0].weight.to_local().detach(), want))
    group.set_json("test/outcome", outcome)
    sub.close()
    group.close()
    return outcome


def _run(rank, port, mesh_port, mode, transport):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=GROUP_TIMEOUT)
    if rank == 0:
        return _trainer(group, mode, transport)
    return _rollout(group, rank, mesh_port)


@pytest.mark.parametrize("mode", ["direct", "cached"])
@pytest.mark.parametrize("transport", ["relay", "broadcast"])
def test_a_tensor_parallel_rank_dying_in_a_routed_round_is_named_within_seconds(transport, mode):
    out = spawn(_run, 3, free_port(), mode, transport, timeout=120, may_die=(VICTIM,))
    trainer = out[0]
    assert trainer["ranks"] == [VICTIM], trainer
    assert trainer["took"] < NAMED_WITHIN, trainer
    assert trainer["survivor_ranks"] == [VICTIM], trainer
    assert trainer["survivor_took"] < NAMED_WITHIN, trainer
    assert trainer["holds_version_1"], trainer  # atomic: nothing of version 2 applied
