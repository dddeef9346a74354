"""Lightning's ``ddp_spawn`` with ``SlipstreamCheckpointIO(background_write=True)``: rank 0's
worker saves its trained weights to a ``.temp.ckpt`` through the plugin and exits; the main
process then loads that file into its own model and removes it (Lightning's
``_MultiProcessingLauncher``). Run as a script; writes, with ``torch.save``, the main
process's weights after ``fit``, rank 0's at the end of training, and the ``.temp.ckpt``
paths the main process loaded that still exist."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from slipstream.integrations.lightning import SlipstreamCheckpointIO


class RecordingIO(SlipstreamCheckpointIO):
    """Records, in the process that runs it, the paths it loaded."""

    loaded: list[str] = []

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        RecordingIO.loaded.append(os.fspath(path))
        return super().load_checkpoint(path, *args, **kwargs)


class KeepRankZeroWeights(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            torch.save({k: v.clone() for k, v in pl_module.state_dict().items()}, self.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import lightning_scenario

    seed_everything(3, verbose=False)
    worker_out = os.path.join(args.root, "worker.pt")
    model = lightning_scenario.Regression(**lightning_scenario.hyper_parameters())
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        plugins=[RecordingIO(timeout=60, background_write=True)],
        callbacks=[KeepRankZeroWeights(worker_out)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, lightning_scenario._loader(0, 32))
    assert RecordingIO.loaded and all(p.endswith(".temp.ckpt") for p in RecordingIO.loaded)
    torch.save(
        {
            "main": {k: v.clone() for k, v in model.state_dict().items()},
            "worker": torch.load(worker_out),
            "leftovers": [p for p in RecordingIO.loaded if os.path.exists(p)],
        },
        args.out,
    )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(1)
    main()
