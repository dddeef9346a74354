"""The vLLM worker's end: :class:`SlipstreamWeightTransferEngine`, a ``WeightTransferEngine``
that receives slipstream publishes straight into the worker's model.

vLLM builds one per worker process (``LLM(weight_transfer_config={"backend": "slipstream"})``
or ``vllm serve --weight-transfer-config '{"backend": "slipstream"}'``) and forwards the RL
weight-update calls to it:

- ``init_weight_transfer_engine(init_info)``: the worker joins the trainer's sync group as a
  rollout, at rank ``init_info["rank"]`` plus its own rank in the engine, and builds its
  :class:`~slipstream.sync.WeightSubscriber` (a second call leaves the old group first: a
  new trainer, or the same one restarted). Closed by default: ``init_info["token"]`` must
  match the worker's ``SLIPSTREAM_VLLM_TOKEN``, or nothing is joined (``vllm serve``'s
  ``--api-key`` does not guard its RL routes: this says who may point the engine at a sync
  group); a worker without one refuses every trainer unless ``SLIPSTREAM_VLLM_NO_TOKEN=1``
  says any caller that reaches it may (logged). ``init_info["session"]``, the trainer's
  nonce, is what every later ``update_weights`` of this trainer carries;
- ``start_weight_update()``: drops a version staged in a session that was never finished;
  the model is not touched;
- ``update_weights({"version": v, "session": s})``: refused at once if ``s`` is not this
  trainer's nonce, or ``v`` not the version the trainer publishes now (a call that outlived
  its timeout); else receives version ``v`` over slipstream's transports (never through
  vLLM's RPC, which carries only this dict) into a host buffer (``atomic=True``), whole,
  checks it against what the model's own loaders expect and stages it; the model is not
  touched. With tensor parallelism a worker receives only the part of each tensor its
  loaders read (:mod:`.slices` learns them once per layout, by running the loaders on
  placeholders); else every byte;
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
so is a version the model's loaders would not take whole: a name they do not know, a
shape they refuse, a parameter no tensor of it writes (a missing layer; learnt once per
layout by running the loaders on placeholders, :func:`.slices.record_loads`), tensors
that differ in names, shapes or dtypes from the version the model took first, or a number
not the one ``update_weights`` names (a call that arrives late meets a later round). The
engine keeps serving the version it holds, and takes the next publish. A load that fails
part-way all the same (the loaders' own error on real bytes) loads the version the model
held again, from a host copy of its checkpoint tensors taken after every load
(:mod:`.held`: the worker's part of the model, once more in host memory), and raises
saying so; only where that cannot be done (a first update, or it fails too) does the
worker hold no complete version (:attr:`~.session.Holding.NONE`) until one lands whole,
which it says in the error and to the trainer, which keeps generation paused on that
engine.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
from .held import HeldCopy
from .session import PUBLISHING_KEY, Holding, Session, holding_key, session_key
from .slices import Loads, SliceRecordingError, record_loads

logger = logging.getLogger(__name__)

TOKEN_ENV = "SLIPSTREAM_VLLM_TOKEN"
NO_TOKEN_ENV = "SLIPSTREAM_VLLM_NO_TOKEN"


@dataclass
class SlipstreamInitInfo(WeightTransferInitInfo):
    """Where the trainer's sync group is and this engine's place in it.

    ``rank`` is the rank of the engine's first worker (the others follow it); ``world_size``
    counts every rank of the group up to this engine's last worker (a group grows when an
    engine joins past its first size); ``trainer_ranks`` and ``rollout_ranks`` are the
    publisher's, ``channel`` its name; ``token`` must match the worker's
    ``SLIPSTREAM_VLLM_TOKEN``; ``session`` is the nonce every later update of this trainer
    carries."""

    host: str
    port: int
    world_size: int
    rank: int
    trainer_ranks: list[int]
    rollout_ranks: list[int]
    channel: str
    timeout: float = 60.0
    token: str = ""
    session: str = ""


@dataclass
class SlipstreamUpdateInfo(WeightTransferUpdateInfo):
    """The version the trainer publishes (its bytes come over the sync group), and the
    trainer's session nonce."""

    version: int
    session: str = ""


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
    rank: int

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
    what the model's loaders do with a layout (learnt once per layout)."""

    layout: Layout = field(default_factory=dict)
    loads: tuple[Layout, Loads] | None = None


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
        self._keeper = HeldCopy()
        self._session = Session.CLOSED
        self._holding = Holding.COMPLETE
        self._nonce = ""

    @property
    def rank_in_engine(self) -> int:
        return int(self.parallel_config.rank)

    def init_transfer_engine(self, init_info: SlipstreamInitInfo) -> None:
        """Join the trainer's sync group (leaving any earlier one) and subscribe."""
        info = init_info
        _check_token(info.token)
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
        self._ends = _Ends(group, subscriber, rank)
        self._nonce = info.session
        group.post(session_key(rank), self._session.value)  # read by the trainer
        group.post(holding_key(rank), self._holding.value)
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
        if not hmac.compare_digest(self._nonce.encode(), update_info.session.encode()):
            raise PermissionError(
                "slipstream: update_weights refused: it does not carry the session of the "
                "trainer this worker joined"
            )
        self._staged = None
        publishing = int(ends.group.get_text(PUBLISHING_KEY, 0, "the version it publishes"))
        if publishing != update_info.version:
            raise SyncError(
                f"slipstream: update_weights for version {update_info.version} refused: the "
                f"trainer publishes version {publishing} now (a call that outlived its "
                "timeout); nothing was received"
            )
        self._keeper.join()  # it reads the buffer this receive overwrites
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

    def _loads(self, layout: Layout) -> Loads:
        """What this worker's loaders do with ``layout``: the part of each checkpoint tensor
        they read (a tensor-parallel rank's rows or columns) and the parameters they leave
        unwritten, learnt once per layout by running them on placeholders; a layout they
        refuse raises, naming why, before any weight is touched. Loaders that need the
        values cannot be run so: without tensor parallelism the version is then checked
        only against the one the model holds."""
        held = self._applied.loads
        if held is None or held[0] != layout:
            try:
                loads = record_loads(self.model, layout)
            except SliceRecordingError:
                if self.parallel_config.tensor_parallel_size > 1:
                    raise  # its parts cannot be learnt: it cannot be sent them
                logger.warning(
                    "slipstream: worker %d's loaders need the weights' values, so a version "
                    "is checked only against the one the model holds",
                    self.rank_in_engine,
                    exc_info=True,
                )
                loads = Loads({}, [])
            except Exception as e:  # the loaders' own refusal, of whatever type
                raise SyncError(
                    "slipstream: refused a version the model's loaders do not take, before "
                    f"touching any weight: {type(e).__name__}: {e}"
                ) from e
            held = (layout, loads)
            self._applied.loads = held
            logger.info(
                "slipstream: worker %d reads %d of %d checkpoint tensors in part",
                self.rank_in_engine,
                len(loads.narrows),
                len(layout),
            )
        return held[1]

    def _keeps(self, layout: Layout) -> dict[str, Narrow]:
        """The part of each checkpoint tensor this worker's loaders read."""
        return self._loads(layout).narrows

    def _checked(self, batch: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``batch`` (a whole version, views of the subscriber's host buffer), once the
        model's loaders take it whole and its layout is the one the model holds (refused,
        before any weight is touched, if not)."""
        layout = {name: (tuple(t.shape), t.dtype) for name, t in batch}
        problems = list(_differences(self._applied.layout, layout))
        if not problems:
            unwritten = self._loads(layout).unwritten
            if unwritten:
                problems.append(f"no tensor of it writes the parameters {unwritten[:5]}")
        if problems:
            raise SyncError(
                "slipstream: refused a version unlike the one the model holds, before "
                "touching any weight: " + "; ".join(problems)
            )
        return batch

    def finish_weight_update(self) -> None:
        """Load the version this session staged (nothing staged: nothing to load; a CPU
        worker has nothing asynchronous to wait for, so no device synchronization). A load
        that fails part-way loads the version the model held again (:class:`.held.HeldCopy`) and
        raises, which leaves vLLM's session open: the trainer closes it with another
        ``finish_weight_update``, which has nothing staged to load. Where that cannot be
        done (no copy yet: the first update; or it fails too), the worker holds no
        complete version."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._load(staged)
        self._session = Session.CLOSED  # vLLM closes its session once this returns

    def _load(self, staged: _Staged) -> None:
        began = time.perf_counter()
        self._keeper.join()  # the copy of the held version is whole before it is needed
        try:
            _reload(self.model, self.model_config, staged.batch)
        except BaseException as e:
            raise self._put_back(staged.version, e) from e
        if self.device.type != "cpu":
            torch.accelerator.synchronize()
        self._applied.layout = {name: (tuple(t.shape), t.dtype) for name, t in staged.batch}
        self._hold(Holding.COMPLETE)
        self.last_update = UpdateTimings(
            staged.version, staged.received_s, time.perf_counter() - began
        )
        self._keeper.keep(staged.version, staged.batch)
        logger.info(
            "slipstream: version %d received in %.3f s, loaded in %.3f s",
            staged.version,
            self.last_update.received_s,
            self.last_update.loaded_s,
        )

    def _put_back(self, version: int, cause: BaseException) -> SyncError:
        """After loading ``version`` failed part-way with ``cause``: the version the model
        held loaded again, and the error saying so (or that the worker now holds no
        complete version, where it could not be)."""
        failed = f"slipstream: loading version {version} failed part-way"
        why = f"{type(cause).__name__}: {cause}"
        held = self._keeper.held
        try:
            if held is None:
                raise SyncError("no copy of it is kept before a first update")
            _reload(self.model, self.model_config, held.batch)
        except BaseException as e:
            self._hold(Holding.NONE)
            return SyncError(
                f"{failed} and the version held could not be loaded again ({type(e).__name__}: "
                f"{e}): this worker holds no complete version until one lands: {why}"
            )
        return SyncError(
            f"{failed}; version {held.version}, which the model held, is loaded again: {why}"
        )

    def _hold(self, holding: Holding) -> None:
        """Record what the model holds, and tell the trainer where it changed."""
        changed, self._holding = self._holding is not holding, holding
        if changed and self._ends is not None:
            self._ends.group.post(holding_key(self._ends.rank), holding.value)

    def shutdown(self) -> None:
        """Leave the sync group (the engine keeps serving what it holds)."""
        self._keeper.join()
        ends, self._ends = self._ends, None
        if ends is not None:
            ends.close()


def _reload(model: Any, model_config: Any, batch: list[tuple[str, torch.Tensor]]) -> None:
    """``batch`` into ``model`` through vLLM's layerwise reload, in one ``load_weights``
    call (vLLM's models, not ``nn.Module``'s); layers it leaves incomplete get their old
    tensors back, never left on meta."""
    initialize_layerwise_reload(model)
    try:
        model.load_weights(batch)
    finally:
        finalize_layerwise_reload(model, model_config)


def _check_token(token: str) -> None:
    """Refuse a trainer whose ``token`` is not this worker's ``SLIPSTREAM_VLLM_TOKEN`` (or
    any trainer where the worker has none, unless ``SLIPSTREAM_VLLM_NO_TOKEN=1``)."""
    expected = os.environ.get(TOKEN_ENV, "")
    if not expected:
        if os.environ.get(NO_TOKEN_ENV) == "1":
            logger.warning(
                "slipstream: joining a sync group without a token (%s=1): any caller that "
                "reaches this engine's RL routes can point it at weights of its own",
                NO_TOKEN_ENV,
            )
            return
        raise PermissionError(
            f"slipstream: init_weight_transfer_engine refused: this worker has no {TOKEN_ENV} "
            f"(set it to the trainer's token where the engine starts, or {NO_TOKEN_ENV}=1 to "
            "let any caller that reaches the engine point it at a sync group)"
        )
    if not hmac.compare_digest(expected.encode(), token.encode()):
        raise PermissionError(
            f"slipstream: init_weight_transfer_engine refused: its token does not match "
            f"this worker's {TOKEN_ENV}"
        )


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
