"""This process's random number generators as a checkpointable state dict, and back.

``capture`` returns copies (tensors and plain tuples), so a save may read them after the
generators moved on; ``restore`` sets every generator ``capture`` saw, and only those.
The keys hold plain data that slipstream's safe loader reads without ``trusted``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The state of Python's, numpy's, torch's CPU and (where present) CUDA generators."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the generators to ``state`` (a :func:`capture`, possibly loaded back)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(list(state["cuda"]))
