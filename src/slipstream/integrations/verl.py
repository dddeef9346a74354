"""slipstream as a verl checkpoint engine: importing this module registers the backend
``"slipstream"`` in verl's ``CheckpointEngineRegistry``.

Select it with::

    actor_rollout_ref.rollout.checkpoint_engine.backend=slipstream
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=slipstream.integrations.verl

verl's ``CheckpointEngineManager`` runs ``prepare -> build_topology -> init_process_group ->
send_weights / receive_weights -> finalize`` on every update. This engine keeps what those
calls describe instead of rebuilding it each time:

- **One sync group.** The first ``init_process_group`` builds a slipstream sync group over
  every trainer and rollout worker; its store is hosted by actor rank 0 (the engine built
  with ``is_master=True``) at the node IP Ray gives it and a port it picked in ``prepare``.
  Later updates reuse the group, its publisher and its subscribers; ``finalize`` frees
  nothing.
- **Rollouts keep their rank.** Every engine has an identity, reported by ``prepare``; the
  master engine remembers which engine holds each rollout rank and reports it in its own
  ``prepare`` metadata, from which ``build_topology`` (a classmethod, run by the manager)
  gives every known rollout its rank again. A rollout engine that is new (a replica added,
  or one Ray restarted) takes a rank that no present rollout holds, or the rank past the
  group's size when there is none, and joins the running group there (``init_group`` at
  that rank: a rejoin, or the group growing).
- **Rollouts come and go on one channel.** The publisher/subscriber set is built once, on
  the first update; when ``add_replicas`` or ``remove_replicas`` changes the set of rollout
  ranks, the trainers' publishers take the new set (``WeightPublisher.set_rollouts``),
  keeping their version, plan, host cache and delta base: a rollout that stays gets deltas
  again at once, a new one (at a rank past the group's first size too: the group grows)
  gets every byte on its next ``receive_weights``, or at once from the trainers' caches
  through ``get_weights`` in ``mode="cached"``. A removed replica's engine, idle, is never
  waited for. A rollout that dies is left out by slipstream itself.
- **The first update streams too.** ``send_weights`` reads verl's generator as it yields,
  a few buckets' worth of its tensors alive at once, on the first update as on later ones:
  the first version's buckets carry the layout (slipstream's described rounds), so no
  update lists the generator. (``mode="cached"`` keeps a host copy of the model by design;
  its first update reads the generator whole.)
- **Versions.** ``global_steps`` is the published version when it is larger than the last
  one; otherwise (``None``, or a step published again) the next number is: every trainer
  rank derives the same sequence, and a rollout only ever moves forward.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncGenerator, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache

from .. import sync
from ..sync import SyncGroup, WeightPublisher, WeightSubscriber

BACKEND = "slipstream"


@dataclass(frozen=True)
class GroupState:
    """What the master engine knows of the sync group, reported by its ``prepare``.

    ``world_size`` is ``None`` until the group is built. ``holders`` maps each rollout rank
    given out so far to the identity of the engine that holds it now; ``rollout_ranks`` are
    the ranks of the current update's rollouts, ``channel`` the name of the one channel
    they are published to and ``epoch`` how many sets of rollout ranks came before the
    current one. ``world_size`` grows when a new rollout finds no rank to take."""

    host: str
    port: int
    world_size: int | None = None
    trainers: int = 0
    holders: dict[int, str] = field(default_factory=dict)
    rollout_ranks: tuple[int, ...] = ()
    channel: str | None = None
    epoch: int = -1

    def rank_of(self, identity: str) -> int:
        return next(r for r, i in self.holders.items() if i == identity)


@dataclass(frozen=True)
class EngineMetadata:
    """One worker's ``prepare`` result: its engine's identity; the master adds the group's
    state."""

    identity: str
    group: GroupState | None = None


@dataclass(frozen=True)
class Topology:
    """One worker's ``init_process_group`` argument: where the group is, this worker's rank
    in it, and the channel of this update's set of trainers and rollouts."""

    host: str
    port: int
    world_size: int
    rank: int
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    channel: str
    state: GroupState


def assign(state: GroupState, trainers: int, rollouts: Sequence[str]) -> GroupState:
    """The group after an update with ``trainers`` trainer workers and the rollout engines
    ``rollouts`` (identities, in the manager's order).

    Trainers are ranks ``0 .. trainers - 1``. A rollout that holds a rank keeps it; one that
    holds none (a new engine) takes a rank no present rollout holds, one never given out
    first, and past the group's size when there is none (the group grows by one). The
    channel is named on the first update and stays; ``epoch`` counts the sets of rollout
    ranks."""
    if len(set(rollouts)) != len(rollouts):
        raise ValueError(f"the same rollout engine appears twice in one update: {list(rollouts)}")
    world = state.world_size if state.world_size is not None else trainers + len(rollouts)
    if state.world_size is not None and trainers != state.trainers:
        raise ValueError(
            f"the slipstream sync group was built for {state.trainers} trainer worker(s), "
            f"this update has {trainers}"
        )
    holders = dict(state.holders)
    present = set(rollouts)
    placed = set(holders.values())
    free = sorted(
        (r for r in range(trainers, world) if holders.get(r) not in present),
        key=lambda r: (r in holders, r),
    )
    for identity in rollouts:
        if identity in placed:
            continue
        if not free:
            free.append(world)
            world += 1
        holders[free.pop(0)] = identity
    members = tuple(sorted(r for r, i in holders.items() if i in present))
    epoch = state.epoch
    if state.channel is None or members != state.rollout_ranks:
        epoch += 1
    channel = state.channel or "verl-0"
    return GroupState(state.host, state.port, world, trainers, holders, members, channel, epoch)


