"""The vLLM worker's end: :class:`SlipstreamWeightTransferEngine`, a ``WeightTransferEngine``
that receives slipstream publishes straight into the worker's model.

vLLM builds one per worker process (``LLM(weight_transfer_config={"backend": "slipstream"})``
or ``vllm serve --weight-transfer-config '{"backend": "slipstream"}'``) and forwards the RL
weight-update calls to it:

- ``init_weight_transfer_engine(init_info)``: the worker joins the trainer's sync group as a
  rollout, at rank ``init_info["rank"]`` plus its own rank in the engine, and builds its
  :class:`~slipstream.sync.WeightSubscriber` (a second call leaves the old group first: a
  new trainer, or the same one restarted). Where the worker's environment sets
  ``SLIPSTREAM_VLLM_TOKEN``, ``init_info["token"]`` must match it, or nothing is joined
  (``vllm serve``'s ``--api-key`` does not guard its RL routes: this says who may point the
  engine at a sync group);
- ``start_weight_update()``: drops a version staged in a session that was never finished;
  the model is not touched;
- ``update_weights({"version": v})``: receives the next published version over
  slipstream's transports (never through vLLM's RPC, which carries only this dict) into a
  host buffer (``atomic=True``), whole, and stages it; the model is not touched. With tensor
  parallelism a worker receives only the part of each tensor its loaders read
  (:mod:`.slices` learns them once per layout, by running the loaders on placeholders);
  else every byte;
- ``finish_weight_update()``: loads the staged version into the model through vLLM's
  layerwise reload (a CPU worker's linear weights are repacked for oneDNN: a load must go
  through it), in one ``load_weights`` call; vLLM then records its number. A session
  finished with nothing staged (a new trainer closing one a dead trainer left open) loads
  nothing.

Each update is logged with its timings (:class:`UpdateTimings`: receiving the version whole,
then loading it), and :attr:`SlipstreamWeightTransferEngine.last_update` keeps the last one.

Invariant: the model holds one complete published version (or the one it was started
with), and changes only in ``finish_weight_update``, the call after which vLLM names the
new version: a trainer that dies between two calls leaves the model and its version as
they were. A transfer that breaks (the trainer or another rollout dying, a bucket that does not
check) raises from ``update_weights`` before any weight is touched, naming who broke it;
a version whose tensors differ in names, shapes or dtypes from the one the model took
first, or whose number is not the one ``update_weights`` names (a call that arrives late
meets a later round), is refused the same way. The engine keeps serving the version it
holds, and takes the next publish.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from ...errors import SyncError
from ...sync import Layout, Narrow, SyncGroup, WeightSubscriber, init_group
from .session import Session, session_key
from .slices import record_slices

logger = logging.getLogger(__name__)

TOKEN_ENV = "SLIPSTREAM_VLLM_TOKEN"


@dataclass
class SlipstreamInitInfo(WeightTransferInitInfo):
    """Where the trainer's sync group is and this engine's place in it.

    ``rank`` is the rank of the engine's first worker (the others follow it); ``world_size``
    counts every rank of the group up to this engine's last worker (a group grows when an
    engine joins past its first size); ``trainer_ranks`` and ``rollout_ranks`` are the
    publisher's, ``channel`` its name; ``token`` must match the worker's
    ``SLIPSTREAM_VLLM_TOKEN`` where that is set."""

    host: str
    port: int
    world_size: int
    rank: int
    trainer_ranks: list[int]
    rollout_ranks: list[int]
    channel: str
    timeout: float = 60.0
    token: str = ""


@dataclass
class SlipstreamUpdateInfo(WeightTransferUpdateInfo):
    """The version the trainer publishes; its bytes come over the sync group."""

    version: int


@dataclass(frozen=True)
class UpdateTimings:
    """One update on this worker: ``received_s`` from ``update_weights`` until the version
    was whole in the host buffer, ``loaded_s`` for loading it into the model (vLLM's
    layerwise reload, repacking included)."""

    version: int
    received_s: float
    loaded_s: float


@dataclass
class _Ends:
    """The worker's membership of one sync group."""

    group: SyncGroup
    subscriber: WeightSubscriber

    def close(self) -> None:
        self.subscriber.close()
        self.group.close()


@dataclass
class _Staged:
    """A version received whole and not loaded yet: its tensors (views of the subscriber's
    host buffer, valid until its next receive)."""

    version: int
    batch: list[tuple[str, torch.Tensor]]
    received_s: float


@dataclass
class _Applied:
    """What the last loaded version looked like (checked against every later one), and
    the parts of a layout this worker reads (learnt once per layout)."""

    layout: Layout = field(default_factory=dict)
    keeps: tuple[Layout, dict[str, Narrow]] | None = None


