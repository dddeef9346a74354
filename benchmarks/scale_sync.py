"""Store traffic of a publish round's coordination against the number of ranks (issue 55).

N simulated ranks of one sync group, each a thread of this process with its own client of
the one real TCPStore: trainers 0 and 1 (0 the lead; at N = 2, trainer 0 alone) and the
other ranks rollouts. Each rank is a real
:class:`~slipstream.sync.group.SyncGroup` channel view on its own client, and runs the real
round code: the trainers :class:`~slipstream.sync.round.trainer_round.TrainerRound`'s
``start`` (the lead gathers the requests, judges the members' liveness and posts the round
start) and ``finish`` (the acknowledgements); the rollouts
:class:`~slipstream.sync.round.rollout_round.RolloutRound`'s ``join`` (the request, then a
blocking wait for the round start) and ``ack_round``. What is simulated: the round's epoch
is taken as entered (a steady round: the members are those of the last round, so no
transport is built and no bytes move), and the ranks' processes are one process, so
``init_group`` is not run per rank (it would give each rank a heartbeat and a watch thread
and two more connections): each rank's hello and first beat are posted as ``init_group``
posts them, and one :class:`~slipstream.sync.liveness.SyncWatch` serves every rank's waits,
as it serves every wait of one process. Its calls are background calls, counted apart.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from store_calls import SPREAD_SILENT_AFTER_S, CallCounter, OpFigures, RankThreads, measure_ops

from slipstream.sync.group import SILENT_AFTER_SECONDS, SyncGroup
from slipstream.sync.liveness import SyncWatch
from slipstream.sync.members import host_identity, process_start
from slipstream.sync.round.protocol import Ack, ReceiverShape, TransportOffer
from slipstream.sync.round.rollout_round import RolloutRound
from slipstream.sync.round.state import EpochState
from slipstream.sync.round.trainer_round import TrainerRound
from slipstream.sync.round.versions import RolloutVersions

TIMEOUT_S = 1800.0
CHANNEL = "channel/scale"
OFFER = TransportOffer("relay", "cached", ReceiverShape(1024, 2, 4096, None))


def trainer_ranks(n: int) -> list[int]:
    """The trainers of a group of ``n`` ranks: two, but one when two ranks are all."""
    return [0] if n <= 2 else [0, 1]


def hello_key(rank: int) -> str:
    return f"hello/{rank}"


def alive_key(rank: int) -> str:
    return f"alive/{rank}"


class SharedMembership:
    """Every simulated rank's view of the group's liveness: one watch, as one process has."""

    def __init__(self, client: dist.Store, silent_after: float = SILENT_AFTER_SECONDS) -> None:
        self.watch = SyncWatch(client, hello_key, alive_key, silent_after)

    def close(self) -> None:
        self.watch.close()


@dataclass
class SyncRank:
    """One simulated rank: its channel view and its side of the rounds."""

    group: SyncGroup
    trainer: TrainerRound | None = None
    rollout: RolloutRound | None = None
    rounds: int = 0
    versions: list[int] = field(default_factory=list)


def publish_round(state: SyncRank) -> None:
    """One round of version ``rounds + 1``: on a trainer its start and finish, on a rollout
    its request, the wait for the start and its acknowledgement."""
    version = state.rounds + 1
    if state.trainer is not None:
        k = state.rounds
        start, requests = state.trainer.start(k, version, "plan")
        assert len(requests) == len(start.members), (requests, start.members)
        assert state.trainer.finish(k, start) == version
    else:
        assert state.rollout is not None
        k, start = state.rollout.join(state.rounds or None, None)
        assert start.version == version, (start.version, version)
        state.rollout.ack_round(k, Ack(start.version))
    state.versions.append(version)
    state.rounds += 1


class SyncRanks:
    """The simulated ranks ``ranks`` (all ``n`` by default) of one sync group of ``n``, one
    long-lived thread each: each makes its own client of the store, posts its first beat
    and its hello, builds its channel view and its round, then runs every op it is handed,
    all ranks together. Keys under ``prefix`` (a new one by default), shared by every
    process of one group; ``silent_after``: the bound of the process's one watch."""

    made = 0

    def __init__(
        self,
        n: int,
        port: int,
        ranks: Sequence[int] | None = None,
        prefix: str | None = None,
        silent_after: float = SILENT_AFTER_SECONDS,
    ) -> None:
        self.n = n
        self.prefix = prefix or SyncRanks.new_prefix(n)
        self.trainers = trainer_ranks(n)
        self.rollouts = list(range(len(self.trainers), n))
        watch_tcp = dist.TCPStore("127.0.0.1", port, 1, False, wait_for_workers=False)
        self.membership = SharedMembership(dist.PrefixStore(self.prefix, watch_tcp), silent_after)
        self.port = port
        self.threads = RankThreads(range(n) if ranks is None else ranks, self._join)
        self.states = self.threads.states

    @staticmethod
    def new_prefix(n: int) -> str:
        SyncRanks.made += 1
        return f"scale-sync/{n}/{SyncRanks.made}"

    def _join(self, rank: int) -> SyncRank:
        """What ``init_group`` leaves a rank with, less its own threads and connections."""
        tcp = dist.TCPStore("127.0.0.1", self.port, self.n, False, wait_for_workers=False)
        root = dist.PrefixStore(self.prefix, tcp)
        incarnation = root.add(f"incarnation/{rank}", 1)
        pid = os.getpid()
        hello = {
            "host": host_identity(),
            "pid": pid,
            "start": process_start(pid),
            "incarnation": incarnation,
        }
        root.add(alive_key(rank), 1)  # its first beat, before its hello
        root.set(hello_key(rank), json.dumps(hello))
        membership: object = self.membership
        joined = SyncGroup(
            root, rank, self.n, TIMEOUT_S, "gloo", "127.0.0.1", incarnation, tcp, root, membership
        )  # type: ignore[arg-type]
        group = joined.channel(CHANNEL)
        assert group.waiting_clients is not None
        # the rank's thread is its client's only user while it waits: it serves the waits
        group.waiting_clients.give(group.store)
        state = SyncRank(group)
        if rank in self.trainers:
            trainer = TrainerRound(
                group,
                self.trainers,
                self.rollouts,
                OFFER,
                TIMEOUT_S,
                RolloutVersions(self.rollouts),
            )
            # a steady round: the epoch of these members was entered by an earlier round
            trainer._epoch, trainer._members = 0, list(self.rollouts)
            trainer._lives = {str(r): 1 for r in self.rollouts}
            trainer.state = EpochState.READY
            state.trainer = trainer
        else:
            rollout = RolloutRound(group, self.trainers, {}, TIMEOUT_S)
            rollout.epoch, rollout._members = 0, list(self.rollouts)
            rollout.state = EpochState.READY
            state.rollout = rollout
        return state

    def run(
        self, counter: CallCounter, work: Callable[[SyncRank], None] | None
    ) -> tuple[Counter[int | None], float]:
        """``work(state)`` on every rank, started together (``None``: end every rank's
        thread); returns the calls counted meanwhile and the wall time to the last end."""
        try:
            return self.threads.run(counter, work)
        finally:
            if work is None:
                self.membership.close()


OPS: dict[str, Callable[[SyncRank], None]] = {
    "publish round (first)": publish_round,
    "publish round (steady)": publish_round,
}
"""The first round a process runs (its watch has not seen the members joined yet), then
the next one."""


def measure_sync(n: int, port: int, processes: int, switch_interval: float) -> list[OpFigures]:
    """Every op of :data:`OPS` at ``n`` ranks spread over ``processes`` processes."""
    prefix = SyncRanks.new_prefix(n)
    results, _ = measure_ops(
        n,
        processes,
        lambda share: SyncRanks(n, port, share, prefix, SPREAD_SILENT_AFTER_S),
        OPS,
        switch_interval,
    )
    return results
