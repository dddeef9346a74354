"""Fully sharded data parallel with all-gathers overlapped with compute and delayed release.

``fully_shard(module, context=ctx)`` bottom-up, then train as usual; see docs/fsdp.md.

Layers, each importing only those below it: :mod:`.flat_buffer` (one dtype group's sharded
storage), :mod:`.collectives` (async all-gather and reduce-scatter, staging, timed waits),
:mod:`.unit` (a module's buffers and its own gather, release and reduce), :mod:`.context`
(the schedule and the hooks), :mod:`.api` (``fully_shard``).
"""

from .api import fully_shard
from .context import FsdpContext, FsdpStats
from .flat_buffer import FlatLayout, FlatShardedBuffer
from .mixed_precision import MixedPrecision
from .unit import FsdpUnit

__all__ = [
    "FlatLayout",
    "FlatShardedBuffer",
    "FsdpContext",
    "FsdpStats",
    "FsdpUnit",
    "MixedPrecision",
    "fully_shard",
]
