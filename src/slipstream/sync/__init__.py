"""Weight sync: push trainer weights to rollout workers, bucketed, pipelined, versioned.

- :mod:`.group`: the sync group (own store and process groups, never the default group);
- :mod:`.plan`: the bucket plan every rank derives from the same layout;
- :mod:`.packing`: reading tensors bucket by bucket (DTensor gathers) and packing payloads;
- :mod:`.transport`, :mod:`.shm`, :mod:`.cma`: broadcast over the network, a shared-memory
  ring, or the rollouts reading the trainer's memory (colocated);
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
