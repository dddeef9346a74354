"""``fully_shard``: turn a module into an FSDP unit scheduled by an :class:`FsdpContext`."""

from __future__ import annotations

from torch import nn

from ..errors import FsdpError
from .context import FsdpContext
from .mixed_precision import MixedPrecision


def fully_shard(
    module: nn.Module,
    *,
    context: FsdpContext,
    mixed_precision: MixedPrecision | None = None,
) -> nn.Module:
    """Shard ``module``'s own parameters (those no nested unit owns) over ``context``'s group.

    Call it bottom-up (blocks first, then the model). Returns ``module`` itself, whose
    parameters are now sharded ``DTensor``s; its forward gathers them as needed.
    """
    if not isinstance(module, nn.Module):
        raise FsdpError(f"fully_shard needs an nn.Module, got {type(module).__name__}")
    existing = context.unit_of(module)
    if existing is not None:
        raise FsdpError(f"unit {existing.name}: fully_shard called twice")
    if hasattr(module, "_get_fsdp_state") or type(module).__name__.startswith("FSDP"):
        raise FsdpError(
            f"module {type(module).__name__} is already sharded by torch FSDP; unsupported"
        )
    context.shard(module, mixed_precision)
    return module
