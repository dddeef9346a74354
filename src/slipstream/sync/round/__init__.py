"""One publish round on each side: the wire protocol (:mod:`.protocol`: store keys and
messages), choosing and building an epoch's transport (:mod:`.negotiation`), the trainer's
and the rollout's side of a round (:mod:`.trainer_round`, :mod:`.rollout_round`) and who
broke one (:mod:`.culprits`). Rounds use transports; no transport uses a round."""
