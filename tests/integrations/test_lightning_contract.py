"""SlipstreamCheckpointIO keeps Lightning's checkpoint contract in real ``Trainer.fit`` runs:
a save never changes the run it saves (checked bit for bit against the same run without
saves), and a mid-epoch resume with a stateful loader continues where Lightning's own
``TorchCheckpointIO`` resume continues, at the next batch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from test_lightning import assert_same

from slipstream.integrations.lightning import SlipstreamCheckpointIO

pytestmark = pytest.mark.timeout(120)

ROWS, BATCH, FEATURES = 16, 4, 6


class Batches:
    """A resumable loader (Lightning's ``_Stateful``): each epoch a seeded permutation of
    ``ROWS`` rows, ``BATCH`` at a time; its state is the epoch and how many batches of it
    were handed out, and a loader given a state resumes right after them. Each row's first
    feature is its index, so a run can tell which rows it trained on."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(ROWS, FEATURES, generator=g)
        self.x[:, 0] = torch.arange(ROWS, dtype=torch.float32)
        self.y = self.x[:, 1:3].sum(dim=1, keepdim=True)
        self.epoch, self.yielded, self._resume_at = -1, 0, 0

    def __len__(self) -> int:
        return ROWS // BATCH

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._resume_at:
            start, self._resume_at = self._resume_at, 0
        else:
            self.epoch, start = self.epoch + 1, 0
        order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(100 + self.epoch))
        for index in range(start, len(self)):
            rows = order[index * BATCH : (index + 1) * BATCH]
            self.yielded = index + 1
            yield self.x[rows], self.y[rows]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._resume_at = state["epoch"], state["yielded"]


class Net(LightningModule):
    """Adam with a per-step scheduler and dropout: optimizer state, scheduler state and the
    random generators all move every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.rows: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.rows.append(x[:, 0].long().tolist())
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class SaveBeforeTheFirstStep(Callback):
    """Saves a checkpoint when training starts: the optimizer exists and has never stepped."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def fit(
    root: str | None,
    plugins: list[Any],
    ckpt_path: str | None = None,
    max_steps: int = -1,
    max_epochs: int = 2,
    every: int = 1,
) -> tuple[Trainer, Net]:
    """Fits ``Net`` on ``Batches``; with ``root``, saving every ``every`` steps there (all
    kept) and once before the first step (``step-0.ckpt``)."""
    seed_everything(5, verbose=False)
    model = Net()
    callbacks: list[Callback] = []
    if root is not None:
        callbacks = [
            ModelCheckpoint(
                dirpath=root,
                filename="{step}",
                every_n_train_steps=every,
                save_top_k=-1,
                save_last=True,
            )
        ]
        if ckpt_path is None:
            callbacks.append(SaveBeforeTheFirstStep(os.path.join(root, "step-0.ckpt")))
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        max_steps=max_steps,
        plugins=plugins,
        callbacks=callbacks,
        enable_checkpointing=root is not None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, Batches(), ckpt_path=ckpt_path)
    return trainer, model


