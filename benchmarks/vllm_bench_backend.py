"""The vLLM weight-transfer backend ``"bench"`` of :mod:`vllm_sync`: one engine that takes
both slipstream's updates and the baseline's, so every peer updates the same engines.

- init/update info with ``host`` / ``version``: slipstream's engine
  (:class:`~slipstream.integrations.vllm.engine.SlipstreamWeightTransferEngine`), unchanged:
  every session's start and finish go to it too (its finish loads what it staged);
- update info with ``data``: the official API carrying the bytes themselves through vLLM's
  RPC (``update_info`` = names, dtypes, shapes and the raw bytes of a chunk of tensors),
  loaded through the layerwise reload between ``start_weight_update`` and
  ``finish_weight_update``, as vLLM's own checkpoint-format backends do.

vLLM's workers import this module through ``worker_extension_cls=
"vllm_bench_backend.BenchExtension"`` (the benchmark puts its folder on ``PYTHONPATH``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from slipstream.integrations.vllm.engine import SlipstreamWeightTransferEngine

BACKEND = "bench"


class BenchEngine(WeightTransferEngine):
    """Dispatches each call to slipstream's engine or to the inline-bytes baseline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slipstream = SlipstreamWeightTransferEngine(*args, **kwargs)
        self.inline = False

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        return init_dict

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        return update_dict

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        if "host" in init_info:
            self.slipstream.init_transfer_engine(self.slipstream.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.inline = False
        self.slipstream.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if "version" in update_info:
            self.slipstream.update_weights(update_info)
            return
        if not self.inline:
            initialize_layerwise_reload(self.model)
            self.inline = True
        self.receive_weights(update_info)

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        data = bytearray(update_info["data"])
        flat = torch.frombuffer(data, dtype=torch.uint8)
        batch, offset = [], 0
        for name, dtype, shape in zip(
            update_info["names"], update_info["dtypes"], update_info["shapes"], strict=True
        ):
            dt = getattr(torch, dtype)
            n = int(torch.Size(shape).numel()) * dt.itemsize
            batch.append((name, flat[offset : offset + n].view(dt).view(shape)))
            offset += n
        self.model.load_weights(batch)

    def finish_weight_update(self) -> None:
        if self.inline:
            finalize_layerwise_reload(self.model, self.model_config)
            self.inline = False
        self.slipstream.finish_weight_update()  # loads what slipstream staged, if anything

    def shutdown(self) -> None:
        self.slipstream.shutdown()


class BenchExtension:
    """Imported by each worker (``worker_extension_cls``): registers the backend, and lets
    the benchmark read the last slipstream update's timings (``collective_rpc``)."""

    def slipstream_timings(self) -> dict[str, float]:
        timings = self.weight_transfer_engine.slipstream.last_update  # type: ignore[attr-defined]
        return dataclasses.asdict(timings)


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, BenchEngine)
