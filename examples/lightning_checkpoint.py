"""Lightning training whose checkpoints go through slipstream, resumed with ``ckpt_path``.

Run it twice: the first run trains 2 epochs, the second resumes from ``last.ckpt`` to 3.

    python examples/lightning_checkpoint.py --root /tmp/slipstream-lightning --epochs 2
    python examples/lightning_checkpoint.py --root /tmp/slipstream-lightning --epochs 3
"""

import argparse
import os

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from slipstream.integrations.lightning import SlipstreamCheckpointIO


class Regression(LightningModule):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/slipstream-lightning")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    seed_everything(0, verbose=False)
    checkpoints = os.path.join(args.root, "checkpoints")
    last = os.path.join(checkpoints, "last.ckpt")
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=args.epochs,
        # the one line that moves saving off the loop (Lightning's .ckpt files, written beside it)
        plugins=[SlipstreamCheckpointIO(background_write=True)],
        callbacks=[
            ModelCheckpoint(dirpath=checkpoints, monitor="val_loss", save_top_k=2, save_last=True)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    resume = last if os.path.exists(last) else None
    trainer.fit(Regression(), data(0), data(1), ckpt_path=resume)
    if resume:
        print(f"resumed from {os.path.basename(resume)}")
    print(
        f"trained to epoch {trainer.current_epoch}; checkpoints: {sorted(os.listdir(checkpoints))}"
    )


if __name__ == "__main__":
    main()
