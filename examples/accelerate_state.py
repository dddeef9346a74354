"""accelerate's save_state written in the background by slipstream, as accelerate's files.

Trains a small model, saves its state (the call returns once the state is copied; the
files are written in the background), trains on, then restores the saved state into fresh
objects with a plain ``accelerate.Accelerator`` (the files are accelerate's own) and shows
training continues alike::

    python examples/accelerate_state.py --out /tmp/accelerate_state
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator

from slipstream.integrations.accelerate import SlipstreamAccelerator


class Seen:
    """Any object with state_dict/load_state_dict, given to register_for_checkpointing."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


def build(accelerator: Accelerator):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    seen = Seen()
    accelerator.register_for_checkpointing(seen)
    return (*accelerator.prepare(model, optimizer, scheduler), seen)


def train(accelerator, model, optimizer, scheduler, seen, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        seen.batches += 1
        losses.append(round(loss.item(), 6))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out

    # The one change: SlipstreamAccelerator for Accelerator; background_write=True to have
    # save_state return once the state is copied (by default it returns once written).
    accelerator = SlipstreamAccelerator(cpu=True, background_write=True)
    state = build(accelerator)
    train(accelerator, *state, steps=5)
    accelerator.save_state(out)  # returns once copied; written in the background
    after = train(accelerator, *state, steps=3)
    accelerator.end_training()  # waits for the save
    print(f"accelerate's files: {' '.join(sorted(os.listdir(out)))}")

    again = Accelerator(cpu=True)  # accelerate's own load_state reads them
    restored = build(again)
    again.load_state(out)
    print(f"restored after {restored[3].batches} batches")
    print(f"training after the restore matches: {train(again, *restored, steps=3) == after}")


if __name__ == "__main__":
    main()
