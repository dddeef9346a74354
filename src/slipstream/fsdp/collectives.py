"""The collectives a model's FSDP units run: async all-gather and reduce-scatter on one process
group, ordered after the compute stream, into staging buffers shared by every unit, each
waited on with a timeout.

Invariants:
- every collective is issued from the caller's thread as async work (on an accelerator under
  the communication stream, which first waits for the work queued on the compute stream);
- a staging buffer is sized at allocation to the largest request any unit will make for its
  key, so a request never allocates;
- every wait is bounded by ``timeout`` and its expiry raises :class:`PeerTimeoutError` naming
  the rank and the collective.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core import tracing
from ..core.streams import current_stream, new_stream, on_stream, record_event, wait_event
from ..errors import PeerTimeoutError

# torch 2.13 renamed the single-tensor collectives (the old names warn there); older torch
# releases, which pyproject admits, have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class InFlight:
    """One async collective: its work handle and its issue-to-completion time, stamped by the
    work's own future. Work without a future (gloo's reduce-scatter) counts until the
    caller's wait returns."""

    def __init__(self, work: dist.Work, what: str, track: str) -> None:
        self.work = work
        self.what = what
        self.track = track
        self.issued = time.perf_counter()
        self.issued_ns = time.monotonic_ns()
        self.done: float | None = None
        self.done_ns: int | None = None
        try:
            fut = work.get_future()
        except RuntimeError:
            return
        fut.add_done_callback(self._stamp)

    def _stamp(self, _fut: object) -> None:
        self.done = time.perf_counter()
        self.done_ns = time.monotonic_ns()

    def seconds(self) -> float:
        """Issue to completion (to now while the work runs)."""
        return (self.done or time.perf_counter()) - self.issued

    def wait(self, rank: int, timeout: float) -> float:
        """Block until the work completes; returns the seconds the caller blocked. The work
        goes into a trace being recorded as an interval on its track (issue to completion)."""
        start = time.perf_counter()
        try:
            ok = self.work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as e:
            raise PeerTimeoutError(
                f"rank {rank}: {self.what} did not complete within {timeout:.0f} s: {e}"
            ) from e
        if ok is False:
            raise PeerTimeoutError(f"rank {rank}: {self.what} did not complete")
        returned = time.monotonic_ns()  # the future's stamp may land after wait returns
        done = min(self.done_ns or returned, returned)
        tracing.record_interval(self.what, self.track, self.issued_ns, done)
        return time.perf_counter() - start


@dataclass
class Staging:
    """Flat buffers keyed by role, one per key, each as large as its largest request.

    A key's last element is the buffer's dtype. Sizes are declared with :meth:`need` for
    every unit before :meth:`allocate`; :meth:`take` then hands out a prefix, made once per
    ``(key, numel)`` and reused (no view is built per step).
    """

    device: torch.device
    _sizes: dict[tuple[Hashable, ...], int] = field(default_factory=dict)
    _buffers: dict[tuple[Hashable, ...], torch.Tensor] = field(default_factory=dict)
    _prefixes: dict[tuple[tuple[Hashable, ...], int], torch.Tensor] = field(default_factory=dict)

    def need(self, key: tuple[Hashable, ...], numel: int) -> None:
        self._sizes[key] = max(self._sizes.get(key, 0), numel)

    def allocate(self) -> None:
        self._buffers = {
            key: torch.empty(numel, dtype=_key_dtype(key), device=self.device)
            for key, numel in self._sizes.items()
        }
        self._prefixes = {}

    def take(self, key: tuple[Hashable, ...], numel: int) -> torch.Tensor:
        """The first ``numel`` elements of ``key``'s buffer."""
        prefix = self._prefixes.get((key, numel))
        if prefix is None:
            prefix = self._prefixes[(key, numel)] = self._buffers[key][:numel]
        return prefix


def _key_dtype(key: tuple[Hashable, ...]) -> torch.dtype:
    dtype = key[-1]
    assert isinstance(dtype, torch.dtype), f"staging key {key} does not end with its dtype"
    return dtype


class Collectives:
    """The process group, communication stream, staging and timeout one model's units share.

    Units issue their own all-gathers and reduce-scatters through it; the caller of
    :meth:`InFlight.wait` decides when to wait.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.timeout = timeout
        self.stream = new_stream(device)
        self.staging = Staging(device)

    def _after_compute(self) -> None:
        wait_event(self.stream, record_event(current_stream(self.device)))

    def all_gather_into(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str
    ) -> list[InFlight]:
        """Async all-gathers of ``(output, input)`` pairs, issued after the compute so far."""
        flights = []
        with on_stream(self.stream):
            self._after_compute()
            for i, (out, inp) in enumerate(pairs):
                work = all_gather_single(out, inp, group=self.group, async_op=True)
                flights.append(InFlight(work, what, f"fsdp all-gather in flight (group {i})"))
        return flights

    def reduce_scatter_into(
        self, out: torch.Tensor, inp: torch.Tensor, what: str, slot: int
    ) -> InFlight:
        """Async averaging reduce-scatter of ``inp`` into ``out`` (reduce staging ``slot``),
        issued after the compute."""
        with on_stream(self.stream):
            self._after_compute()
            work = reduce_scatter_single(
                out, inp, op=dist.ReduceOp.AVG, group=self.group, async_op=True
            )
        return InFlight(work, what, f"fsdp reduce-scatter in flight (slot {slot})")

    def exchange(self, mine: torch.Tensor) -> torch.Tensor:
        """Blocking all-gather of a small tensor from every rank (rank-major, concatenated)."""
        every = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_single(every, mine, group=self.group)
        return every
