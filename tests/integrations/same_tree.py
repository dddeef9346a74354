"""One equality check for the states the integrations' tests save and load back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_same_tree(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` are equal all the way down: tensors and numpy arrays bit for bit,
    dtypes included; dicts by keys; lists and tuples of one type and length; the rest
    by ``==``. The message names where they first differ."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, f"{where}: {b!r}"
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, f"{where}: {b!r}"
        assert np.array_equal(a, b), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
