"""Store traffic of checkpoint and sync group coordination against the number of ranks
(issue 55).

N simulated ranks, each a thread with its own client of one real TCPStore (hosted by a
child process, as rank 0's process hosts a job's), spread over ``--processes`` forked
processes (rank 0 alone in one; :class:`store_calls.RankProcesses`), run the real coordination
code of slipstream's checkpoints on tiny layouts: the layout exchange of a first save, the
commit round of every save, a second saver of the same layout (a new ``Checkpointer``), the
load agreement of ``ss.load`` and ``Checkpointer.load``'s step agreement and load rounds,
and an idle second with every channel open; then a publish round of the sync group
(:mod:`scale_sync`). Every ``torch.distributed.Store`` call made from Python is counted
(:mod:`store_calls`) and charged to the rank whose thread made it; the calls of the
process's own heartbeat and watch thread are counted apart, as background traffic.
Reported per op: the median and the largest count of the ranks other than the coordinator
(rank 0), the coordinator's count, and the wall time from the start of the op on every
rank to its end on the last.

    python benchmarks/scale.py --out benchmarks/results/scale.json
    python benchmarks/scale.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import Result, Table  # noqa: E402
from scale_sync import OPS as SYNC_OPS  # noqa: E402
from scale_sync import measure_sync  # noqa: E402
from store_calls import (  # noqa: E402
    SPREAD_SILENT_AFTER_S,
    CallCounter,
    OpFigures,
    RankThreads,
    measure_ops,
    store_host,
)

from slipstream.checkpoint import collective_load  # noqa: E402
from slipstream.checkpoint.agreement import agreement_for  # noqa: E402
from slipstream.checkpoint.save import channel as channel_module  # noqa: E402
from slipstream.checkpoint.save import saver as saver_module  # noqa: E402
from slipstream.checkpoint.save.channel import RankChannel, waiting_clients  # noqa: E402
from slipstream.checkpoint.save.layout import LocalLayout, local_layout  # noqa: E402
from slipstream.checkpoint.save.messages import CommitOutcome, Topics, WriteReport  # noqa: E402
from slipstream.checkpoint.save.plan import SavePlan  # noqa: E402
from slipstream.core.store_watch import StoreWatch  # noqa: E402
from slipstream.core.waits import Deadline  # noqa: E402


def rank_layout(rank: int) -> LocalLayout:
    """A tiny state: one tensor every rank holds, one of its own, one plain value."""
    return local_layout({"shared": torch.zeros(4), f"own{rank}": torch.zeros(2), "step": 1})


TIMEOUT_S = 120.0
WALL_NOTE = (
    "The ranks are threads of 8 forked processes (rank 0, the coordinator, "
    "alone in one, as a job's rank 0 has a process of its own; the others dealt among 7), "
    "sharing this host's 2 cores with the store's host process: the wall times bound from "
    "above what one process per rank would take. The store's one server thread answers "
    "about 18,000 requests a second on this host (4,096 ranks making 9 requests each of "
    "their own keys, no coordination, took 2.1 s), and every simulated rank also beats once "
    "a second: at 4,096 ranks the server alone needs about 2.6 s for a first save's 9 "
    "requests a rank."
)


@dataclass
class RankState:
    """One simulated rank: its channel (a saver's), its layout, its save count."""

    channel: RankChannel
    layout: LocalLayout
    store: dist.Store
    namespace: str
    seq: int = 0
    channels: int = 1

    def close(self) -> None:
        self.channel.close()


def _plan(state: RankState) -> SavePlan:
    """The layout exchange of a first save, as the saver runs it."""
    return saver_module.exchange_plan(
        state.channel, state.layout, state.seq, "scale", Deadline(TIMEOUT_S)
    )


def _commit_round(state: RankState, fingerprint: str) -> None:
    """A save's commit round as the saver runs it, less the storage: every rank posts its
    write report, rank 0 gathers them and posts the outcome (and forgets the last one),
    every rank waits for it and forgets its report."""
    ch, seq = state.channel, state.seq
    ch.post(Topics.written(seq), WriteReport(fingerprint))
    deadline = Deadline(TIMEOUT_S)
    if ch.rank == 0:
        ch.gather(Topics.written(seq), WriteReport.from_json, deadline, "finish writing")
        ch.post(Topics.commit(seq), CommitOutcome(save_id=f"save-{seq}"))
        if seq > 0:
            ch.forget(Topics.commit(seq - 1), [0])
    outcome = ch.receive(Topics.commit(seq), CommitOutcome.from_json, 0, deadline, "commit")
    assert outcome.error is None, outcome.error
    ch.forget(Topics.written(seq), [ch.rank])
    state.seq += 1


def first_save(state: RankState) -> None:
    """A save of a layout this process has not planned (the plan kept for the next)."""
    cached = saver_module.cached_plan(state.channel, state.layout.signature)
    if cached is None:
        plan = _plan(state)
        saver_module._keep_plan(state.channel, state.layout.signature, plan)
    else:
        plan = cached[0]
    _commit_round(state, plan.fingerprints[plan.rank])


def steady_save(state: RankState) -> None:
    _commit_round(state, state.layout.fingerprint())


def new_saver_first_save(state: RankState) -> None:
    """A new ``Checkpointer`` beside the first saver: a channel of its own, then its first
    save of the layout the first saver planned already."""
    state.channels += 1
    old = state.channel
    state.channel = RankChannel(
        state.store, old.rank, old.world_size, f"{state.namespace}/{state.channels}"
    )
    state.seq = 0
    old.close()
    first_save(state)


def plain_load(state: RankState) -> None:
    """``ss.load``'s rounds (:func:`slipstream.checkpoint.collective_load.load`): the plan
    round, then the reads, each rank's plan empty (no storage: a rank that reads nothing
    takes part in every round all the same, and no two ranks' reads meet, so the load goes
    on as every rank alone, with no process group made)."""
    collective_load.load(agreement_for(state.channel), "load", lambda: None, TIMEOUT_S)


def checkpointer_load(state: RankState) -> None:
    """``Checkpointer.load`` without a step, as ``Checkpointer._load_agreed`` runs it: the
    newest step agreed in one round, then that step's load in ``ss.load``'s rounds."""
    agreement = agreement_for(state.channel)
    loaded, differ = agreement.same("load of the newest step", lambda: 7, TIMEOUT_S)
    assert loaded == 7 and differ is None
    collective_load.load(agreement, "load of step 7", lambda: None, TIMEOUT_S)


OPS: dict[str, Callable[[RankState], None]] = {
    "ss.save (first)": first_save,
    "ss.save (steady)": steady_save,
    "Checkpointer.save (first)": new_saver_first_save,
    "ss.load": plain_load,
    "Checkpointer.load": checkpointer_load,
}


class OneWatch:
    """Every simulated rank's channels share one liveness thread (it beats each rank's
    counter and watches every rank's waits, in one read per look), as the ranks of one
    process would: a thread per simulated rank would starve them all of the interpreter
    lock at thousands of ranks. Its calls are background calls, counted apart.
    ``silent_after``: how long a rank may be silent before it is judged dead (the
    channels' own bound by default)."""

    def __init__(self, port: int, prefix: str, silent_after: float | None = None) -> None:
        tcp = dist.TCPStore("127.0.0.1", port, 1, False, wait_for_workers=False)
        self.watch = channel_module._watch_for(dist.PrefixStore(prefix, tcp))
        if silent_after is not None:
            self.watch.silent_after = silent_after

    def acquire(self, store: dist.Store) -> StoreWatch:
        return self.watch

    def release(self, store: dist.Store) -> None:
        pass


class Ranks:
    """The simulated ranks ``ranks`` (all ``n`` by default) of a job of ``n`` ranks of
    checkpoints (:class:`store_calls.RankThreads`): each makes its own client of the store
    and its channel; one watch serves them all, as a process's one watch does. The job's
    keys are under ``prefix`` (a new one by default), which every process of one job is
    given; ``silent_after``: see :class:`OneWatch`."""

    made = 0

    def __init__(
        self,
        n: int,
        port: int,
        ranks: Sequence[int] | None = None,
        prefix: str | None = None,
        silent_after: float | None = None,
    ) -> None:
        self.n = n
        self.port = port
        self.prefix = prefix or Ranks.new_prefix(n)
        """This job's own keys: one job's leftovers never meet another's."""
        self._watches = OneWatch(port, self.prefix, silent_after)
        self._saved_watches = channel_module.WATCHES
        channel_module.WATCHES = self._watches  # type: ignore[assignment]
        self.threads = RankThreads(
            range(n) if ranks is None else ranks, self._make, lambda state: state.close()
        )
        self.states = self.threads.states

    @staticmethod
    def new_prefix(n: int) -> str:
        Ranks.made += 1
        return f"scale/{n}/{Ranks.made}"

    def _make(self, rank: int) -> RankState:
        tcp = dist.TCPStore("127.0.0.1", self.port, self.n, False, wait_for_workers=False)
        store = dist.PrefixStore(self.prefix, tcp)
        namespace = "channel"
        # A rank's thread is the only user of its client while it waits, so the client
        # serves its blocking waits too: one connection fewer per rank (this host's
        # TCPStore server stands still ~5 s on about one new connection in 25).
        waiting_clients(store).give(store)
        channel = RankChannel(store, rank, self.n, namespace)
        return RankState(channel, rank_layout(rank), store, namespace)

    def run(
        self, counter: CallCounter, work: Callable[[RankState], None] | None
    ) -> tuple[Counter[int | None], float]:
        """``work(state)`` on every rank, started together (``None``: close every rank);
        returns the calls counted meanwhile and the wall time to the last rank's end."""
        try:
            return self.threads.run(counter, work)
        finally:
            if work is None:
                self._watches.watch.close()
                channel_module.WATCHES = self._saved_watches


def measure(
    n: int, port: int, processes: int, switch_interval: float, idle_s: float
) -> tuple[list[OpFigures], float]:
    """Every op of :data:`OPS` at ``n`` ranks (every rank's waiting client used once first,
    untimed), then the idle traffic."""
    prefix = Ranks.new_prefix(n)
    ops = {WARM_UP: plain_load, **OPS}
    results, idle = measure_ops(
        n,
        processes,
        lambda share: Ranks(n, port, share, prefix, SPREAD_SILENT_AFTER_S),
        ops,
        switch_interval,
        WARM_UP,
        idle_s,
    )
    assert idle is not None
    return results, idle


WARM_UP = "warm-up"


def comparison(before: dict[str, Any], rows: list[OpFigures]) -> Table:
    """The figures of ``before`` (a result of this harness on earlier code) beside these,
    for every (op, ranks) both measured."""
    then = {(r[0], r[1]): r for r in before["tables"][0]["rows"]}
    table = Table(
        f"before ({before['command']}, {before['date']}) and now",
        [
            "op",
            "ranks",
            "median rank > 0 before",
            "now",
            "coordinator before",
            "now",
            "wall s before",
            "now",
        ],
    )
    for f in rows:
        old = then.get((f.op, f.ranks))
        if old is not None:
            table.rows.append(
                [
                    f.op,
                    f.ranks,
                    old[2],
                    f.median_rank,
                    old[4],
                    f.coordinator,
                    old[5],
                    round(f.wall_s, 3),
                ]
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 1024, 4096])
    parser.add_argument("--quick", action="store_true", help="N = 2 and 16 only")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle measured")
    parser.add_argument(
        "--processes",
        type=int,
        default=8,
        help="processes the checkpoint ops' ranks are spread over: rank 0 alone, the others shared",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.02,
        help="sys.setswitchinterval of those processes, seconds",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--before",
        default=None,
        help="a result file of this harness run on earlier code: its figures beside these",
    )
    args = parser.parse_args()
    ranks = [2, 16] if args.quick else args.ranks
    rows: list[OpFigures] = []
    idle: dict[int, float] = {}
    with store_host() as port:
        for n in ranks:
            found, idle[n] = measure(n, port, args.processes, args.switch_interval, args.idle)
            rows.extend(found)
            rows.extend(measure_sync(n, port, args.processes, args.switch_interval))
    table = Table(
        "store calls per op and wall time against the number of ranks",
        ["op", "ranks", "median rank > 0", "max rank > 0", "coordinator", "wall s"],
    )
    for f in rows:
        table.rows.append(
            [f.op, f.ranks, f.median_rank, f.max_rank, f.coordinator, round(f.wall_s, 3)]
        )
    idle_table = Table("idle traffic, every channel open", ["ranks", "calls per rank per second"])
    for n, v in idle.items():
        idle_table.rows.append([n, round(v, 2)])
    tables = [table, idle_table]
    if args.before:
        tables.append(comparison(json.loads(Path(args.before).read_text()), rows))
    floors: list[tuple[str, float, str, bool]] = []
    by = {(f.op, f.ranks): f for f in rows}
    small, large = min(ranks), max(ranks)
    for op in [*OPS, *SYNC_OPS]:
        if (op, small) in by and (op, large) in by and large > small:
            a, b = by[(op, small)], by[(op, large)]
            floors.append(
                (
                    f"{op}: median calls of a rank > 0 at N={large} vs N={small}",
                    b.median_rank / max(a.median_rank, 1.0),
                    "<= 1.5",
                    b.median_rank <= 1.5 * a.median_rank,
                )
            )
        f = by.get((op, large))
        if f is not None:
            floors.append(
                (
                    f"{op}: the coordinator's calls at N={large} (8N + 20 = {8 * large + 20})",
                    f.coordinator,
                    f"<= {8 * large + 20}",
                    f.coordinator <= 8 * large + 20,
                )
            )
    first = by.get(("ss.save (first)", large))
    if first is not None:
        floors.append(
            (
                f"the first save's coordination at N={large}, seconds",
                first.wall_s,
                "< 3",
                first.wall_s < 3,
            )
        )
    for claim, measured, floor, passed in floors:
        print(f"{'ok ' if passed else 'MISSED'} {claim}: {measured:.3g} ({floor})")
    if args.out:
        result = Result(
            benchmark="scale",
            title="Coordination's store traffic against the number of ranks: checkpoints and "
            "a publish round",
            command="python benchmarks/scale.py " + " ".join(sys.argv[1:]),
            setup={
                "ranks": ranks,
                "beat_s": channel_module.BEAT_SECONDS,
                "processes": args.processes,
                "switch interval s": args.switch_interval,
            },
            tables=tables,
            notes=[
                "Every rank's client connections are made before the ops are timed (a "
                "TCPStore looks up the name of each connection's address, and this host's "
                "name server drops about one query in 25: the harness resolves with "
                "RES_OPTIONS 'timeout:1 attempts:1', which makes such a connection wait 1 s "
                "instead of 5). A rank's own "
                "client also serves its blocking waits (its thread is the client's only "
                "user meanwhile), so a simulated rank holds two connections, not three.",
                WALL_NOTE,
                "A publish round (benchmarks/scale_sync.py): the sync group's real round "
                "code on trainers 0 and 1 and N - 2 rollouts, in a steady epoch (no "
                "transport built, no bytes moved): the requests, the lead's round start, "
                "the blocking waits for it and the acknowledgements.",
            ],
        )
        for claim, measured, floor, passed in floors:
            result.floor(claim, measured, floor, passed)
        result.write(args.out)


if __name__ == "__main__":
    main()
