"""Weight sync: push trainer weights to rollout workers, bucketed, pipelined, versioned.

- :mod:`.group`: the sync group (own store and process groups, never the default group),
  its heartbeats and who is alive; a restarted process rejoins at its old rank;
- :mod:`.protocol`: the wire protocol: every store key and message between the two sides;
- :mod:`.plan`: the bucket plan every rank derives from the same layout;
- :mod:`.packing`: reading tensors bucket by bucket (DTensor gathers) and packing payloads;
  :mod:`.stream`: the same from an iterator, as it yields; :mod:`.described`: a first
  version whose buckets carry its layout;
- :mod:`.negotiation`: settling on a transport, and building each epoch's ends of it;
- :mod:`.transport`, :mod:`.shm`, :mod:`.cma`: broadcast over the network, a shared-memory
  ring, or the rollouts reading the trainer's memory (colocated);
- :mod:`.sending`: the one send path; :mod:`.host_cache`: the trainer's host cache (and
  base of deltas); :mod:`.refetch`: serving it again to rollouts that ask;
- :mod:`.culprits`: who broke a round, worked out the same way on both sides;
- :mod:`.trainer_round`, :mod:`.rollout_round`: each side's part of a publish round;
- :mod:`.publisher`, :mod:`.subscriber`, :mod:`.sinks`, :mod:`.apply`: the two sides, where
  received bytes go, and the targets.
"""

from .group import SyncGroup, init_group
from .plan import BucketPlan, LayoutMismatch, TensorSpec
from .publisher import PublishHandle, PublishTimings, WeightPublisher
from .subscriber import WeightSubscriber

__all__ = [
    "BucketPlan",
    "LayoutMismatch",
    "PublishHandle",
    "PublishTimings",
    "SyncGroup",
    "TensorSpec",
    "WeightPublisher",
    "WeightSubscriber",
    "init_group",
]
