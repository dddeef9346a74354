"""A training state that ``test_accelerate.py`` saves, and loading one with a plain
``accelerate.Accelerator`` in a process where slipstream cannot be imported.

:func:`load_without_slipstream` runs ``python -I -S`` (no ``PYTHONPATH``, no user site, and
no ``.pth`` files: the checkout's editable install is one) with only the interpreter's own
library and the environment's site-packages on the path, checks there that ``import
slipstream`` fails, builds the state with :func:`build`, calls accelerate's ``load_state``
and writes :func:`state_of` what it loaded with ``torch.save``. This module imports nothing
from slipstream.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import sysconfig
from typing import Any

import numpy as np
import torch

_CHILD = """
import sys
sys.path += [{site!r}, {here!r}]
try:
    import slipstream
except ModuleNotFoundError:
    pass
else:
    raise SystemExit(f"slipstream is importable here: {{slipstream.__file__}}")
import accelerate_plain_load
accelerate_plain_load.load_and_write({checkpoint!r}, {out!r})
"""


class Counter:
    """A custom object registered for checkpointing, with a tensor and a plain value."""

    def __init__(self) -> None:
        self.seen = 0
        self.history = torch.zeros(4)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]
        self.history = state["history"]


def build(accelerator: Any) -> tuple[Any, Any, Any, Counter]:
    """A model with dropout, AdamW, a scheduler and a registered :class:`Counter`, prepared."""
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


def train(
    accelerator: Any, model: Any, optimizer: Any, scheduler: Any, counter: Counter, steps: int
) -> list[float]:
    """``steps`` steps drawing on torch's, numpy's and Python's generators."""
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8)  # data and dropout both draw on torch's generator
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


def state_of(
    accelerator: Any, model: Any, optimizer: Any, scheduler: Any, counter: Counter
) -> dict[str, Any]:
    """A copy of everything a checkpoint holds, the generators' states read, not drawn on."""
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "counter": counter.state_dict(),
            "step": accelerator.step,
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            },
        }
    )


def load_and_write(checkpoint: str, out: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    objects = build(accelerator)
    accelerator.load_state(checkpoint)
    torch.save(state_of(accelerator, *objects), out)


def load_without_slipstream(checkpoint: str, out: str, timeout: float = 120) -> dict[str, Any]:
    """What a plain ``Accelerator().load_state(checkpoint)`` loads where slipstream is not
    importable (see the module's docstring)."""
    child = _CHILD.format(
        site=sysconfig.get_paths()["purelib"],
        here=os.path.dirname(os.path.abspath(__file__)),
        checkpoint=checkpoint,
        out=out,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", child],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    loaded: dict[str, Any] = torch.load(out, weights_only=False)
    return loaded
