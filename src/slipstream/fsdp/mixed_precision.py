"""Mixed precision policy: which dtype parameters are gathered and computed in, which dtype
gradients are reduced in. Main weights and sharded gradients stay in the parameters' own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the main weights are cast to it before the all-gather, so the gather
    moves and the unit computes in it. ``reduce_dtype``: gradients are cast to it before the
    reduce-scatter. ``None`` keeps the parameter's dtype. ``cast_forward_inputs`` casts the
    floating-point inputs of the unit's forward to ``param_dtype``.

    Units given no policy inherit the policy of the nearest enclosing unit that has one.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def cast_inputs(
        self, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[object, ...], dict[str, object]]:
        if self.param_dtype is None or not self.cast_forward_inputs:
            return args, kwargs
        dtype = self.param_dtype

        def cast(x: object) -> object:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)
