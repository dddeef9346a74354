"""Fully sharded data parallel with all-gathers overlapped with compute and delayed release.

``fully_shard(module, context=ctx)`` bottom-up, then train as usual; see docs/fsdp.md.
"""

from .context import FsdpContext, FsdpStats
from .flat_buffer import FlatLayout, FlatShardedBuffer
from .mixed_precision import MixedPrecision
from .unit import FsdpUnit, fully_shard

__all__ = [
    "FlatLayout",
    "FlatShardedBuffer",
    "FsdpContext",
    "FsdpStats",
    "FsdpUnit",
    "MixedPrecision",
    "fully_shard",
]
