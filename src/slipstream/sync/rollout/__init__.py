"""The rollout's side below :class:`~slipstream.sync.WeightSubscriber`: where received bytes
go (:mod:`.sinks`) and applying them to a module or a ``load_weights`` callable
(:mod:`.apply`). Nothing here imports the trainer's side."""
