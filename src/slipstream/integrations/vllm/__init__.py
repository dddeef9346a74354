"""slipstream as vLLM's weight-transfer backend ``"slipstream"``, and the trainer's end.

- :mod:`.engine`: the backend each vLLM worker builds (it imports vLLM);
- :mod:`.clients`: how a trainer reaches an engine (an ``LLM`` here, or ``vllm serve``);
- :mod:`.trainer`: :class:`VLLMWeightSync`, one call to publish to every engine.

vLLM finds the backend through :func:`register`, which its plugin loader calls in every
vLLM process (the ``vllm.general_plugins`` entry point ``slipstream``); importing this
package registers it too, so ``worker_extension_cls="slipstream.integrations.vllm.
WorkerExtension"`` selects it where plugins are turned off. Importing this package does not
import vLLM: the backend's module is loaded when an engine is built.
"""

from __future__ import annotations

from .clients import Engine, HTTPEngine, OfflineEngine
from .trainer import VLLMWeightSync

BACKEND = "slipstream"


def register() -> None:
    """Register the backend in vLLM's ``WeightTransferEngineFactory`` (once; a no-op
    where vLLM is not installed)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, f"{__name__}.engine", "SlipstreamWeightTransferEngine"
        )


class WorkerExtension:
    """A ``worker_extension_cls`` that adds nothing but the import registering the backend
    in the worker process."""


register()

__all__ = [
    "BACKEND",
    "Engine",
    "HTTPEngine",
    "OfflineEngine",
    "VLLMWeightSync",
    "WorkerExtension",
    "register",
]
