"""A load every rank of a group runs together, each saved byte read from storage once.

The load runs in rounds of the group's :class:`~.agreement.LoadAgreement`, so a rank
that fails any round fails it on every rank, and no rank is ever left waiting on a peer
that has already given up:

1. **Plan.** Every rank checks its state dict against the checkpoint and plans its reads
   (:func:`.load.loader.open_plan`), then posts a summary: a digest of its reads and, per
   file, the range they span (where every rank's is the same, as replicas' are, the
   verdict says only that). Where at most one rank reads anything, or no two ranks'
   ranges meet, the load goes on as every rank alone (round 2 reads and fills; no
   process group is made).
2. **Read.** Otherwise the ranks take slipstream's gloo group (:mod:`.load.exchange`) and learn
   every rank's reads: from their own plan where every digest is equal (DDP replicas
   plan the same reads), else through one ``all_gather_object`` of each rank's wanted
   ranges. Every rank computes the same assignment (:mod:`.load.read_once`) and reads its
   part from storage, verifying checksums as every load does.
3. **Exchange.** Once every rank has read its part, the parts are sent to the ranks that
   want them, and each rank fills its state dict.

Invariant: a rank's state dict is written only once every byte of it is in its memory,
read and verified by the rank that read it from storage; bytes no two ranks want are read
as a load alone reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..core import tracing
from ..core.copy import copy_bytes
from ..core.waits import Deadline
from ..errors import CorruptCheckpointError
from . import peer_transfers
from .agreement import LoadAgreement
from .load import exchange
from .load.loader import PlannedLoad, log_loaded
from .load.read_once import (
    Piece,
    RankShare,
    Transfer,
    Want,
    assign,
    digest,
    hulls,
    hulls_overlap,
    share_of,
)
from .load.reader import ReadRequest
from .peer_transfers import Move
from .save.channel import RankChannel

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ABANDONED_JOIN_SECONDS = 1.0
"""How long a failed load waits for each transfer waiter a death left behind."""
_abandoned: list[threading.Thread] = []
"""Waiters a death left behind (:mod:`.peer_transfers`): daemon threads whose works end at
the group's timeout at the latest."""


class Sharing(Enum):
    """How the ranks of a load split its reads, the same on every rank."""

    ALONE = "alone"
    """Each rank reads all it needs itself (no two ranks want a byte in common)."""
    SAME_PLAN = "same plan"
    """Every rank planned the same reads: the assignment follows from one's own plan."""
    OVERLAPPING = "overlapping"
    """Ranks' reads meet: every rank's wanted ranges are gathered first."""


@dataclass(frozen=True)
class _HostRead:
    """A planned read into host memory, and the bytes of its file it fills."""

    request: ReadRequest
    want: Want


def _host_reads(planned: PlannedLoad | None) -> list[_HostRead]:
    if planned is None:
        return []
    out = []
    for r in planned.reads:
        if r.out is None:
            continue
        src = r.source
        block = src.block_bytes if src.blocks is not None else 0
        want = Want(
            src.file, src.data_offset + r.start, src.data_offset + r.end, src.data_offset, block
        )
        out.append(_HostRead(r, want))
    return out


def _summary(planned: PlannedLoad | None) -> dict[str, Any] | None:
    wants = [h.want for h in _host_reads(planned)]
    if not wants:
        return None
    spans = {file: [lo, hi] for file, (lo, hi) in hulls(wants).items()}
    split = planned is not None and planned.reader.storage.splits_shared_reads
    return {"digest": digest(wants), "hulls": spans, "split": split}


def sharing(summaries: Sequence[dict[str, Any] | None]) -> Sharing:
    """How a load whose ranks posted ``summaries`` (:func:`_summary`) splits its reads."""
    present = [s for s in summaries if s is not None]
    if len(present) < 2 or not all(s["split"] for s in present):
        return Sharing.ALONE
    if len(present) == len(summaries) and len({s["digest"] for s in present}) == 1:
        return Sharing.SAME_PLAN
    spans = [{f: (int(lo), int(hi)) for f, (lo, hi) in s["hulls"].items()} for s in present]
    return Sharing.OVERLAPPING if hulls_overlap(spans) else Sharing.ALONE


def _view(host: _HostRead, lo: int, hi: int) -> memoryview:
    """The destination bytes of ``host`` that bytes ``[lo, hi)`` of its file land in."""
    assert host.request.out is not None, "host reads only"
    return host.request.out[lo - host.want.lo : hi - host.want.lo]


def _own_request(host: _HostRead, lo: int, hi: int) -> ReadRequest:
    origin = host.request.source.data_offset
    return replace(host.request, start=lo - origin, end=hi - origin, out=_view(host, lo, hi))


@dataclass
class _Part:
    """What round 2 left for round 3 on this rank."""

    group: dist.ProcessGroup
    share: RankShare
    hosts: list[_HostRead]
    read: int


def _verified(planned: PlannedLoad, work: Callable[[], _T]) -> _T:
    """``work()``, a checkpoint that turns out corrupt reported as gone where it was
    deleted meanwhile (as :func:`.load.loader.load_from` reports it)."""
    try:
        return work()
    except CorruptCheckpointError as exc:
        gone = planned.reader.vanished(exc)
        if gone is exc:
            raise
        raise gone from exc


