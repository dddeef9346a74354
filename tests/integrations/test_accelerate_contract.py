"""``SlipstreamAccelerator`` keeps ``Accelerator``'s checkpoint contract, checked against
plain accelerate runs: saving changes nothing in the training run (a save before the first
optimizer step included, the writes in the background), a resume mid-epoch with a
stateful data loader continues at the next batch, an optimizer over a model never
prepared round-trips, ``load_state`` takes accelerate's arguments, and ``save_state``
returns with the checkpoint in place and the rotated-out one gone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torchdata.stateful_dataloader  # noqa: F401  (accelerate's stateful loader needs it)
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
from same_tree import assert_same_tree
from torch.utils.data import DataLoader, TensorDataset

from slipstream.integrations.accelerate import SlipstreamAccelerator

pytestmark = pytest.mark.timeout(300)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def _train_with_saves(accelerator: Accelerator, steps: int, save: bool) -> dict[str, Any]:
    """``steps`` AdamW steps; with ``save``, a ``save_state`` before the first and after
    every one. Returns the model, optimizer and scheduler state at the end."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    generator = torch.Generator().manual_seed(1)
    if save:
        accelerator.save_state()
    for _ in range(steps):
        x = torch.randn(8, 6, generator=generator)
        accelerator.backward(model(x).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if save:
            accelerator.save_state()
    if isinstance(accelerator, SlipstreamAccelerator):
        accelerator.wait_for_checkpoints()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    }


def test_saving_before_and_after_every_step_changes_nothing(tmp_path: Path) -> None:
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=3
    )
    saved = _train_with_saves(
        SlipstreamAccelerator(project_config=config, background_write=True), 5, save=True
    )
    reference = _train_with_saves(Accelerator(), 5, save=False)
    assert_same_tree(saved, reference, "state")
    assert [s["step"] for s in saved["optimizer"]["state"].values()] == [torch.tensor(5.0)] * 6
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint_3",
        "checkpoint_4",
        "checkpoint_5",
    ]


def _loader(shuffle: bool) -> DataLoader[Any]:
    data = TensorDataset(torch.arange(64, dtype=torch.float32).view(32, 2))
    generator = torch.Generator().manual_seed(3)
    return DataLoader(data, batch_size=2, shuffle=shuffle, generator=generator)


def _resume_mid_epoch(
    kind: type[Accelerator], directory: Path, shuffle: bool
) -> tuple[list[Any], list[Any]]:
    """Train on 16 batches, saving after batch 2 (0-based); then, in a new accelerator
    with new objects, load and finish the epoch. Returns the batches after the save in
    the first run, and those the resumed run saw."""
    stateful = DataLoaderConfiguration(use_stateful_dataloader=True)

    def prepared() -> tuple[Accelerator, torch.nn.Module, Any, Any]:
        accelerator = kind(dataloader_config=stateful)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(shuffle))
        return accelerator, model, optimizer, loader

    accelerator, model, optimizer, loader = prepared()
    after: list[Any] = []
    for i, (batch,) in enumerate(loader):
        accelerator.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
        if i == 2:
            accelerator.save_state(str(directory))
        elif i > 2:
            after.append(batch)
    if isinstance(accelerator, SlipstreamAccelerator):
        accelerator.wait_for_checkpoints()

    accelerator, model, optimizer, loader = prepared()
    accelerator.load_state(str(directory))
    resumed = [batch for (batch,) in loader]
    return after, resumed


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_continues_at_the_next_batch(tmp_path: Path, shuffle: bool) -> None:
    after, resumed = _resume_mid_epoch(SlipstreamAccelerator, tmp_path / "slipstream", shuffle)
    reference = _resume_mid_epoch(Accelerator, tmp_path / "accelerate", shuffle)
    assert len(after) == len(resumed) == 13
    assert_same_tree(reference[0], after, "first run")
    assert_same_tree(reference[1], resumed, "resumed")
    if not shuffle:  # shuffled, accelerate's resumed order is not the first run's
        assert_same_tree(after, resumed, "resumed")  # batch 3 on, as without the interruption


def _unprepared_optimizer_run(kind: type[Accelerator], directory: Path) -> dict[str, Any]:
    """An optimizer over a model never passed to ``prepare()``: saved after two steps,
    restored into fresh objects. Returns the restored optimizer state."""

    def build() -> tuple[Accelerator, torch.nn.Module, Any]:
        accelerator = kind()
        model = _model()
        return accelerator, model, accelerator.prepare(torch.optim.Adam(model.parameters()))

    accelerator, model, optimizer = build()
    for _ in range(2):
        accelerator.backward(model(torch.ones(4, 6)).sum())
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(directory))
    if isinstance(accelerator, SlipstreamAccelerator):
        accelerator.wait_for_checkpoints()
    accelerator, model, optimizer = build()
    accelerator.load_state(str(directory))
    return optimizer.state_dict()


def test_an_optimizer_over_an_unprepared_model_round_trips(tmp_path: Path) -> None:
    restored = _unprepared_optimizer_run(SlipstreamAccelerator, tmp_path / "slipstream")
    assert_same_tree(
        restored, _unprepared_optimizer_run(Accelerator, tmp_path / "accelerate"), "optimizer"
    )
    assert len(restored["state"]) == 6


def test_load_arguments_are_accelerates(tmp_path: Path) -> None:
    """``load_state`` is accelerate's own: its arguments reach accelerate's code."""
    accelerator = SlipstreamAccelerator()
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(str(tmp_path))
    with pytest.raises(TypeError, match="Unsupported optimizer map location"):
        accelerator.load_state(str(tmp_path), map_location="invalid")
    with pytest.raises(ValueError, match="folder does not exist"):
        accelerator.load_state(str(tmp_path / "missing"))
    accelerator.load_state(str(tmp_path), map_location="cpu", load_kwargs={"weights_only": True})


def test_save_state_returns_with_the_checkpoint_written_and_rotated(tmp_path: Path) -> None:
    """As accelerate's: when ``save_state`` returns, the checkpoint is complete and the
    rotated-out one gone, nothing left to write or delete (the caller may remove it all)."""
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1
    )
    accelerator = SlipstreamAccelerator(project_config=config)
    model = torch.nn.Linear(64, 64)
    accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    for i in range(3):
        path = accelerator.save_state()
        assert os.listdir(tmp_path / "checkpoints") == [f"checkpoint_{i}"]  # none hidden
        assert sorted(os.listdir(path)) == [
            "model.safetensors",
            "optimizer.bin",
            "random_states_0.pkl",
        ]
