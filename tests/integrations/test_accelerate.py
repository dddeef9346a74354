"""``SlipstreamAccelerator.save_state`` / ``load_state``: a round trip restores the model,
optimizer, scheduler, step, random generators and registered objects exactly, so training
continues as the uninterrupted run did; accelerate's own directories still load."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from slipstream.integrations.accelerate import SlipstreamAccelerator, is_checkpoint

pytestmark = pytest.mark.timeout(120)


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.seen = 0
        self.history = torch.zeros(4)

    def state_dict(self) -> dict[str, object]:
        return {"seen": self.seen, "history": self.history}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.seen = state["seen"]  # type: ignore[assignment]
        self.history = state["history"]  # type: ignore[assignment]


def setup(accelerator: Accelerator):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return model, optimizer, scheduler, counter


def train(accelerator, model, optimizer, scheduler, counter, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8)  # torch's RNG: data and dropout both depend on it
        noise = float(np.random.rand()) + random.random()
        loss = (model(x) ** 2).mean() + noise * 0
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.seen += 1
        counter.history[counter.seen % 4] = loss.detach()
        accelerator.step += 1
        losses.append(loss.item())
    return losses


def state_of(model, optimizer, scheduler, counter, accelerator):  # type: ignore[no-untyped-def]
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "counter": (counter.seen, counter.history.clone()),
        "step": accelerator.step,
        "rng": (random.random(), float(np.random.rand()), torch.rand(3)),
    }


def assert_equal_states(a, b) -> None:  # type: ignore[no-untyped-def]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for idx, st in a["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["optimizer"]["state"][idx][key]), (idx, key)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"]
    assert a["counter"][0] == b["counter"][0]
    assert torch.equal(a["counter"][1], b["counter"][1])
    assert a["step"] == b["step"]
    assert a["rng"][:2] == b["rng"][:2]
    assert torch.equal(a["rng"][2], b["rng"][2])


def test_round_trip_is_exact_and_training_continues_identically(tmp_path):
    accelerator = SlipstreamAccelerator(cpu=True)
    objects = setup(accelerator)
    train(accelerator, *objects, steps=3)
    path = accelerator.save_state(str(tmp_path / "ckpt"))
    # The state changes right after save_state returns, as in any training loop.
    losses_after = train(accelerator, *objects, steps=4)
    expected = state_of(*objects, accelerator)
    assert accelerator.step == 7
    accelerator.wait_for_checkpoints()
    assert is_checkpoint(path)
    assert not any(name.endswith((".bin", ".pkl", ".pt")) for name in os.listdir(path))

    fresh = SlipstreamAccelerator(cpu=True)
    restored = setup(fresh)
    fresh.load_state(path)
    assert fresh.step == 3
    assert restored[3].seen == 3
    assert train(fresh, *restored, steps=4) == losses_after
    assert_equal_states(expected, state_of(*restored, fresh))


def test_automatic_naming_rotates_only_finished_checkpoints(tmp_path):
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = SlipstreamAccelerator(cpu=True, project_config=config)
    objects = setup(accelerator)
    for _ in range(4):
        train(accelerator, *objects, steps=1)
        accelerator.save_state()
    expected = state_of(*objects, accelerator)
    accelerator.end_training()
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    assert all(is_checkpoint(root / name) for name in os.listdir(root))

    fresh = SlipstreamAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True
        ),
    )
    restored = setup(fresh)
    fresh.load_state()  # the latest
    assert_equal_states(expected, state_of(*restored, fresh))


def test_accelerate_written_directory_still_loads(tmp_path):
    plain = Accelerator(cpu=True)
    objects = setup(plain)
    train(plain, *objects, steps=2)
    plain.save_state(str(tmp_path / "plain"))
    expected = state_of(*objects, plain)

    accelerator = SlipstreamAccelerator(cpu=True)
    restored = setup(accelerator)
    accelerator.load_state(str(tmp_path / "plain"))
    assert_equal_states(expected, state_of(*restored, accelerator))


class Epochs:
    """A registered object without tensors (so staging may overlap the next steps)."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def test_overlapped_staging_saves_the_state_of_the_save_call(tmp_path):
    """With overlap_staging, save_state returns before the copy; the steps right after it
    must not leak into the checkpoint."""
    accelerator = SlipstreamAccelerator(cpu=True, overlap_staging=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    epochs = Epochs()
    accelerator.register_for_checkpointing(epochs)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):
        accelerator.backward(model(torch.randn(8, 256)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    epochs.done = 1
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {
        i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()
    }
    path = accelerator.save_state(str(tmp_path / "ckpt"))
    for _ in range(3):  # the first optimizer step waits for the staging
        accelerator.backward(model(torch.randn(8, 256)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    epochs.done = 2
    assert not torch.equal(model.state_dict()["0.weight"], at_save["0.weight"])
    accelerator.end_training()

    fresh = SlipstreamAccelerator(cpu=True)
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
    )
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    epochs2 = Epochs()
    fresh.register_for_checkpointing(epochs2)
    model2, optimizer2 = fresh.prepare(model2, optimizer2)
    fresh.load_state(path)
    for key, value in at_save.items():
        assert torch.equal(model2.state_dict()[key], value), key
    for idx, state in moments.items():
        for key, value in state.items():
            assert torch.equal(optimizer2.state_dict()["state"][idx][key], value), (idx, key)
    assert epochs2.done == 1