def _alone(planned: PlannedLoad | None, started: float) -> None:
    if planned is None:
        return

    def work() -> None:
        with tracing.span("slipstream.load", url=planned.reader.path):
            nbytes = planned.read()
            planned.finish()
        log_loaded(planned.reader.path, nbytes, time.perf_counter() - started)

    _verified(planned, work)


def _read_part(
    planned: PlannedLoad | None,
    mode: Sharing,
    global_ranks: Sequence[int],
    timeout: float | None,
) -> _Part:
    group = exchange.exchange_group(global_ranks, timeout)
    me = dist.get_rank(group)
    hosts = _host_reads(planned)
    wants = [h.want for h in hosts]
    if mode is Sharing.SAME_PLAN:
        every = [wants] * dist.get_world_size(group)
    else:
        every = exchange.gather_objects(group, wants)
    pieces: list[Piece] = assign(every)
    share = share_of(pieces, me)
    if planned is None:
        return _Part(group, share, hosts, 0)
    own = [_own_request(hosts[r.want], r.lo, r.hi) for r in share.reads]
    own += [r for r in planned.reads if r.out is None]
    with tracing.span("slipstream.load", url=planned.reader.path, shared=mode.value):
        nbytes = _verified(planned, lambda: planned.read(reads=own))
    return _Part(group, share, hosts, nbytes)


def _exchange(
    planned: PlannedLoad | None,
    part: _Part,
    channel: RankChannel,
    where: str,
    timeout: float | None,
) -> int:
    hosts, share = part.hosts, part.share
    sends = [(t, _view(hosts[t.source], t.lo, t.hi)) for t in share.sends]
    receives = [(t, _view(hosts[t.dest], t.lo, t.hi)) for t in share.receives]
    with tracing.span("slipstream.load.exchange", sends=len(sends), receives=len(receives)):
        received = _move(part.group, channel, sends, receives, where, timeout)
    for t in share.copies:
        copy_bytes(_view(hosts[t.dest], t.lo, t.hi), _view(hosts[t.source], t.lo, t.hi))
    if planned is not None:
        planned.finish()
    return received


def _tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)


def _move(
    group: dist.ProcessGroup,
    channel: RankChannel,
    sends: Sequence[tuple[Transfer, memoryview]],
    receives: Sequence[tuple[Transfer, memoryview]],
    where: str,
    timeout: float | None,
) -> int:
    """Send and receive every transfer (each with the bytes it sends from, or lands in),
    all posted at once and then waited for, a peer found dead ending the wait
    (:mod:`.peer_transfers`); returns the bytes received."""
    moves = [
        Move(t.peer, t.tag, _tensor(view), True, f"sending bytes {t.lo}-{t.hi} of {t.file} "
             f"to rank {t.peer} (read-once load of {where})")
        for t, view in sends
    ]  # fmt: skip
    moves += [
        Move(t.peer, t.tag, _tensor(view), False, f"receiving bytes {t.lo}-{t.hi} of {t.file} "
             f"from rank {t.peer} (read-once load of {where})")
        for t, view in receives
    ]  # fmt: skip
    deadline = Deadline(exchange.DEFAULT_TIMEOUT_S if timeout is None else timeout)
    return peer_transfers.move(group, channel, moves, deadline, _abandoned)


def _join_abandoned() -> None:
    """Join the waiters a death left behind, as far as a second each allows."""
    waiters, _abandoned[:] = list(_abandoned), []
    for waiter in waiters:
        waiter.join(ABANDONED_JOIN_SECONDS)


def load(
    agreement: LoadAgreement,
    what: str,
    prepare: Callable[[], PlannedLoad | None],
    timeout: float | None,
) -> None:
    """Run the load ``prepare`` plans (``None``: one it finished itself) on every rank of
    ``agreement``'s group, in the rounds of the module docstring; ``what`` names it in
    errors. Every rank of the group calls this together; with one rank it is a plain load."""
    started = time.perf_counter()
    channel = agreement.channel
    if channel.world_size == 1:
        planned = prepare()
        try:
            _alone(planned, started)
        finally:
            if planned is not None:
                planned.reader.close()
        return
    held: list[PlannedLoad] = []

    def plan() -> dict[str, Any] | None:
        planned = prepare()
        if planned is not None:
            held.append(planned)
        return _summary(planned)

    try:
        own, summaries = agreement.same(what, plan, timeout)
        mode = sharing([own] * channel.world_size if summaries is None else summaries)
        planned = held[0] if held else None
        if mode is Sharing.ALONE:
            agreement.run(what, lambda: _alone(planned, started), timeout)
            return
        ranks = sorted(channel.global_ranks)
        try:
            part = agreement.run(what, lambda: _read_part(planned, mode, ranks, timeout), timeout)
            received = agreement.run(
                what, lambda: _exchange(planned, part, channel, what, timeout), timeout
            )
        except Exception:
            exchange.forget_group(ranks)  # every rank raised here: the agreement's invariant
            _join_abandoned()
            raise
        if planned is not None:
            logger.info(
                "%s: read %.3f GiB from storage, %.3f GiB from %d peer(s) (%s)",
                what,
                part.read / 2**30,
                received / 2**30,
                channel.world_size - 1,
                mode.value,
            )
            log_loaded(planned.reader.path, part.read + received, time.perf_counter() - started)
    finally:
        for planned_load in held:
            planned_load.reader.close()
