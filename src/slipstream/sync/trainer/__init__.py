"""The trainer's side below :class:`~slipstream.sync.WeightPublisher`: reading and packing
tensors (:mod:`.packing`, :mod:`.stream` for iterators), the one send path
(:mod:`.sending`), the host cache (:mod:`.host_cache`) and serving rollouts that ask again
from it (:mod:`.refetch`)."""
