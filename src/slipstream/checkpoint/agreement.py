"""Every rank's outcome of a collective load, agreed through the job's store.

A load reads on each rank alone, so what one rank cannot load (a corrupt byte, a storage
error, a missing file or key) would fail there only while the others return, and then hang
in their next collective. DCP fails such a load on every rank; so does slipstream: after
its own part each rank posts a :class:`LoadOutcome` through a
:class:`~.save.channel.RankChannel` (the saver's, which already beats for the group); rank
0 gathers them and posts one verdict, which every other rank waits for and reads. A rank
that failed fails the load on every rank at once; a rank that died is named within seconds
by its silent heartbeat; each rank's error names every failing rank and its cause.

Invariant: every rank of the group leaves :meth:`LoadAgreement.run` (and
:meth:`LoadAgreement.values`, :meth:`LoadAgreement.same`) the same way: all with their
result (with every rank's value), or all raising an error naming each rank that failed and
why.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from ..core.control_plane import ranks_text, store_key
from ..core.waits import Deadline
from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from .format.fields import Fields, decode_json
from .save.channel import RankChannel

_T = TypeVar("_T")

_KINDS: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (CheckpointError, CorruptCheckpointError, UnsafeCheckpointError)
}
"""The error classes a failed load is raised as on every rank when all failing ranks agree
on one; any other failure is raised as :class:`CheckpointError`."""


@dataclass(frozen=True)
class LoadOutcome:
    """A rank's part of a load: done (``error`` is ``None``, with the JSON ``value`` its
    part gave, if any), or why not and the class of its error (``kind``)."""

    error: str | None = None
    kind: str = CheckpointError.__name__
    value: Any = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes, what: str) -> LoadOutcome:
        f = Fields(decode_json(text, what, CheckpointError), what, CheckpointError)
        error = f.get("error", str, optional=True)
        kind = f.get("kind", str, optional=True) or CheckpointError.__name__
        return cls(error, kind, f.get("value", object, optional=True))

    @classmethod
    def failed(cls, exc: BaseException) -> LoadOutcome:
        return cls(f"{type(exc).__name__}: {exc}", type(exc).__name__)


class LoadAgreement:
    """Runs each collective load of one group's channel and agrees on its outcome; every
    rank must run the group's loads in the same order (as SPMD code does)."""

    def __init__(self, channel: RankChannel) -> None:
        self.channel = channel
        self._rounds = 0
        self._lock = threading.Lock()

    def run(self, what: str, work: Callable[[], _T], timeout: float | None) -> _T:
        """``work()`` on this rank, then every rank's outcome agreed (each waited for up
        to ``timeout`` seconds; a dead rank is named within seconds): its result when every
        rank succeeded, else an error naming the failed ranks (``what``: the load, for it)."""
        if self.channel.world_size == 1:
            return work()
        result, _ = self._round(what, work, lambda _: None, timeout, every_value=False)
        return result

    def values(self, what: str, work: Callable[[], Any], timeout: float | None) -> list[Any]:
        """As :meth:`run`, for a ``work()`` that returns a JSON value: every rank's value,
        by rank, the same list on every rank."""
        if self.channel.world_size == 1:
            return [work()]
        _, values = self._round(what, work, lambda value: value, timeout, every_value=True)
        assert values is not None, "every value is sent when asked for"
        return values

    def same(
        self, what: str, work: Callable[[], Any], timeout: float | None
    ) -> tuple[Any, list[Any] | None]:
        """As :meth:`run`, for a ``work()`` that returns a JSON value: this rank's value,
        and ``None`` where every rank's is the same, else every rank's, by rank (the same
        list on every rank)."""
        if self.channel.world_size == 1:
            return work(), None
        return self._round(what, work, lambda value: value, timeout, every_value=False)

    def _round(
        self,
        what: str,
        work: Callable[[], _T],
        shared: Callable[[_T], Any],
        timeout: float | None,
        every_value: bool,
    ) -> tuple[_T, list[Any] | None]:
        """One exchange (:meth:`~.save.channel.RankChannel.exchange`): each rank's
        outcome to rank 0, rank 0's verdict (the failed ranks and why, every rank's value
        where asked for or where they differ) to every rank."""
        with self._lock:
            number = self._rounds
            self._rounds += 1
        own: Exception | None = None
        try:
            result = work()
            outcome = LoadOutcome(value=shared(result))
        except Exception as exc:
            own, outcome = exc, LoadOutcome.failed(exc)

        def decide(reports: list[LoadOutcome]) -> str:
            failed = {r: [m.error, m.kind] for r, m in enumerate(reports) if m.error is not None}
            values = [m.value for m in reports]
            differ = any(v != values[0] for v in values)
            return json.dumps(
                {"failed": failed, "values": values if every_value or differ else None}
            )

        topic = store_key("load", number)
        try:
            text = self.channel.exchange(
                topic, outcome, LoadOutcome.from_json, decide, Deadline(timeout), f"finish {what}"
            )
        except Exception as exc:
            if own is not None:
                raise exc from own
            raise
        if number > 0 and self.channel.rank == 0:
            # every rank posted this round, so each has read the last one's verdict
            self.channel.forget_verdict(store_key("load", number - 1))
        verdict = json.loads(text)
        failed = {int(r): (str(e), str(k)) for r, (e, k) in verdict["failed"].items()}
        if not failed:
            return result, verdict["values"]
        kinds = {k for _, k in failed.values()}
        kind = _KINDS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
        causes = "; ".join(f"rank {r}: {e}" for r, (e, _) in sorted(failed.items()))
        raise kind(
            f"{what} failed on {ranks_text(list(failed))}, so on every rank "
            f"(rank {self.channel.rank} reporting): {causes}"
        ) from own


_agreements: weakref.WeakKeyDictionary[RankChannel, LoadAgreement] = weakref.WeakKeyDictionary()
_agreements_lock = threading.Lock()


def agreement_for(channel: RankChannel) -> LoadAgreement:
    """The load agreement of ``channel`` (made on first use; one per channel, so that the
    rounds of the group's loads stay numbered alike on every rank)."""
    with _agreements_lock:
        agreement = _agreements.get(channel)
        if agreement is None:
            agreement = _agreements[channel] = LoadAgreement(channel)
        return agreement
