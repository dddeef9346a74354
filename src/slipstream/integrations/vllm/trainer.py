"""The trainer's end: :class:`VLLMWeightSync` publishes to vLLM engines with one call.

The trainer hosts the sync group (rank 0, its store at ``host:port``) and a
:class:`~slipstream.sync.WeightPublisher`; each engine's workers are rollouts, given ranks
in the order engines arrive (a rank is never given out twice, so the group only grows).
:meth:`VLLMWeightSync.publish` posts the version it publishes, runs
``start_weight_update`` on every engine at once, then on each engine
``update_weights({"version": v, "session": s})`` while the publisher sends the version (the
engine receives it whole and stages it; it keeps generating meanwhile), and then the swap:
generation paused (the requests in flight finish on the weights they began with),
``finish_weight_update(str(v))``, a prefix-cache reset (cached blocks were computed with the
old weights: a reset the engine refuses fails the publish) and generation resumed. An
engine joins by ``init_weight_transfer_engine``, given the trainer's token and its session
nonce ``s`` (which every update carries); where its workers say they hold an update session
a dead trainer left open, the trainer closes it with ``finish_weight_update`` (the engine
changes its model only when a session finishes, with what that session staged, which
joining dropped: see :mod:`.engine`), and it resumes generation a dead trainer left paused
(one that died during a swap).

Invariants: every engine call ends within ``timeout`` seconds (an :class:`.HTTPEngine`'s
connection is closed then) and every thread this object starts is joined before the call
that started it returns, or the call raises naming the engine that did not answer; a
refusal from an engine (a token, a version, names) ends the trainer's wait at once; a
publish raises :class:`~slipstream.errors.SyncError` naming every engine that failed it,
and those engines keep serving the version they held (see :mod:`.engine`), or, where a
load failed part-way, stay paused until a version lands whole.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import SyncError
from ...sync import SyncGroup, WeightPublisher, init_group
from .calls import EngineCalls, run_all
from .clients import Engine
from .session import PUBLISHING_KEY, Holding, Session, holding_key, session_key

logger = logging.getLogger(__name__)

CHANNEL = "vllm"


@dataclass
class _Member:
    """One engine: ``engine`` as the caller gave it, ``client`` it with every call bounded
    by the trainer's timeout."""

    engine: Engine
    client: Engine
    first_rank: int

    @property
    def ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + self.engine.workers))


