"""One Lightning training scenario, run in a test process or as a script under DDP.

``scenario(root, ...)`` trains the same small regression model four ways with
``ModelCheckpoint(save_top_k=2, save_last=True, monitor="val_loss")``, validating twice an
epoch so that top-k files rotate:

- ``torch``: Lightning's default ``TorchCheckpointIO``, 2 epochs, then resumed to 3 from
  ``last.ckpt`` (the reference for which files stay and what a checkpoint holds);
- ``slipstream``: the same with ``SlipstreamCheckpointIO`` (``background_write`` as
  asked), in the same directory name (the torch run's directory is moved aside first, so
  the paths inside both checkpoints are equal);
- ``uninterrupted``: 3 epochs in one go, no checkpoints (the reference for resuming).

Run as a script (``--strategy ddp --devices 2``), Lightning launches the second process
by running this script again; global rank 0 writes the results with ``torch.save``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import ListConfig, OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from slipstream.integrations.lightning import SlipstreamCheckpointIO


@dataclasses.dataclass
class Widths:
    hidden: int
    scale: float


class Act(enum.Enum):
    RELU = "relu"
    TANH = "tanh"


def hyper_parameters() -> dict[str, Any]:
    return {"widths": Widths(32, 0.5), "act": Act.TANH, "layers": OmegaConf.create([16, 32])}


class Regression(LightningModule):
    def __init__(self, widths: Widths, act: Act, layers: ListConfig) -> None:
        super().__init__()
        self.save_hyperparameters()
        nonlinearity = torch.nn.Tanh() if act is Act.TANH else torch.nn.ReLU()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(layers[0], widths.hidden),
            nonlinearity,
            torch.nn.Linear(widths.hidden, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optim = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
        return {"optimizer": optim, "lr_scheduler": sched}


def _loader(seed: int, n: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def _fit(
    dirpath: str | None,
    epochs: int,
    plugins: list[Any],
    devices: int,
    strategy: str,
    ckpt_path: str | None = None,
    weights_only: bool | None = None,
) -> tuple[Trainer, Regression, ModelCheckpoint | None]:
    seed_everything(7, verbose=False)
    model = Regression(**hyper_parameters())
    checkpoint = (
        ModelCheckpoint(dirpath=dirpath, save_top_k=2, save_last=True, monitor="val_loss")
        if dirpath is not None
        else None
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        val_check_interval=0.5,
        plugins=plugins,
        callbacks=[checkpoint] if checkpoint is not None else [],
        enable_checkpointing=checkpoint is not None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(
        model, _loader(0, 64), _loader(1, 32), ckpt_path=ckpt_path, weights_only=weights_only
    )
    return trainer, model, checkpoint


def _state(trainer: Trainer, model: Regression) -> dict[str, Any]:
    """Everything a resume must restore, copied out of the finished run."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "loops": trainer.fit_loop.state_dict(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }


def _is_rank_zero() -> bool:
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def _listing(dirpath: str) -> list[str]:
    """The checkpoint directory's files, as rank 0 sees them (its results are the ones kept).
    Other ranks do not look: rank 0 moves the directory aside as soon as its run ends, and
    nothing orders that after another rank's look."""
    return sorted(os.listdir(dirpath)) if _is_rank_zero() else []


def _run_with_checkpoints(
    root: str, plugins: list[Any], devices: int, strategy: str, weights_only: bool | None
) -> dict[str, Any]:
    dirpath = os.path.join(root, "ckpts")
    _, _, first = _fit(dirpath, 2, plugins, devices, strategy)
    assert first is not None
    after_two = _listing(dirpath)
    trainer, model, resumed = _fit(
        dirpath,
        3,
        plugins,
        devices,
        strategy,
        ckpt_path=os.path.join(dirpath, "last.ckpt"),
        weights_only=weights_only,
    )
    assert resumed is not None
    return {
        "state": _state(trainer, model),
        "files_after_two": after_two,
        "files": _listing(dirpath),
        "best_k": {os.path.basename(k): v.item() for k, v in resumed.best_k_models.items()},
        "best": os.path.basename(resumed.best_model_path),
        "last": os.path.basename(resumed.last_model_path),
    }


def scenario(
    root: str, devices: int = 1, strategy: str = "auto", background_write: bool = False
) -> dict[str, Any]:
    """The three runs described in the module docstring; returns what each left."""
    # torch.load refuses the hyper-parameters' dataclass unless told to trust the file.
    torch_run = _run_with_checkpoints(root, [], devices, strategy, weights_only=False)
    if _is_rank_zero():
        os.rename(os.path.join(root, "ckpts"), os.path.join(root, "torch_ckpts"))
    io = SlipstreamCheckpointIO(timeout=60, background_write=background_write)
    ss_run = _run_with_checkpoints(root, [io], devices, strategy, weights_only=False)
    trainer, model, _ = _fit(None, 3, [], devices, strategy)
    return {"torch": torch_run, "slipstream": ss_run, "uninterrupted": _state(trainer, model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--background-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = scenario(args.root, args.devices, args.strategy, args.background_write)
    if _is_rank_zero():
        torch.save(results, args.out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import lightning_scenario  # the classes pickled into checkpoints get an importable module

    lightning_scenario.main()
