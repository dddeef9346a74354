"""The wire protocol between publishers and subscribers: store keys and messages.

Every key a publisher/subscriber set uses is built by :class:`Keys` (all under the set's
channel prefix); every message that crosses the store is one of the dataclasses below,
written as JSON by :func:`encode` and read back by :func:`decode`.

A publish is one *round* ``k``, counted identically on every rank:

1. each rollout that takes part posts :class:`Request` at ``req/{r}/{k}`` (the version it
   holds completely); the lead trainer notes ``next_round`` = ``k`` while it gathers them, so
   a rollout that (re)joins knows which round to ask for;
2. the lead trainer posts :class:`RoundStart` at ``round/{k}``: the version, the plan id, the
   *epoch* of the transport and the *members*, the rollouts taking part (those that asked;
   a rollout found dead is left out and listed in ``absent``). The plan's layout crosses
   once per plan id at ``plan/{id}``;
3. each trainer sends the buckets it owns (:class:`BucketMessage`) over the epoch's
   transport; a trainer that sees the round break posts :class:`RoundAbort` at
   ``round/{k}/abort`` naming the dead ranks, then drops the epoch's transport, so that
   every member blocked on it is freed at once and can name the culprit;
4. each member posts :class:`Ack` at ``ack/{r}/{k}``.

The transport of an epoch is built by every trainer and the round's members when an epoch
starts: a new epoch starts whenever the members change (a rollout died, or one rejoined)
and after a round that broke. Ring transports post :class:`RingInfo` at
``epoch/{e}/{t}`` and each member answers ``epoch/{e}/{t}/opened/{r}``. The kind of
transport is negotiated once, when the publisher starts (:class:`TransportOffer` at
``transport/{t}``, after an optional :class:`Probe`).

A refetch (``cached`` mode) is request ``again/{r}/{n}`` (``n`` from the counter
``again/{r}/count``, so a restarted rollout never reuses one), announced by bumping
``again/requests``; each trainer answers :class:`AgainOffer` at ``.../from/{t}``, the rollout
posts :class:`AgainGo` at ``.../go``, the bytes move, and the rollout posts :class:`Ack` at
``.../ack``.

Invariant: no key is written twice with different meanings: round, epoch and refetch
numbers only grow.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ...core.control_plane import store_key
from ...errors import PeerDiedError, SyncError

_M = TypeVar("_M")


def encode(message: object) -> str:
    """``message`` (one of this module's dataclasses) as JSON."""
    return json.dumps(dataclasses.asdict(message))  # type: ignore[call-overload]


def decode(cls: type[_M], text: bytes | str) -> _M:
    """The ``cls`` message in ``text``; fields it does not know are ignored."""
    return from_fields(cls, json.loads(text))


def from_fields(cls: type[_M], raw: dict[str, Any]) -> _M:
    """The ``cls`` message of the fields ``raw`` (a decoded message's); fields it does not
    know are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in raw.items() if k in names})


@dataclass
class Request:
    """A rollout asks for round ``k``; ``held`` is the version it holds completely (the
    trainers leave out what is unchanged since), or ``None`` (every byte)."""

    held: int | None
    incarnation: int = 0
    delta_base: int | None = None
    """The version whose every bucket token this rollout recorded while applying it in
    place (:mod:`..layout.delta`): deltas from that version may be sent to it. ``None``: dense."""
    wants: str | None = None
    """``<plan>-<digest>``, naming the :class:`Wants` it posted (:meth:`Keys.wants`): over
    the network it is sent only those bytes of a round of that plan."""
    partial: bool = False
    """Its target may keep only part of the tensors (it holds DTensors): in a routed round
    of a plan its ``wants`` are not of, it posts its wants for the round
    (:meth:`Keys.round_wants`) once it reads the round's plan. Neither: every byte."""

    def wants_for(self, plan_id: str) -> str | None:
        """Its wants, when they are of plan ``plan_id``."""
        return wants_of_plan(self.wants, plan_id)


def wants_of_plan(token: str | None, plan_id: str) -> str | None:
    """``token`` (a :attr:`Request.wants`) when it names wants of plan ``plan_id``."""
    return token if token is not None and token.split("-", 1)[0] == plan_id else None


@dataclass
class Wants:
    """The bytes a rollout keeps of plan ``plan``'s tensors: for each tensor index (as a
    string) it keeps in part, its :class:`..layout.runs.Runs` as a list; a tensor not
    named, every byte."""

    plan: str
    runs: dict[str, list[int]]


@dataclass
class RoundStart:
    """The lead trainer starts round ``k``. ``cancelled`` (with no members): the round never
    started (the trainer gave up waiting); a rollout that asked moves on to the next one."""

    version: int
    plan: str
    epoch: int
    members: list[int]
    absent: dict[str, str] = field(default_factory=dict)
    lives: dict[str, int] = field(default_factory=dict)
    """Each member's incarnation: which process of that rank takes part."""
    cancelled: str | None = None
    routed: bool = False
    """The trainers send each member its own bytes, point to point (some member keeps only
    part of this plan's tensors): no relay, no broadcast."""
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each member's :class:`Request`, as the lead read it: every other trainer reads them
    here, in the one key it waits on, not from one key per member."""

    def member_requests(self) -> dict[int, Request]:
        """Each member's request (by rank), as the lead read it."""
        return {int(r): from_fields(Request, raw) for r, raw in self.requests.items()}

    def absent_ranks(self) -> dict[int, str]:
        """Rollout rank -> why it was left out of this round (JSON keys are strings)."""
        return {int(r): why for r, why in self.absent.items()}

    def takes_part(self, rank: int, incarnation: int) -> bool:
        """Whether process ``incarnation`` of ``rank`` is a member of this round."""
        return self.cancelled is None and self.lives.get(str(rank)) == incarnation


@dataclass
class RoundAbort:
    """A round broke: ``dead`` are the ranks found dead (maybe none), ``reason`` the error.
    ``refused_by``: the trainer rank whose own step refused the round (the caller's tensors
    on it did not fit: a layout mismatch, say), which posted this before cutting its
    transport, so every member that finds its transfer cut reads this as the cause."""

    dead: list[int]
    reason: str
    refused_by: int | None = None

    def as_error(self, k: int) -> Exception:
        """The error a member of round ``k`` raises: the dead ranks as its subject, else
        the trainer that refused the round."""
        if self.dead:
            return PeerDiedError(
                f"rollout rank(s) {self.dead} died during round {k}, which the trainers gave "
                f"up: {self.reason}",
                self.dead,
                f"round {k}",
            )
        if self.refused_by is not None:
            return SyncError(
                f"round {k} was given up by trainer rank {self.refused_by}, which refused "
                f"it: {self.reason}"
            )
        return SyncError(f"round {k} was given up by a trainer: {self.reason}")


@dataclass
class Ack:
    """A rollout's answer to a round or a refetch: the version it now holds completely
    (``None``: none), and the error if it did not apply the version."""

    holds: int | None
    error: str | None = None
    broken: bool = False
    """The rollout's transfer broke (it let the round's transport go), as opposed to a
    version it refused after draining the round."""


def ack_line(rank: int, ack: Ack) -> str:
    """Rollout ``rank``'s ``ack`` as a line of :meth:`Keys.acks`."""
    return json.dumps({"rank": rank, **dataclasses.asdict(ack)}) + "\n"


def ack_lines(raw: bytes) -> dict[int, Ack]:
    """Each member's acknowledgement in :meth:`Keys.acks`' lines, by rank."""
    found = {}
    for line in raw.decode().splitlines():
        if line.strip():
            fields = json.loads(line)
            found[int(fields["rank"])] = from_fields(Ack, fields)
    return found


@dataclass
class Probe:
    """A trainer asks each rollout to read ``bytes`` at ``addr`` in process ``pid`` or, when
    ``shared`` holds a description of a buffer shared through torch for the rollout (by
    rank, a :class:`..transport.shared_tensors.SharedBuffer`'s fields; transport ``ipc``), to
    open it and find ``bytes`` there."""

    pid: int
    addr: int
    bytes: list[int]
    shared: dict[str, dict[str, Any]] | None = None


@dataclass
class ProbeReply:
    error: str | None


@dataclass
class ReceiverShape:
    """What a rollout needs to build a receiver matching a trainer's sender."""

    bucket_bytes: int
    num_slots: int
    header_cap: int
    separate_min: int | None


@dataclass
class TransportOffer:
    """The transport a trainer settled on (``kind``), its publishing ``mode``, and the shape
    of its buffers; or ``error`` when none could be agreed."""

    kind: str = ""
    mode: str = ""
    shape: ReceiverShape | None = None
    error: str | None = None

    @classmethod
    def read(cls, text: bytes | str) -> TransportOffer:
        offer = decode(cls, text)
        if isinstance(offer.shape, dict):
            offer.shape = ReceiverShape(**offer.shape)
        return offer


@dataclass
class RingInfo:
    """Where an epoch's shared-memory ring of a trainer lies, and the trainer's pid."""

    path: str
    pid: int


@dataclass
class AgainRequest:
    """Rollout ``rollout``'s refetch request ``n`` (its own count), from its process of
    ``incarnation``; posted under the request's ticket (:meth:`Keys.again_ticket`)."""

    incarnation: int
    rollout: int
    n: int


@dataclass
class CacheAddress:
    """Where a colocated trainer's host cache lies: process, address, bucket offsets."""

    pid: int
    address: int
    offsets: dict[str, int]


@dataclass
class AgainOffer:
    """What a trainer can serve again from its cache, or why not (``error``)."""

    version: int = 0
    plan: str = ""
    kind: str = ""
    shape: ReceiverShape | None = None
    cache: CacheAddress | None = None
    error: str | None = None

    @classmethod
    def read(cls, text: bytes | str) -> AgainOffer:
        offer = decode(cls, text)
        if isinstance(offer.shape, dict):
            offer.shape = ReceiverShape(**offer.shape)
        if isinstance(offer.cache, dict):
            offer.cache = CacheAddress(**offer.cache)
        return offer


@dataclass
class AgainGo:
    go: bool


@dataclass
class BucketMessage:
    """One bucket on its way from its owning trainer: ``header`` (payload bytes, then one
    byte per slice of the bucket saying how its bytes travel: 1 dense in the payload, 0 left
    out as unchanged, 2 (every slice) a delta, :mod:`..layout.delta`) and ``parts``, the payload's
    segments in order (:func:`..layout.segments.payload_segments`; a delta is one segment)."""

    index: int
    header: torch.Tensor
    parts: list[torch.Tensor]


class Keys:
    """Every store key of one publisher/subscriber set (relative to its channel prefix)."""

    ASK_AGAIN_COUNT = "again/requests"
    NEXT_ROUND = "next_round"

    @staticmethod
    def plan(plan_id: str) -> str:
        return store_key("plan", plan_id)

    @staticmethod
    def world_rank(trainer: int) -> str:
        """Trainer ``trainer``'s rank in its job's default process group (once)."""
        return store_key("world_rank", trainer)

    @staticmethod
    def wants(rollout: int, token: str) -> str:
        """Rollout ``rollout``'s :class:`Wants` named ``token`` (``<plan>-<digest>``, posted
        once)."""
        return store_key("wants", rollout, token)

    @staticmethod
    def round_wants(rollout: int, k: int) -> str:
        """Rollout ``rollout``'s :class:`Wants` for round ``k``'s plan, posted once it read
        the round (its request named none of that plan)."""
        return store_key("wants", rollout, "round", k)

    @staticmethod
    def request(rollout: int, k: int) -> str:
        return store_key("req", rollout, k)

    @staticmethod
    def round(k: int) -> str:
        return store_key("round", k)

    @staticmethod
    def abort(k: int) -> str:
        return store_key("round", k, "abort")

    @staticmethod
    def acks(k: int) -> str:
        """Round ``k``'s acknowledgements, one line per member (:func:`ack_line`), appended
        as each is posted: a trainer reads every member's in one request."""
        return store_key("round", k, "acks")

    @staticmethod
    def ack(rollout: int, k: int) -> str:
        return store_key("ack", rollout, k)

    @staticmethod
    def transport(trainer: int) -> str:
        return store_key("transport", trainer)

    @staticmethod
    def probe(trainer: int) -> str:
        return store_key("transport", trainer, "probe")

    @staticmethod
    def probed(trainer: int, rollout: int) -> str:
        return store_key("transport", trainer, "probed", rollout)

    @staticmethod
    def ring(epoch: int, trainer: int) -> str:
        return store_key("epoch", epoch, trainer)

    @staticmethod
    def ring_opened(epoch: int, trainer: int, rollout: int) -> str:
        return store_key("epoch", epoch, trainer, "opened", rollout)

    @staticmethod
    def again_count(rollout: int) -> str:
        return store_key("again", rollout, "count")

    @staticmethod
    def again_ticket(ticket: int) -> str:
        """The refetch request holding ``ticket`` (from :data:`ASK_AGAIN_COUNT`): every
        trainer serves requests in ticket order."""
        return store_key("again", "ticket", ticket)

    @staticmethod
    def again_offer(rollout: int, n: int, trainer: int) -> str:
        return store_key("again", rollout, n, "from", trainer)

    @staticmethod
    def again_go(rollout: int, n: int) -> str:
        return store_key("again", rollout, n, "go")

    @staticmethod
    def again_ack(rollout: int, n: int) -> str:
        return store_key("again", rollout, n, "ack")
