"""Weight sync: push trainer weights to rollout workers, bucketed, pipelined, versioned.

- :mod:`.group`: the sync group (own store and process groups, never the default group),
  its heartbeats and who is alive; a restarted process rejoins at its old rank;
- :mod:`.protocol`: the wire protocol: every store key and message between the two sides;
- :mod:`.plan`: the bucket plan every rank derives from the same layout;
- :mod:`.packing`: reading tensors bucket by bucket (DTensor gathers) and packing payloads;
- :mod:`.negotiation`: settling on a transport, and building each epoch's ends of it;
- :mod:`.transport`, :mod:`.shm`, :mod:`.cma`: broadcast over the network, a shared-memory
  ring, or the rollouts reading the trainer's memory (colocated);
- :mod:`.cache`: the one send path, the trainer's host cache and its refetch server;
- :mod:`.publisher`, :mod:`.subscriber`, :mod:`.apply`: the two sides and their targets.
"""

from .group import SyncGroup, init_group
from .plan import BucketPlan, TensorSpec
from .publisher import PublishHandle, PublishTimings, WeightPublisher
from .subscriber import WeightSubscriber

__all__ = [
    "BucketPlan",
    "PublishHandle",
    "PublishTimings",
    "SyncGroup",
    "TensorSpec",
    "WeightPublisher",
    "WeightSubscriber",
    "init_group",
]
