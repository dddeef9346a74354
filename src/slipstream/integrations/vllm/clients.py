"""How a trainer reaches one vLLM engine's weight-update calls: :class:`OfflineEngine` (an
``LLM`` in this process) and :class:`HTTPEngine` (the routes of ``vllm serve``, which
serves them with ``VLLM_SERVER_DEV_MODE=1``).

Both carry only small control messages (where the sync group is, which version comes);
the weights travel over slipstream's transports. Each call returns once every worker of the
engine answered, or raises with the engine's own error; an :class:`HTTPEngine`'s call also
ends (its connection closed) once its timeout passed, which :meth:`Engine.bounded` caps at
the trainer's.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol


class Engine(Protocol):
    """One vLLM engine as the trainer drives it; ``name`` identifies it in errors and
    ``workers`` counts its worker processes (each joins the sync group)."""

    name: str
    workers: int

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None) -> None: ...

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's cached KV blocks; ``False`` where some are still in use."""
        ...

    def pause_generation(self) -> None:
        """Let the requests in flight finish and schedule no other until
        :meth:`resume_generation` (their tokens all come from one version)."""
        ...

    def resume_generation(self) -> None: ...

    def bounded(self, timeout: float) -> Engine:
        """This engine with every call ending within ``timeout`` seconds (where the engine
        can end a call: an in-process one cannot be)."""
        ...


@dataclass
class OfflineEngine:
    """A ``vllm.LLM`` built with ``weight_transfer_config={"backend": "slipstream"}``.

    Its generation runs on the caller's thread, so none is in flight while the same
    program publishes: pausing and resuming it do nothing."""

    llm: Any
    name: str = "llm"
    workers: int = 1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def pause_generation(self) -> None:
        return None

    def resume_generation(self) -> None:
        return None

    def bounded(self, timeout: float) -> OfflineEngine:
        return self


@dataclass
class HTTPEngine:
    """A ``vllm serve`` at ``url`` (``http://127.0.0.1:PORT``), started with
    ``--weight-transfer-config '{"backend": "slipstream"}'`` and ``VLLM_SERVER_DEV_MODE=1``;
    ``api_key`` is sent as a bearer token when set. ``timeout``: seconds any call may take
    (an update waits for the whole version); a call that takes longer is ended, its
    connection closed."""

    url: str
    api_key: str | None = None
    timeout: float = 300.0
    name: str = ""
    workers: int = 1

    def __post_init__(self) -> None:
        self.name = self.name or self.url

    def post(self, route: str, body: dict[str, Any] | None = None) -> Any:
        """POST ``body`` as JSON to ``route`` (a path, with its query if any); its JSON
        answer, or raise with the server's."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url.rstrip("/") + route,
            data=json.dumps(body or {}).encode(),
            headers=headers,
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise RuntimeError(f"{self.name} {route}: HTTP {exc.code}: {detail}") from None
        return json.loads(text) if text else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("/shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None) -> None:
        self.post("/finish_weight_update", {"weight_version": weight_version})

    def reset_prefix_cache(self) -> bool:
        answer = self.post("/reset_prefix_cache")
        return bool(isinstance(answer, dict) and answer.get("success"))

    def pause_generation(self) -> None:
        self.post("/pause?mode=wait")

    def resume_generation(self) -> None:
        self.post("/resume")

    def bounded(self, timeout: float) -> HTTPEngine:
        return dataclasses.replace(self, timeout=min(self.timeout, timeout))
