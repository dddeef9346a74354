"""Where a rank's epoch transport stands in the round protocol: :class:`EpochState`.

Kept by :class:`.trainer_round.TrainerRound` and :class:`.rollout_round.RolloutRound` (in
the manner of FSDP2's ``TrainingState``), in place of an epoch number of -1 and a "broken"
flag.
"""

from __future__ import annotations

from enum import Enum, auto


class EpochState(Enum):
    """A rank's transport for the current epoch (:mod:`.protocol`).

    NONE -> READY when the first round's epoch is entered; READY -> BROKEN when a round
    breaks (its transport is let go, or a member refused the version); BROKEN -> READY
    when the next round enters a new epoch; any -> NONE when the rank closes.

    Invariant: a transport (sender or receivers) is held exactly in READY, and a new
    epoch starts at the next round unless the state is READY and the members are the same.
    """

    NONE = auto()
    """No epoch yet, or closed: no transport held."""
    READY = auto()
    """The current epoch's transport is built for its members."""
    BROKEN = auto()
    """The last round broke: the transport was let go (or must not be trusted) and the
    next round starts a new epoch."""