class VLLMWeightSync:
    """Publishes a trainer's weights to vLLM engines (see the module's docstring).

    ``engines``: the engines present from the start (more come with :meth:`add_engine`);
    ``port``: where the trainer's store listens (0: a port the system picks as the store
    starts listening, sent to the engines then); ``bucket_bytes`` and ``transport`` are the
    publisher's; ``timeout`` (seconds) bounds every wait of the group and every engine
    call; ``token`` is sent to every engine, whose workers check it against their
    ``SLIPSTREAM_VLLM_TOKEN`` (see :mod:`.engine`: a worker without one refuses every
    trainer unless told otherwise).
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = 64 * 2**20,
        transport: str = "auto",
        timeout: float = 120.0,
        token: str = "",
    ) -> None:
        if not engines:
            raise ValueError("VLLMWeightSync needs at least one engine")
        self.host = host
        self.timeout = timeout
        self.token = token
        self.session = secrets.token_hex(16)
        self.members: list[_Member] = []
        self.version: int | None = None
        self._next_rank = 1
        self.port = port
        for engine in engines:
            self._place(engine)
        world = self._next_rank
        self.group: SyncGroup | None = None
        self.publisher: WeightPublisher | None = None
        listening = threading.Event()

        def listen(bound: int) -> None:
            self.port = bound
            listening.set()

        def join(member: _Member) -> None:
            """Once the store listens (or the trainer failed first), point the engine at it."""
            listening.wait(timeout)
            if not self.port:
                raise SyncError("the trainer's store did not start listening")
            member.client.init_weight_transfer_engine(self._init_info(member, world))

        def trainer(calls: EngineCalls) -> None:
            try:
                self.group = init_group(
                    host,
                    port,
                    world,
                    0,
                    timeout=timeout,
                    on_listening=listen,
                    idle=calls.raise_if_failed,  # an engine that refused will not join
                )
            finally:  # on a failure too: the engines' calls give up at once
                listening.set()
            self.publisher = WeightPublisher(
                self.group,
                [0],
                self.rollout_ranks,
                bucket_bytes=bucket_bytes,
                transport=transport,
                channel=CHANNEL,
            )

        calls = {m.engine.name: _bind(join, m) for m in self.members}
        try:
            run_all("init_weight_transfer_engine", calls, timeout, trainer)
            self._settle(self.members)
        except BaseException:
            self._close_group()
            raise

    @property
    def rollout_ranks(self) -> list[int]:
        return [r for m in self.members for r in m.ranks]

    def _place(self, engine: Engine) -> _Member:
        if any(m.engine.name == engine.name for m in self.members):
            raise ValueError(f"an engine named {engine.name!r} is already published to")
        member = _Member(engine, engine.bounded(self.timeout), self._next_rank)
        self._next_rank += engine.workers
        self.members.append(member)
        return member

    def _init_info(self, member: _Member, world: int) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "world_size": world,
            "rank": member.first_rank,
            "trainer_ranks": [0],
            "rollout_ranks": self.rollout_ranks,
            "channel": CHANNEL,
            "timeout": self.timeout,
            "token": self.token,
            "session": self.session,
        }

    def _settle(self, members: Sequence[_Member]) -> None:
        """Undo what a trainer that died between two engine calls left on ``members`` (each
        worker says, as it joins, whether it holds an update session open and a complete
        version): close an open session (the engine dropped what it staged, so the close
        loads nothing), and resume generation where every worker holds a complete version
        (one left paused stays so, as after a load that failed part-way)."""
        group = self.group
        assert group is not None
        opened = Session.OPEN.value.encode()
        open_ = [
            m
            for m in members
            if any(group.get_text(session_key(r), r, "its session") == opened for r in m.ranks)
        ]
        calls = {m.engine.name: _bind(m.client.finish_weight_update, None) for m in open_}
        run_all("closing an update session a dead trainer left open", calls, self.timeout)
        whole = []
        for m in members:
            if not self._holds_whole(m):
                logger.warning(
                    "slipstream: %s holds no complete version (a load failed part-way): its "
                    "generation stays paused until a version lands",
                    m.engine.name,
                )
            else:
                whole.append(m)
        calls = {m.engine.name: m.client.resume_generation for m in whole}
        run_all("resuming generation", calls, self.timeout)

    def _swap(self, m: _Member, version: int) -> None:
        """Load the version ``m`` received and staged: generation paused around the load
        (the requests in flight finish on the old weights first) and the prefix cache
        reset before it resumes. Where the load fails, the session it leaves open is
        closed (a second ``finish_weight_update``: nothing is staged, nothing loads, no
        version is named) and generation resumes, unless a worker says its model holds
        no complete version: it then stays paused until a version lands whole."""
        engine = m.client
        engine.pause_generation()
        try:
            engine.finish_weight_update(str(version))
        except BaseException as exc:
            engine.finish_weight_update(None)
            if not self._holds_whole(m):
                raise SyncError(f"{exc} (its generation stays paused)") from exc
            engine.resume_generation()
            raise
        try:
            if not engine.reset_prefix_cache():
                raise SyncError(
                    "it kept cached KV blocks of the old weights: reset_prefix_cache "
                    "answered false (blocks still in use)"
                )
        finally:
            engine.resume_generation()

    def _holds_whole(self, m: _Member) -> bool:
        """Whether every worker of ``m`` says its model holds one complete version."""
        group = self.group
        assert group is not None
        none = Holding.NONE.value.encode()
        return all(
            group.get_text(holding_key(r), r, "what its model holds") != none for r in m.ranks
        )

    def _publisher(self) -> WeightPublisher:
        if self.publisher is None:
            raise SyncError("VLLMWeightSync is closed")
        return self.publisher

    def publish(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
    ) -> int:
        """Send ``named_tensors`` (Hugging Face names, as the model's checkpoint has them) as
        ``version`` (left out: the next number) and return once every engine serves it.

        Raises :class:`SyncError` naming every engine that failed (they serve the version
        they held; the next publish goes on) or the trainer-side error."""
        publisher = self._publisher()
        group = self.group
        assert group is not None
        v = publisher.next_version if version is None else version
        if self.version is not None and v <= self.version:
            raise ValueError(f"versions must increase: got {v} after {self.version}")
        group.post(PUBLISHING_KEY, str(v))  # an update of another version is refused
        members = list(self.members)
        run_all(
            f"starting the update to version {v}",
            {m.engine.name: m.client.start_weight_update for m in members},
            self.timeout,
        )

        def land(m: _Member) -> None:
            m.client.update_weights({"version": v, "session": self.session})
            self._swap(m, v)

        def send(_: EngineCalls) -> None:
            publisher.publish(named_tensors, v).wait(self.timeout)

        ranks = {r: m.engine.name for m in members for r in m.ranks}
        run_all(
            f"the update to version {v} (engines' ranks: {ranks})",
            {m.engine.name: _bind(land, m) for m in members},
            self.timeout,
            send,
        )
        self.version = v
        return v

    def add_engine(self, engine: Engine) -> None:
        """Publish to ``engine`` too from the next publish on (it gets every byte then)."""
        publisher = self._publisher()
        member = self._place(engine)
        info = self._init_info(member, self._next_rank)
        try:
            run_all(
                "init_weight_transfer_engine",
                {engine.name: _bind(member.client.init_weight_transfer_engine, info)},
                self.timeout,
                lambda _: publisher.set_rollouts(self.rollout_ranks),
            )
            self._settle([member])
        except BaseException:
            self.members.remove(member)
            publisher.set_rollouts(self.rollout_ranks)
            raise

    def remove_engine(self, engine: Engine, leave: bool = True) -> None:
        """Stop publishing to ``engine``; it leaves the group (``leave=False``: it is not
        asked to, e.g. it died) and serves what it holds."""
        member = next((m for m in self.members if m.engine is engine), None)
        if member is None:
            raise ValueError(f"{engine.name!r} is not published to")
        self.members.remove(member)
        self._publisher().set_rollouts(self.rollout_ranks)
        if not leave:
            return
        run_all(
            "shutdown_weight_transfer_engine",
            {engine.name: member.client.shutdown_weight_transfer_engine},
            self.timeout,
        )

    def close(self) -> None:
        """Let every engine leave the group, then close the publisher and the group."""
        calls = {m.engine.name: m.client.shutdown_weight_transfer_engine for m in self.members}
        self.members = []
        try:
            run_all("shutdown_weight_transfer_engine", calls, self.timeout)
        finally:
            self._close_group()

    def _close_group(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.group is not None:
            self.group.close(self.timeout)
            self.group = None

    def __enter__(self) -> VLLMWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bind(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: fn(*args)
