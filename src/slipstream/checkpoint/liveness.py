"""Liveness of the ranks of a save: heartbeats through the job's key-value store.

Every :class:`~.saver.CheckpointSaver` of more than one rank beats: a thread it owns adds
one to its rank's counter in the store every :data:`BEAT_SECONDS`. A rank waiting on others
reads the counters of those it is waiting for; one that has not moved for
:data:`SILENT_AFTER_SECONDS` (as seen on the waiting rank's own clock, so hosts' clocks
need not agree) belongs to a process that died or stopped (SIGKILL, SIGSTOP, a lost host),
and the wait fails at once naming it, instead of running on until its timeout. A rank
that has never beaten (its saver not made yet) gets the whole timeout.

The mechanism is the control plane's (:class:`~slipstream.core.control_plane.Heartbeat`,
:class:`~slipstream.core.control_plane.LivenessWatch`); this module holds a save's timings.
The beat runs at the caller's priority, not the saver's lowered one: a rank whose cores
are all busy training still beats.
"""

BEAT_SECONDS = 1.0
SILENT_AFTER_SECONDS = 6.0
"""Silence that marks a rank dead: six missed beats, so a rank is noticed within
:data:`SILENT_AFTER_SECONDS` plus one check (under ten seconds)."""