def host_copy(items: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
    """A module whose buffers are ``items`` under their dotted names (nested modules along
    the dots): a receive target that slipstream fills in place, deltas included."""
    root = nn.Module()
    for name, tensor in items:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_buffer(leaf, tensor)
    return root


def _node_ip() -> str:
    """The address Ray gives this node (a loopback one when Ray runs no cluster)."""
    import ray.util

    return str(ray.util.get_node_ip_address()).strip("[]")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@CheckpointEngineRegistry.register(BACKEND)
class SlipstreamCheckpointEngine(CheckpointEngineWithCache):
    """A verl checkpoint engine over a slipstream sync group (see the module's docstring).

    Built as verl builds engines: ``bucket_size`` and ``is_master`` on trainer workers,
    ``bucket_size`` on rollouts; the rest comes from ``engine_kwargs.slipstream``:
    ``mode`` (``"direct"`` or ``"cached"``, the publisher's), ``transport``, ``delta``,
    ``timeout`` (seconds, every wait of the group), ``host`` (the store's address; Ray's
    node IP when left out), ``full`` (rollouts ask for every tensor on every update,
    instead of those changed since the version they hold) and ``local_cache`` (a rollout
    keeps a host copy of the weights, received into in place: cached mode's deltas reach
    it, and ``get_weights`` serves from it).

    ``receive_weights`` yields the tensors of the published version (those that changed,
    unless ``full``; every one with ``local_cache``); ``get_weights`` yields every tensor
    of the local cache, or else of the version in the trainers' caches (``mode="cached"``),
    without waiting for a publish.
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        mode: str = "direct",
        transport: str = "auto",
        delta: bool | None = None,
        timeout: float = 300.0,
        host: str | None = None,
        full: bool = False,
        local_cache: bool = False,
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.mode = mode
        self.transport = transport
        self.delta = delta
        self.timeout = timeout
        self.full = full
        self.local_cache = local_cache
        self.cache: nn.Module | None = None
        self.identity = uuid.uuid4().hex
        self.version: int | None = None
        self.group: SyncGroup | None = None
        self.publisher: WeightPublisher | None = None
        self.subscriber: WeightSubscriber | None = None
        self._host = host
        self._state: GroupState | None = None
        self._address: tuple[str, int] | None = None

    # ------------------------------------------------------------------ the manager's calls
    # verl's base class annotates prepare() as a dict, init_process_group as **kwargs and the
    # receiving methods as coroutines; its own engines return dataclasses, take named
    # arguments and are async generators, as these are.
    def prepare(self) -> EngineMetadata:  # type: ignore[override]
        """This engine's identity; on the master, the group's state (its address picked on
        the first call)."""
        if not self.is_master:
            return EngineMetadata(self.identity)
        if self._state is None:
            host = self._host or _node_ip()
            self._state = GroupState(host, _free_port(host))
        return EngineMetadata(self.identity, self._state)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = metadata[0]
        if not isinstance(master, EngineMetadata) or master.group is None:
            raise ValueError(
                "actor rank 0's checkpoint engine must be the slipstream master "
                "(built with is_master=True); its prepare() reported no group"
            )
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(
                f"{len(metadata)} prepare() results for {actor_wg_world_size} trainer and "
                f"{rollout_world_size} rollout workers"
            )
        rollouts = [m.identity for m in metadata[actor_wg_world_size:]]
        state = assign(master.group, actor_wg_world_size, rollouts)
        assert state.world_size is not None and state.channel is not None
        trainer_ranks = tuple(range(actor_wg_world_size))

        def topology(rank: int) -> Topology:
            return Topology(
                state.host,
                state.port,
                state.world_size or 0,
                rank,
                trainer_ranks,
                state.rollout_ranks,
                state.channel or "",
                state,
            )

        actor = {"topology": [topology(r) for r in trainer_ranks]}
        rollout = {"topology": [topology(state.rank_of(i)) for i in rollouts]}
        return actor, rollout

    def init_process_group(self, topology: Topology) -> None:  # type: ignore[override]
        """Join the sync group the first time (or at a new rank), build this engine's end of
        the channel the first time, and give the trainers' publishers this update's set of
        rollouts when it changed; otherwise reuse all of it."""
        t = topology
        group = self.group
        if group is not None and (group.rank != t.rank or self._address != (t.host, t.port)):
            self._close_ends()
            group.close()
            group = self.group = None
        if group is None:
            group = sync.init_group(t.host, t.port, t.world_size, t.rank, timeout=self.timeout)
            self.group, self._address = group, (t.host, t.port)
        if t.rank in t.trainer_ranks:
            if self.publisher is None and t.rollout_ranks:
                self.publisher = WeightPublisher(
                    group,
                    t.trainer_ranks,
                    t.rollout_ranks,
                    bucket_bytes=self.bucket_size,
                    mode=self.mode,
                    transport=self.transport,
                    channel=t.channel,
                    delta=self.delta,
                )
            elif self.publisher is not None and self.publisher.rollout_ranks != list(
                t.rollout_ranks
            ):
                self.publisher.set_rollouts(t.rollout_ranks)
        elif self.subscriber is None:
            self.subscriber = WeightSubscriber(
                group, t.trainer_ranks, t.rollout_ranks, channel=t.channel
            )
        if self.is_master:
            self._state = t.state

    def finalize(self) -> None:
        """Nothing to free: the group, the publisher and the subscriber serve the next
        update."""

    # --------------------------------------------------------------------------- weights
    async def send_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
    ) -> dict[str, Any]:
        """Publish ``weights`` and wait until every rollout holds them.

        The generator is read on this thread (the actor's gathers each tensor collectively
        over the trainers) as the publisher packs and sends: a few buckets' worth of its
        tensors are alive at once, never the whole model, on the first update (whose buckets
        carry the layout) as on the others."""
        publisher = self.publisher
        if publisher is None:
            if self.group is None:
                raise RuntimeError("send_weights before init_process_group")
            for _ in weights:  # no rollout takes part; producing each tensor is collective
                pass
            return {}
        version = self._next_version(global_steps)
        handle = publisher.publish(weights, version=version)
        await asyncio.wrap_future(handle.delivered)
        t = handle.timings
        return {
            "slipstream/version": version,
            "slipstream/sent_bytes": t.nbytes,
            "slipstream/dense_bytes": t.dense_bytes,
            "slipstream/blocked_s": t.blocked,
            "slipstream/delivered_s": t.delivered,
            "slipstream/changed_fraction": t.changed_fraction,
        }

    def _next_version(self, global_steps: int | None) -> int:
        """``global_steps`` when it is past the last version, else the next number (the
        same on every trainer rank)."""
        last = self.version
        if global_steps is not None and (last is None or global_steps > last):
            version = global_steps
        else:
            version = 0 if last is None else last + 1
        self.version = version
        return version

    async def receive_weights(  # type: ignore[override]
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The next published version's tensors, yielded as their buckets arrive, each
        valid until the next is asked for: those changed since the version held, unless the
        engine was built with ``full=True``.

        With ``local_cache=True``: the first version is kept in a host copy as it is
        yielded; from then on each version is received into that copy, in place (so deltas
        apply), and every tensor of it is yielded."""
        subscriber = self._subscriber_for("receive_weights")
        if not self.local_cache:
            async for name, tensor in subscriber.areceive_iter(full=self.full):
                yield name, tensor
        elif self.cache is None:
            kept = []
            async for name, tensor in subscriber.areceive_iter(full=True):
                kept.append((name, tensor.clone()))
                yield kept[-1]
            self.cache = host_copy(kept)
        else:
            await asyncio.to_thread(subscriber.receive, self.cache)
            for item in self.cache.state_dict().items():
                yield item
        self.version = subscriber.version

    async def get_weights(  # type: ignore[override]
        self,
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Every tensor of the last version received, from the local cache
        (``local_cache=True``); without one, of the version in the trainers' host caches
        (``mode="cached"``), fetched again without waiting for a publish (copies: the
        refetch completes first)."""
        if self.local_cache:
            if self.cache is None:
                raise RuntimeError("get_weights before any version was received")
            for item in self.cache.state_dict().items():
                yield item
            return
        subscriber = self._subscriber_for("get_weights")
        kept: list[tuple[str, torch.Tensor]] = []

        def keep(items: Iterable[tuple[str, torch.Tensor]]) -> None:
            kept.extend((name, tensor.clone()) for name, tensor in items)

        self.version = await asyncio.to_thread(subscriber.refetch, keep)
        for item in kept:
            yield item

    def _subscriber_for(self, what: str) -> WeightSubscriber:
        if self.subscriber is None:
            raise RuntimeError(
                f"{what} on an engine that is no rollout of the current update "
                "(init_process_group not called, or called with a trainer rank)"
            )
        return self.subscriber

    # -------------------------------------------------------------------------- shutdown
    def _close_ends(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.subscriber is not None:
            self.subscriber.close()
        self.publisher = self.subscriber = None

    def close(self) -> None:
        """Leave the sync group (verl never calls this: call it when the job ends). The
        master hosts the group's store and waits, up to the timeout, for the others to leave
        or be found dead."""
        self._close_ends()
        if self.group is not None:
            self.group.close()
            self.group = None
