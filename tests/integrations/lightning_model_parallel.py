"""Lightning's ModelParallelStrategy (FSDP2, which calls DCP by name) with DCP swapped for
``slipstream.dcp``, on 2 CPU processes (gloo). Run as a script; Lightning launches the
second process by running it again.

Trains 2 epochs with ``ModelCheckpoint(save_last=True)``, resumes to 3 from ``last.ckpt``,
then trains 3 epochs in one go; global rank 0 writes both runs' full (gathered) states and
the files of ``last.ckpt`` with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import slipstream.dcp

# The swap docs/integrations/lightning.md gives: Lightning looks DCP's save and load up by name at
# each call, so binding slipstream's in their place routes its sharded checkpoints through
# slipstream.
dcp.save, dcp.load = slipstream.dcp.save, slipstream.dcp.load


class Sharded(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optim = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, 1, 0.5)}


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()  # a collective: every rank calls it
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def _fit(dirpath: str | None, epochs: int, ckpt_path: str | None = None) -> dict[str, Any]:
    seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=8)
    callbacks = [ModelCheckpoint(dirpath=dirpath, save_last=True)] if dirpath else []
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(),
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(dirpath),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Sharded()
    trainer.fit(model, data, ckpt_path=ckpt_path)
    optim = trainer.optimizers[0]
    return {
        "model": _full(dict(model.named_parameters())),
        "adam": [_full(optim.state[p]) for p in model.parameters()],
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "loops": trainer.fit_loop.state_dict(),
        "global_step": trainer.global_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dirpath = os.path.join(args.root, "ckpts")
    _fit(dirpath, 2)
    last = os.path.join(dirpath, "last.ckpt")
    files = sorted(os.listdir(last)) if os.path.isdir(last) else []
    resumed = _fit(dirpath, 3, ckpt_path=last)
    uninterrupted = _fit(None, 3)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(
            {"resumed": resumed, "uninterrupted": uninterrupted, "last_files": files}, args.out
        )


if __name__ == "__main__":
    main()