def training_state(trainer: Trainer, model: Net) -> dict[str, Any]:
    """Everything the run trained, copied out of it."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step,
        "rng": torch.get_rng_state(),
    }


def test_saves_before_the_first_step_and_after_every_step_change_nothing(tmp_path):
    """8 steps, saved before the first optimizer step and after every one: the weights, the
    optimizer's state, the scheduler and the random generators end bit for bit as in the run
    that never saved, and every checkpoint holds what ``TorchCheckpointIO`` wrote for it."""
    trainer, model = fit(None, [])
    unsaved = training_state(trainer, model)
    assert unsaved["global_step"] == 8

    ckpts = str(tmp_path / "ckpts")
    trainer, model = fit(ckpts, [TorchCheckpointIO()])
    assert_same(training_state(trainer, model), unsaved, "torch.save run vs unsaved")
    os.rename(ckpts, tmp_path / "torch_ckpts")  # the same paths inside both runs' checkpoints

    trainer, model = fit(ckpts, [SlipstreamCheckpointIO(timeout=60, background_write=True)])
    assert_same(training_state(trainer, model), unsaved, "slipstream run vs unsaved")

    names = sorted(os.listdir(ckpts))
    assert names == sorted(os.listdir(tmp_path / "torch_ckpts"))
    assert names == ["last.ckpt", "step-0.ckpt", *(f"step={s}.ckpt" for s in range(1, 9))]
    before = SlipstreamCheckpointIO().load_checkpoint(os.path.join(ckpts, "step-0.ckpt"))
    assert before["global_step"] == 0 and before["optimizer_states"][0]["state"] == {}
    for name in names:
        ours = SlipstreamCheckpointIO().load_checkpoint(os.path.join(ckpts, name))
        theirs = torch.load(tmp_path / "torch_ckpts" / name, weights_only=False)
        assert_same(ours, theirs, name)


def test_mid_epoch_resume_continues_at_the_next_batch_as_lightning_does(tmp_path):
    """Stopped after step 6 (the middle of the second epoch) and resumed from that step's
    checkpoint, the run trains on the batches the uninterrupted run trains on from step 7,
    as Lightning's own ``TorchCheckpointIO`` resume does, and ends where that resume ends."""
    _, model = fit(None, [])
    rows = model.rows
    assert len(rows) == 8

    results = {}
    for name, make_io in (("torch", TorchCheckpointIO), ("slipstream", _slipstream)):
        root = str(tmp_path / name)
        first, first_model = fit(root, [make_io()], max_steps=6, every=3)
        assert first.global_step == 6 and first_model.rows == rows[:6]
        assert sorted(os.listdir(root)) == [
            "last.ckpt",
            "step-0.ckpt",
            "step=3.ckpt",
            "step=6.ckpt",
        ]
        trainer, model = fit(
            root, [make_io()], ckpt_path=os.path.join(root, "step=6.ckpt"), every=3
        )
        results[name] = (training_state(trainer, model), model.rows)

    theirs, ours = results["torch"], results["slipstream"]
    assert theirs[1] == rows[6:], "Lightning's own resume did not continue at the next batch"
    assert ours[1] == theirs[1]
    # Lightning saves no random generator state: dropout after a resume draws other masks
    # than the uninterrupted run's, with either CheckpointIO alike.
    assert_same(ours[0], theirs[0], "slipstream resume vs torch.save resume")


def _slipstream() -> SlipstreamCheckpointIO:
    return SlipstreamCheckpointIO(timeout=60, background_write=True)


def _fit_twice_in_one_directory(root: str, io: Any) -> dict[str, Any]:
    """Two fits into one directory (Lightning's ``test_ckpt_version_after_rerun_new_trainer``):
    the second versions the names the first took (``epoch=0-v1.ckpt``); then weights-only
    checkpoints load into ``validate(ckpt_path="best"/"last")`` and refuse a resume."""
    seen: dict[str, Any] = {}
    for run in range(2):
        seed_everything(5, verbose=False)
        checkpoint = ModelCheckpoint(
            dirpath=root, filename="{epoch}", save_top_k=-1, save_last=True, save_weights_only=True
        )
        trainer = Trainer(
            accelerator="cpu",
            max_epochs=2,
            plugins=[io()],
            callbacks=[checkpoint],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Net(), Batches())
        seen[f"best{run}"] = os.path.basename(checkpoint.best_model_path)
        seen[f"last{run}"] = os.path.basename(checkpoint.last_model_path)
    seen["files"] = sorted(os.listdir(root))
    model = LoggingNet()
    for which in ("best", "last"):
        trainer = Trainer(accelerator="cpu", plugins=[io()], logger=False, callbacks=[checkpoint])
        trainer.validate(model, Batches(), ckpt_path=which, verbose=False)
        seen[which] = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyError, match="only the model") as refused:
        trainer = Trainer(accelerator="cpu", max_epochs=3, plugins=[io()], logger=False)
        trainer.fit(Net(), Batches(), ckpt_path=os.path.join(root, "last.ckpt"))
    seen["refused"] = str(refused.value)
    return seen


class LoggingNet(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_names_versions_and_weights_only_checkpoints_as_lightning_does(tmp_path):
    theirs = _fit_twice_in_one_directory(str(tmp_path / "torch"), TorchCheckpointIO)
    ours = _fit_twice_in_one_directory(str(tmp_path / "slipstream"), _slipstream)
    assert theirs["files"] == [
        "epoch=0-v1.ckpt",
        "epoch=0.ckpt",
        "epoch=1-v1.ckpt",
        "epoch=1.ckpt",
        "last-v1.ckpt",
        "last.ckpt",
    ]
    assert_same(ours, theirs)
