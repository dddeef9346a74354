"""A host copy of the version a vLLM worker's model holds: :class:`HeldCopy`.

A load goes into the model layer by layer (vLLM's layerwise reload processes and repacks
each layer as soon as its weights have come), so a load that fails part-way leaves some
layers new. Loading the held version again, through the same loaders, puts every layer
back, repacked kernels included (a CPU worker keeps its packed oneDNN weights outside the
model's tensors, where no copy of the tensors reaches). What it loads is this copy of the
checkpoint tensors the model was last loaded from, taken after each load on a thread of
its own, while the engine serves.

Invariant: :attr:`HeldCopy.held` is the version the model holds, or ``None`` (before a
first update, or after a copy that failed: then nothing can be put back); the copying
thread belongs to the :class:`HeldCopy` and :meth:`HeldCopy.join` ends it, before the
buffer it reads is written again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from ...errors import PeerTimeoutError

logger = logging.getLogger(__name__)

#: Seconds a copy may take before :meth:`HeldCopy.join` gives up on it (a memory copy of
#: the worker's part of the model: seconds even for a large one).
COPY_TIMEOUT = 600.0


@dataclass
class Held:
    """Version ``version``'s checkpoint tensors, in host memory of their own."""

    version: int
    batch: list[tuple[str, torch.Tensor]]


class HeldCopy:
    """Keeps :class:`Held`, refreshed by :meth:`keep` after every load."""

    def __init__(self) -> None:
        self.held: Held | None = None
        self._thread: threading.Thread | None = None

    def keep(self, version: int, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Copy ``batch`` (version ``version``, just loaded; views of a buffer that stays
        unwritten until :meth:`join`) on a thread, into the tensors of the last copy where
        the layout is the same (that version is no longer held). Each storage is copied
        once, so tied names stay tied."""
        self.join()
        previous, self.held = self.held, None

        def copy() -> None:
            try:
                self.held = Held(version, _copied(batch, previous))
            except Exception:
                logger.exception("slipstream: the host copy of version %d failed", version)

        self._thread = threading.Thread(target=copy, name="slipstream-vllm-held", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the copy under way, if any (raising if it outlasts
        :data:`COPY_TIMEOUT`)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join(COPY_TIMEOUT)
        if thread.is_alive():
            raise PeerTimeoutError(
                f"slipstream: the host copy of the held version did not finish within "
                f"{COPY_TIMEOUT:.0f} s"
            )


def _copied(
    batch: list[tuple[str, torch.Tensor]], reuse: Held | None
) -> list[tuple[str, torch.Tensor]]:
    same = reuse is not None and [(n, t.shape, t.dtype) for n, t in reuse.batch] == [
        (n, t.shape, t.dtype) for n, t in batch
    ]
    copies: dict[tuple[int, int], torch.Tensor] = {}
    out = []
    for i, (name, t) in enumerate(batch):
        key = (t.data_ptr(), t.nbytes)
        if key not in copies:
            if same and reuse is not None:
                copies[key] = reuse.batch[i][1].copy_(t)
            else:
                copies[key] = t.clone()
        out.append((name, copies[key]))
    return out
