"""Where received bytes go: an ``nn.Module`` (in place, by name) or a ``load_weights`` callable.

:class:`ModuleTarget` checks the whole plan against the module before any byte is received
(missing names, tensors it cannot write in place, shape or dtype mismatches, non-contiguous
parameters, all listed at once) and then copies each received slice straight into the
parameter's bytes: every destination it writes (in place, by view or by address) is one of
the tensors that check accepted. Every name of a sent tensor is applied (aliases: a tie sent
once); names are looked up among the module's parameters and buffers under all the names
they go by (``remove_duplicate=False``, the names ``state_dict()`` uses), then, for what is
still missing, in ``state_dict(keep_vars=True)``.
A target tensor reached by several names of one sent tensor (a tie kept in the target) is
written once. A DTensor target (a tensor-parallel rollout's) is written in its local shard:
of each slice only the bytes of its box, a run of rows or a band of columns
(:mod:`.destinations`).

:class:`CallableTarget` hands ``load_weights`` whole tensors only: a tensor that fits in one
slice is passed as a view of the receive buffer; a tensor split over several buckets is
reassembled in a buffer kept for it (allocated once per plan) and passed after its last
bucket. A tensor sent under several names is passed under each (the same tensor). Tensors
passed are valid only during the call: copy what you keep. Given ``keeps`` (a
:class:`~..layout.runs.Narrow` by name: the part of a tensor ``load_weights`` reads, a
tensor-parallel worker's loader), it receives only those bytes of that tensor and passes a
tensor of the sent shape holding them in that part (zeros elsewhere, never another
version's bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from ...core.copy import copy_in_slices
from ...errors import SyncError
from ..layout.described import DESCRIBED
from ..layout.plan import BucketPlan, Slice, TensorSpec, is_dtensor
from ..layout.runs import Narrow, Runs
from .destinations import Dest, destination, placed

NameMap = Mapping[str, str] | Callable[[str], str | None] | None
LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
Keeps = Mapping[str, Narrow] | Callable[[Layout], Mapping[str, Narrow]]
"""A :class:`Narrow` by name, or a function of the version's layout (each name its shape and
dtype, the names ``load_weights`` sees) that gives them."""


def map_name(name_map: NameMap, name: str) -> str | None:
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)


def unwritable(t: torch.Tensor) -> str | None:
    """Why slipstream cannot write received bytes into ``t`` through its own pointer, or
    ``None`` when it can.

    Invariant: a destination is written only through a pointer slipstream checked: ``t`` is a
    tensor whose values are its own memory (no wrapper subclass, one that defines
    ``__torch_dispatch__``: a DTensor, a fake or functional tensor), strided, not on the meta
    device, with a non-zero ``data_ptr()`` if it holds any byte. A ``Parameter`` subclass
    that keeps its values in its own storage (an inference engine's) is written like any
    tensor. Its contiguity is checked apart (:meth:`ModuleTarget.check`).
    """
    if placed(t):
        return unwritable(cast(Any, t).to_local())
    if is_dtensor(t):
        return (
            f"DTensor placed {list(cast(Any, t).placements)}: slipstream writes a DTensor's "
            "local shard when each mesh dimension places it Shard(0), Shard(1) (of a tensor "
            "of 2 or more dimensions) or Replicate(): rows, or rows by a band of columns"
        )
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return f"a tensor subclass ({type(t).__name__}): slipstream writes plain tensors only"
    if t.device.type == "meta":
        return "on the meta device: it has no memory"
    if t.layout != torch.strided:
        return f"{t.layout} layout: slipstream writes strided tensors only"
    if t.numel() and not t.data_ptr():
        return "its data_ptr() is 0 (a wrapper without memory of its own): nothing to write to"
    return None


class ModuleTarget:
    """Copies into ``module``'s parameters and buffers, matched by (mapped) name."""

    kind = "module"

    def __init__(self, module: nn.Module, name_map: NameMap = None) -> None:
        self.module = module
        self.name_map = name_map
        self._dest: dict[int, list[Dest]] = {}
        self._own: dict[str, torch.Tensor] | None = None
        self._whole_dict = False

    def check(self, plan: BucketPlan, first: int = 0) -> list[str]:
        """Every problem between the plan and the module, as messages naming the tensors;
        only a tensor it accepts (:func:`unwritable` has nothing against it, contiguous, of the
        sent shape and dtype) becomes a destination.

        Every name of a sent tensor (its aliases too) is looked up; names that reach the
        same target tensor (a tie in the target) are written once. ``first``: the plan's
        tensors before it were checked already (a described round's layout grows as it
        arrives, :mod:`..layout.described`), and only the others are.
        """
        if first == 0:
            self._dest, self._own, self._whole_dict = {}, None, False
        specs = plan.specs[first:]
        own = self._named_tensors(n for spec in specs for n in spec.names)
        missing, unwritables, shapes, dtypes, layout = [], [], [], [], []
        for i, spec in enumerate(specs, first):
            dests: dict[tuple, Dest] = {}
            for sent in spec.names:
                name = map_name(self.name_map, sent)
                if name is None:
                    continue
                t = own.get(name)
                if t is None:
                    missing.append(name if name == sent else f"{sent} -> {name}")
                elif (why := unwritable(t)) is not None:
                    unwritables.append(f"{name}: {why}")
                elif tuple(t.shape) != spec.shape:
                    shapes.append(f"{name}: sent {list(spec.shape)}, target {list(t.shape)}")
                elif t.dtype != spec.torch_dtype:
                    dtypes.append(
                        f"{name}: sent {spec.dtype}, target {str(t.dtype).removeprefix('torch.')}"
                    )
                elif not (local := _local(t)).is_contiguous():
                    layout.append(name)
                else:
                    dest = destination(t, local, spec)
                    key = (dest.data.device, dest.data.data_ptr(), dest.data.numel())
                    dests.setdefault(key, dest)
            if dests:
                self._dest[i] = list(dests.values())
        problems = []
        if missing:
            problems.append(f"not in the target: {missing}")
        if unwritables:
            problems.append(f"cannot be written in place: {unwritables}")
        if shapes:
            problems.append(f"shape mismatch: {shapes}")
        if dtypes:
            problems.append(f"dtype mismatch: {dtypes}")
        if layout:
            problems.append(f"non-contiguous in the target: {layout}")
        return problems

    def _named_tensors(self, wanted: Iterable[str]) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers under every name they go by (tied ones under
        each), and, if some of ``wanted`` (mapped) is not among them, the tensors of its
        ``state_dict(keep_vars=True)`` under the names that uses (read once per check of
        a whole plan)."""
        own = self._own
        if own is None:
            own = dict(self.module.named_parameters(remove_duplicate=False))
            own.update(self.module.named_buffers(remove_duplicate=False))
            self._own = own
        names = (map_name(self.name_map, n) for n in wanted)
        if not self._whole_dict and any(n is not None and n not in own for n in names):
            self._whole_dict = True
            for name, t in self.module.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor):
                    own.setdefault(name, t)
        return own

    def keeps_part(self) -> bool:
        """Whether it may keep only part of a sent tensor (a parameter or buffer of the
        module is a DTensor)."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return any(is_dtensor(t) for t in tensors)

    @property
    def whole(self) -> bool:
        """Whether every destination holds its tensor whole (no DTensor shard): only then may
        deltas be applied in place (a delta's words are placed by slice)."""
        return all(d.whole for dests in self._dest.values() for d in dests)

    def kept(self, s: Slice) -> int:
        """How many bytes of slice ``s`` this target takes (the most any of its
        destinations keeps)."""
        return max((d.kept(s) for d in self._dest.get(s.tensor, ())), default=0)

    def stages(self, plan: BucketPlan) -> dict[int, Dest]:
        """For each tensor of ``plan`` it takes, the runs a buffer staging them holds: its
        destinations' when they all keep the same runs (a DTensor's shard), else every byte
        (the ``data`` of each is the destination's, to be put :meth:`Dest.on` a buffer)."""
        found = {}
        for i, dests in self._dest.items():
            first = dests[0]
            if all(d.runs == first.runs for d in dests):
                found[i] = first
            else:
                n = plan.specs[i].nbytes
                found[i] = Dest(first.data, Runs.one(0, n, n))
        return found

    def replay(self, s: Slice, stage: Dest) -> None:
        """Write slice ``s`` from ``stage`` (a buffer with the runs :meth:`stages` gave
        its tensor, holding the slice's kept bytes) into every destination."""
        lo, hi = stage.local_range(s)
        self.write_kept(s, stage.runs, stage.data[lo:hi])

    def kept_view(self, s: Slice) -> torch.Tensor | None:
        """Where the kept bytes of slice ``s`` (of a tensor it keeps in part) land, for
        receiving them in place: its first destination's."""
        dests = self._dest.get(s.tensor)
        if not dests:
            return None
        lo, hi = dests[0].local_range(s)
        return dests[0].data[lo:hi]

    def write_kept(self, s: Slice, runs: Runs, data: torch.Tensor, landed: bool = False) -> None:
        """Write the bytes of slice ``s`` that ``runs`` keep (``data``, in their order: of
        runs :meth:`stages` gave, so every byte where they are whole) into every
        destination; ``landed``: they were received into :meth:`kept_view` already."""
        for k, dest in enumerate(self._dest.get(s.tensor, ())):
            if dest.runs != runs:  # runs that are every byte, of a tensor held twice
                dest.copy(s, data)
            elif not (landed and k == 0):
                lo, hi = dest.local_range(s)
                copy_in_slices(dest.data[lo:hi], data)

    def direct_view(self, s: Slice) -> torch.Tensor | None:
        """The bytes slice ``s`` goes to, for receiving it in place (``None``: into the
        payload, then :meth:`write`). A tensor with several destinations (aliases untied in
        the target) lands in the first, when it holds every byte of ``s``; :meth:`landed`
        copies it to the others."""
        dests = self._dest.get(s.tensor)
        return None if not dests else dests[0].view(s)

    def write(self, s: Slice, data: torch.Tensor) -> None:
        """Write slice ``s``'s bytes ``data`` into what each destination holds of them."""
        for dest in self._dest.get(s.tensor, ()):
            dest.copy(s, data)

    def views(self, s: Slice) -> list[torch.Tensor]:
        """Every destination of slice ``s``'s bytes (none: not applied), for writing in
        place: deltas, which only a target holding its tensors whole asks for (:attr:`whole`)."""
        views = [d.view(s) for d in self._dest.get(s.tensor, ())]
        if any(v is None for v in views):
            raise SyncError(f"a delta reached tensor {s.tensor}, which this target holds in part")
        return cast(list[torch.Tensor], views)

    def landed(self, s: Slice) -> None:
        """Slice ``s`` was received into :meth:`direct_view`: copy it to the other
        destinations of its tensor, if any."""
        dests = self._dest.get(s.tensor, [])
        landed = dests[0].view(s) if dests else None
        for dest in dests[1:]:
            assert landed is not None
            dest.copy(s, landed)

    def tensor_done(self, i: int, spec: TensorSpec, whole: torch.Tensor | None) -> None:
        return None

    def flush(self) -> None:
        return None


class CallableTarget:
    """Calls ``load_weights(list[(name, tensor)])`` with whole tensors, once per bucket (of
    a tensor named in ``keeps``, only its part: see the module's docstring)."""

    kind = "callable"

    def __init__(
        self,
        load_weights: LoadWeights,
        name_map: NameMap = None,
        assembly: dict[tuple[str, int], torch.Tensor] | None = None,
        keeps: Keeps | None = None,
    ) -> None:
        self.load_weights = load_weights
        self.name_map = name_map
        self._keeps_of = keeps
        self._keeps_for = ""
        self.keeps: dict[str, Narrow] = {} if callable(keeps) else dict(keeps or {})
        self._assembly = {} if assembly is None else assembly
        self._plan_id = ""
        self._runs: dict[int, Runs] = {}
        self._narrows: dict[int, Narrow] = {}
        self._specs: Sequence[TensorSpec] = ()
        self._batch: list[tuple[str, torch.Tensor]] = []

    def check(self, plan: BucketPlan, first: int = 0) -> list[str]:
        """What is wrong with ``keeps`` for the plan (a name it does not send, a part
        outside its tensor); drops reassembly
        buffers of older plans (when a plan's check starts: ``first`` is 0)."""
        if not first:
            self._plan_id, self._runs, self._narrows = plan.plan_id, {}, {}
            # a described round's layout is another one each time: its buffers never serve again
            stale = [k for k in self._assembly if k[0] != plan.plan_id or k[0] == DESCRIBED]
            for key in stale:
                del self._assembly[key]
        self._specs = plan.specs
        if callable(self._keeps_of) and not first and self._keeps_for != plan.plan_id:
            # a described round's layout is known only as it arrives: every byte of it
            described = plan.plan_id == DESCRIBED
            self.keeps = {} if described else dict(self._keeps_of(self._layout(plan)))
            self._keeps_for = plan.plan_id
        if not self.keeps:
            return []
        problems: list[str] = []
        seen: set[str] = set()
        for i, spec in enumerate(plan.specs[first:], first):
            names = [n for n in (map_name(self.name_map, m) for m in spec.names) if n]
            seen.update(n for n in names if n in self.keeps)
            wrong = [
                w for n in names if n in self.keeps and (w := self.keeps[n].check(n, spec.shape))
            ]
            problems.extend(wrong)
            narrow = None if wrong else _union(names, self.keeps, spec.shape)
            if narrow is not None:
                self._narrows[i] = narrow
                itemsize = spec.torch_dtype.itemsize
                self._runs[i] = Runs.of_narrow(spec.shape, itemsize, narrow)
        unsent = sorted(set(self.keeps) - seen)
        if unsent and plan.plan_id != DESCRIBED:
            problems.append(f"names tensors not sent: {unsent}")
        return [f"keeps: {'; '.join(problems)}"] if problems else []

    def adopt(self, plan_id: str) -> None:
        """A described round's layout became plan ``plan_id``: its reassembly buffers serve
        that plan from now on (the same tensors, laid out the same)."""
        for key in [k for k in self._assembly if k[0] == DESCRIBED]:
            self._assembly[(plan_id, key[1])] = self._assembly.pop(key)
        self._plan_id = plan_id

    def _layout(self, plan: BucketPlan) -> Layout:
        return {
            name: (spec.shape, spec.torch_dtype)
            for spec in plan.specs
            for name in (map_name(self.name_map, n) for n in spec.names)
            if name is not None
        }

    def keeps_part(self) -> bool:
        """Whether it may keep only part of a sent tensor (``keeps`` was given)."""
        return self._keeps_of is not None and (callable(self._keeps_of) or bool(self.keeps))

    def _kept_runs(self, i: int, spec: TensorSpec) -> Runs:
        return self._runs.get(i) or Runs.one(0, spec.nbytes, spec.nbytes)

    def assembly(self, i: int, spec: TensorSpec) -> torch.Tensor:
        """The buffer tensor ``i``'s kept bytes are put together in (one after another)."""
        size = self._kept_runs(i, spec).nbytes
        buf = self._assembly.get((self._plan_id, i))
        if buf is None or buf.numel() != size:  # another receive may have kept another part
            buf = torch.empty(size, dtype=torch.uint8)
            self._assembly[(self._plan_id, i)] = buf
        return buf

    def assemble(self, s: Slice, spec: TensorSpec, data: torch.Tensor) -> None:
        """Put the kept bytes of slice ``s`` (``data``, its every byte) in its tensor's
        :meth:`assembly`."""
        Dest(self.assembly(s.tensor, spec), self._kept_runs(s.tensor, spec)).copy(s, data)

    def kept(self, s: Slice) -> int:
        """Every byte, but of a tensor it keeps in part."""
        runs = self._runs.get(s.tensor)
        return s.nbytes if runs is None else runs.kept(s)

    def stages(self, plan: BucketPlan) -> dict[int, Dest]:
        """Every tensor, the bytes it keeps (its ``data`` a placeholder, to be put
        :meth:`Dest.on` a buffer)."""
        empty = torch.empty(0, dtype=torch.uint8)
        return {i: Dest(empty, self._kept_runs(i, s)) for i, s in enumerate(plan.specs)}

    def replay(self, s: Slice, stage: Dest) -> None:
        return None

    def kept_view(self, s: Slice) -> torch.Tensor | None:
        """Where the kept bytes of slice ``s`` land in a routed round: its assembly."""
        runs = self._runs.get(s.tensor)
        if runs is None:
            return None
        lo, hi = runs.local_range(s)
        return self.assembly(s.tensor, self._specs[s.tensor])[lo:hi]

    def write_kept(self, s: Slice, runs: Runs, data: torch.Tensor, landed: bool = False) -> None:
        """Put the kept bytes of slice ``s`` (``data``, in their order) in its assembly."""
        if not landed:
            lo, hi = runs.local_range(s)
            copy_in_slices(self.assembly(s.tensor, self._specs[s.tensor])[lo:hi], data)

    def direct_view(self, s: Slice) -> torch.Tensor | None:
        """Always ``None``: ``load_weights`` is handed whole tensors, never fed in place."""
        return None

    def write(self, s: Slice, data: torch.Tensor) -> None:
        return None

    def landed(self, s: Slice) -> None:
        return None

    def tensor_done(self, i: int, spec: TensorSpec, whole: torch.Tensor | None) -> None:
        """Queue tensor ``i`` under each of its names (aliases included, the same tensor for
        each); ``whole`` holds its kept bytes (else its reassembly buffer does)."""
        data = whole if whole is not None else self._assembly[(self._plan_id, i)]
        narrow = self._narrows.get(i)
        if narrow is None:
            tensor = data.view(spec.torch_dtype).view(spec.shape)
        else:
            tensor = self._spread(i, spec, narrow, data)
        for sent in spec.names:
            name = map_name(self.name_map, sent)
            if name is not None:
                self._batch.append((name, tensor))

    def _spread(self, i: int, spec: TensorSpec, narrow: Narrow, data: torch.Tensor) -> torch.Tensor:
        """A tensor of the sent shape holding ``data`` (the kept bytes) in its part, zeros
        elsewhere (a buffer kept for it, allocated once per plan)."""
        key = (self._plan_id, -1 - i)  # beside its assembly, dropped with it
        full = self._assembly.get(key)
        if full is None:
            full = torch.zeros(spec.nbytes, dtype=torch.uint8)
            self._assembly[key] = full
        tensor = full.view(spec.torch_dtype).view(spec.shape)
        part = tensor.narrow(narrow.dim, narrow.start, narrow.length)
        part.copy_(data.view(spec.torch_dtype).view(part.shape))
        return tensor

    def flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.load_weights(batch)


def _union(
    names: Sequence[str], keeps: Mapping[str, Narrow], shape: tuple[int, ...]
) -> Narrow | None:
    """The part of a tensor sent under ``names`` (a tie: each name read by its own loader)
    that covers every name's, or ``None`` where that is the whole tensor: a name not in
    ``keeps`` is read whole; a name read not at all (length 0) adds nothing; parts of one
    dimension join into the range spanning them, parts of two make the whole."""
    if not names or any(n not in keeps for n in names):
        return None
    parts = [keeps[n] for n in names if keeps[n].length]
    if not parts:
        return Narrow(0, 0, 0)
    dim = parts[0].dim
    if any(p.dim != dim for p in parts):
        return None
    start = min(p.start for p in parts)
    length = max(p.start + p.length for p in parts) - start
    return None if length == shape[dim] else Narrow(dim, start, length)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes receive ``t``'s: its local shard for a DTensor."""
    return cast(Any, t).to_local() if is_dtensor(t) else t.data


def make_target(
    target: nn.Module | LoadWeights,
    name_map: NameMap,
    assembly: dict[tuple[str, int], torch.Tensor],
    keeps: Keeps | None = None,
) -> ModuleTarget | CallableTarget:
    if isinstance(target, nn.Module):
        if keeps:
            raise TypeError(
                "keeps is for a load_weights callable: a module keeps what its DTensors hold"
            )
        return ModuleTarget(target, name_map)
    if callable(target):
        return CallableTarget(target, name_map, assembly, keeps)
    raise TypeError(
        f"target must be an nn.Module or a load_weights callable, got {type(target).__name__}"
    )


def raise_problems(problems: list[str], version: int, rank: int) -> None:
    if problems:
        raise SyncError(
            f"rollout rank {rank} rejected version {version} before applying any byte: "
            + "; ".join(problems)
        )
