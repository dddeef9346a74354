"""Weight sync: push trainer weights to rollout workers, bucketed, pipelined, versioned.

The public entry points are here: :mod:`.group` (the sync group: its own store and process
groups, never the default group; heartbeats, who is alive, rejoining at an old rank),
:mod:`.publisher` (:class:`WeightPublisher`, the trainer's side) and :mod:`.subscriber`
(:class:`WeightSubscriber`, the rollout's side). Below them, one folder per role, each
importing only the folders beneath it (``tests/test_layering.py``):

- :mod:`.layout`: what travels, as plain data both sides derive alike (bucket plans, the
  payload's segments, tied weights, self-describing buckets, deltas);
- :mod:`.transport`: how a bucket moves (relay and broadcast over the network; shm, cma and
  ipc between processes of one host);
- :mod:`.round`: one publish round (the wire protocol, choosing each epoch's transport, each
  side's part of a round, who broke one);
- :mod:`.trainer`: packing tensors, the one send path, the host cache and refetch;
- :mod:`.rollout`: where received bytes go and how they are applied (never the trainer's).
"""

from .group import SyncGroup, init_group
from .layout.plan import BucketPlan, LayoutMismatch, TensorSpec
from .layout.runs import Narrow
from .publisher import PublisherState, PublishHandle, PublishTimings, WeightPublisher
from .rollout.apply import Layout
from .subscriber import WeightSubscriber

__all__ = [
    "BucketPlan",
    "Layout",
    "LayoutMismatch",
    "Narrow",
    "PublishHandle",
    "PublishTimings",
    "PublisherState",
    "SyncGroup",
    "TensorSpec",
    "WeightPublisher",
    "WeightSubscriber",
    "init_group",
]
