"""Transports: how one bucket (header and payload segments) moves from its owning trainer to
every rollout of an epoch. :mod:`.network` (``relay`` and ``broadcast`` over the sync group's
process groups) and the colocated ones: :mod:`.shm` (a ring in a shared-memory file),
:mod:`.cma` (rollouts read the trainer's memory), :mod:`.ipc` (slots shared through torch,
on :mod:`.shared_tensors`). A transport knows bucket layouts, never a round."""
