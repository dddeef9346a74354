"""The trainer's end: :class:`VLLMWeightSync` publishes to vLLM engines with one call.

The trainer hosts the sync group (rank 0, its store at ``host:port``) and a
:class:`~slipstream.sync.WeightPublisher`; each engine's workers are rollouts, given ranks
in the order engines arrive (a rank is never given out twice, so the group only grows).
:meth:`VLLMWeightSync.publish` runs, for every engine at once on a thread of its own,
vLLM's ``start_weight_update`` / ``update_weights({"version": v})`` /
``finish_weight_update(str(v))`` and then resets its prefix cache (cached blocks were
computed with the old weights), while the publisher sends the version. An engine joins
by ``init_weight_transfer_engine``; where its workers say they hold an update session a
dead trainer left open, the trainer closes it with ``finish_weight_update`` (the engine
changes its model only when a session finishes, with what that session staged, which
joining dropped: see :mod:`.engine`).

Invariants: every thread this object starts is joined before the call that started it
returns, or the call raises naming the engine that did not answer in ``timeout`` seconds; a
publish raises :class:`~slipstream.errors.SyncError` naming every engine that failed it,
and those engines keep serving the version they held (see :mod:`.engine`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...errors import SyncError
from ...sync import SyncGroup, WeightPublisher, init_group
from .clients import Engine
from .session import Session, session_key

CHANNEL = "vllm"


@dataclass
class _Member:
    engine: Engine
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
    ``SLIPSTREAM_VLLM_TOKEN`` where that is set.
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
            member.engine.init_weight_transfer_engine(self._init_info(member, world))

        def trainer() -> None:
            try:
                self.group = init_group(host, port, world, 0, timeout=timeout, on_listening=listen)
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
            _run_all("init_weight_transfer_engine", calls, timeout, trainer)
            self._close_sessions(self.members)
        except BaseException:
            self._close_group()
            raise

    @property
    def rollout_ranks(self) -> list[int]:
        return [r for m in self.members for r in m.ranks]

    def _place(self, engine: Engine) -> _Member:
        if any(m.engine.name == engine.name for m in self.members):
            raise ValueError(f"an engine named {engine.name!r} is already published to")
        member = _Member(engine, self._next_rank)
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
        }

    def _close_sessions(self, members: Sequence[_Member]) -> None:
        """Close the update session a trainer that died between two engine calls left
        open on any of ``members`` (each worker says whether it holds one as it joins; the
        engine dropped what that session staged, so the close loads nothing)."""
        group = self.group
        assert group is not None
        open_ = [
            m
            for m in members
            if group.get_text(session_key(m.first_rank), m.first_rank, "its update session")
            == Session.OPEN.value.encode()
        ]
        calls = {m.engine.name: _bind(m.engine.finish_weight_update, None) for m in open_}
        _run_all("closing an update session a dead trainer left open", calls, self.timeout)

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
        v = publisher.next_version if version is None else version
        if self.version is not None and v <= self.version:
            raise ValueError(f"versions must increase: got {v} after {self.version}")
        calls = {m.engine.name: _bind(_update, m.engine, v) for m in self.members}

        def send() -> None:
            publisher.publish(named_tensors, v).wait(self.timeout)

        ranks = {r: m.engine.name for m in self.members for r in m.ranks}
        _run_all(f"the update to version {v} (engines' ranks: {ranks})", calls, self.timeout, send)
        self.version = v
        return v

    def add_engine(self, engine: Engine) -> None:
        """Publish to ``engine`` too from the next publish on (it gets every byte then)."""
        publisher = self._publisher()
        member = self._place(engine)
        info = self._init_info(member, self._next_rank)
        try:
            _run_all(
                "init_weight_transfer_engine",
                {engine.name: _bind(engine.init_weight_transfer_engine, info)},
                self.timeout,
                lambda: publisher.set_rollouts(self.rollout_ranks),
            )
            self._close_sessions([member])
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
        _run_all(
            "shutdown_weight_transfer_engine",
            {engine.name: engine.shutdown_weight_transfer_engine},
            self.timeout,
        )

    def close(self) -> None:
        """Let every engine leave the group, then close the publisher and the group."""
        calls = {m.engine.name: m.engine.shutdown_weight_transfer_engine for m in self.members}
        self.members = []
        try:
            _run_all("shutdown_weight_transfer_engine", calls, self.timeout)
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


def _update(engine: Engine, version: int) -> None:
    """vLLM's update sequence on one engine; then its prefix cache is reset."""
    engine.start_weight_update()
    engine.update_weights(asdict(_UpdateInfo(version)))
    engine.finish_weight_update(str(version))
    engine.reset_prefix_cache()


@dataclass
class _UpdateInfo:
    version: int


def _bind(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: fn(*args)


def _run_all(
    what: str,
    calls: Mapping[str, Callable[[], object]],
    timeout: float,
    here: Callable[[], object] | None = None,
) -> None:
    """Run every call on a thread of its own (named after its engine) and ``here`` on this
    thread; join them all; raise :class:`SyncError` naming every engine that failed or did
    not answer within ``timeout`` seconds (the trainer's own error comes first)."""
    errors: dict[str, BaseException] = {}
    threads = []
    for name, call in calls.items():

        def run(name: str = name, call: Callable[[], object] = call) -> None:
            try:
                call()
            except BaseException as exc:
                errors[name] = exc

        thread = threading.Thread(target=run, name=f"slipstream-vllm-{name}", daemon=True)
        thread.start()
        threads.append((name, thread))
    own: BaseException | None = None
    if here is not None:
        try:
            here()
        except BaseException as exc:
            own = exc
    silent = []
    deadline = time.monotonic() + timeout
    for name, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            silent.append(name)
    problems = [f"{name}: {type(e).__name__}: {e}" for name, e in errors.items()]
    problems += [f"{name} did not answer within {timeout:.0f} s" for name in silent]
    if own is not None:
        raise SyncError(f"{what} failed on the trainer: {own}; " + "; ".join(problems)) from own
    if problems:
        raise SyncError(f"{what} failed on engine(s): " + "; ".join(problems))