class SlipstreamWeightTransferEngine(
    WeightTransferEngine[SlipstreamInitInfo, SlipstreamUpdateInfo]
):
    """vLLM's weight-transfer backend ``"slipstream"`` (see the module's docstring)."""

    init_info_cls = SlipstreamInitInfo
    update_info_cls = SlipstreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ends: _Ends | None = None
        self._applied = _Applied()
        self.last_update: UpdateTimings | None = None
        self._staged: _Staged | None = None
        self._session = Session.CLOSED

    @property
    def rank_in_engine(self) -> int:
        return int(self.parallel_config.rank)

    def init_transfer_engine(self, init_info: SlipstreamInitInfo) -> None:
        """Join the trainer's sync group (leaving any earlier one) and subscribe."""
        info = init_info
        expected = os.environ.get(TOKEN_ENV)
        if expected and not hmac.compare_digest(expected.encode(), info.token.encode()):
            raise PermissionError(
                f"slipstream: init_weight_transfer_engine refused: its token does not match "
                f"this worker's {TOKEN_ENV}"
            )
        self.shutdown()
        self._staged = None  # a dead trainer's unfinished version is not this one's
        rank = info.rank + self.rank_in_engine
        group = init_group(info.host, info.port, info.world_size, rank, timeout=info.timeout)
        try:
            subscriber = WeightSubscriber(
                group, info.trainer_ranks, info.rollout_ranks, channel=info.channel
            )
        except BaseException:
            group.close()
            raise
        self._ends = _Ends(group, subscriber)
        group.post(session_key(rank), self._session.value)  # read by the trainer
        logger.info("slipstream: worker joined the sync group at rank %d", rank)

    def start_weight_update(self) -> None:
        """Drop a version an unfinished session staged: the model is touched only by
        :meth:`finish_weight_update`, with what this session's update staged."""
        self._staged = None
        self._session = Session.OPEN  # vLLM opens its session once this returns

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive the version ``update_info`` names, whole, and stage it."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._session = Session.CLOSED  # as vLLM closes its session when this raises
            raise

    def receive_weights(self, update_info: SlipstreamUpdateInfo) -> None:
        ends = self._ends
        if ends is None:
            raise SyncError(
                "slipstream: update_weights before init_weight_transfer_engine on this worker"
            )
        self._staged = None
        started = time.perf_counter()
        keeps = self._keeps if self.parallel_config.tensor_parallel_size > 1 else None
        batches: list[list[tuple[str, torch.Tensor]]] = []
        version = ends.subscriber.receive(
            lambda batch: batches.append(self._checked(batch)),
            atomic=True,
            full=True,
            keeps=keeps,
            expect_version=update_info.version,
        )
        batch = [item for b in batches for item in b]
        self._staged = _Staged(version, batch, time.perf_counter() - started)

    def _keeps(self, layout: Layout) -> dict[str, Narrow]:
        """The part of each checkpoint tensor this worker's loaders read (a tensor-parallel
        rank's rows or columns), learnt once per layout by running them on placeholders."""
        held = self._applied.keeps
        if held is None or held[0] != layout:
            held = (layout, record_slices(self.model, layout))
            self._applied.keeps = held
            logger.info(
                "slipstream: worker %d reads %d of %d checkpoint tensors in part",
                self.rank_in_engine,
                len(held[1]),
                len(layout),
            )
        return held[1]

    def _checked(self, batch: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``batch`` (a whole version, views of the subscriber's host buffer), once its
        layout is the one the model holds (refused, before any weight is touched, if not)."""
        layout = {name: (tuple(t.shape), t.dtype) for name, t in batch}
        problems = _differences(self._applied.layout, layout)
        if problems:
            raise SyncError(
                "slipstream: refused a version unlike the one the model holds, before "
                "touching any weight: " + "; ".join(problems)
            )
        return batch

    def finish_weight_update(self) -> None:
        """Load the version this session staged (nothing staged: nothing to load; a CPU
        worker has nothing asynchronous to wait for, so no device synchronization)."""
        staged, self._staged = self._staged, None
        if staged is None:
            self._session = Session.CLOSED
            return
        began = time.perf_counter()
        initialize_layerwise_reload(self.model)
        try:
            cast(Any, self.model).load_weights(staged.batch)  # vLLM's models, not nn.Module's
        finally:  # layers left incomplete get their old tensors back: never left on meta
            finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type != "cpu":
            torch.accelerator.synchronize()
        self._applied.layout = {name: (tuple(t.shape), t.dtype) for name, t in staged.batch}
        self._session = Session.CLOSED  # vLLM closes its session once this returns
        self.last_update = UpdateTimings(
            staged.version, staged.received_s, time.perf_counter() - began
        )
        logger.info(
            "slipstream: version %d received in %.3f s, loaded in %.3f s",
            staged.version,
            self.last_update.received_s,
            self.last_update.loaded_s,
        )

    def shutdown(self) -> None:
        """Leave the sync group (the engine keeps serving what it holds)."""
        ends, self._ends = self._ends, None
        if ends is not None:
            ends.close()


def _differences(held: Layout, new: Layout, shown: int = 5) -> Sequence[str]:
    """How ``new`` differs from ``held`` (nothing when ``held`` is empty: the first one)."""
    if not held:
        return []
    problems = []
    missing = sorted(set(held) - set(new))
    extra = sorted(set(new) - set(held))
    changed = sorted(n for n in set(held) & set(new) if held[n] != new[n])
    if missing:
        problems.append(f"missing {missing[:shown]}")
    if extra:
        problems.append(f"unknown {extra[:shown]}")
    for name in changed[:shown]:
        problems.append(f"{name}: held {held[name]}, sent {new[name]}")
    return problems
