"""What one rank holds in a state dict: its tensor chunks and its plain values.

A :class:`LocalLayout` is computed on every save and load (cheap: no data is touched) and
is the key of the plan cache: the same layout means the same files, offsets and owners.

A DTensor's shard and each local shard of a ``ShardedTensor`` (FSDP1's
``SHARDED_STATE_DICT``) is a chunk of its global tensor, saved by the rank that holds it,
at the offsets its sharding gives: what DCP records for them.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from ...core.dtypes import dtype_from_name, dtype_name
from ...core.flatten import ContainerRecord, Containers, KeyTypes, Path, flatten, resolve_stateful
from ...core.shapes import numel
from ...errors import CheckpointError
from ..format.shards import local_chunks


@dataclass(frozen=True)
class ChunkSpec:
    """One tensor chunk this rank holds: a box of the global tensor."""

    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    replicated: bool

    @property
    def nbytes(self) -> int:
        return numel(self.sizes) * dtype_from_name(self.dtype).itemsize

    @functools.cached_property
    def record_key(self) -> str:
        return f"{self.fqn}@{','.join(map(str, self.offsets))}"


LayoutSignature = tuple[
    tuple[ChunkSpec, ...],
    tuple[str, ...],
    tuple[tuple[str, tuple[str | None, ...]], ...],
    tuple[tuple[str, ContainerRecord], ...],
]
"""What decides a save plan: a layout's chunk specs, value keys, key types and containers."""


@dataclass
class LocalLayout:
    """A rank's flattened state: chunk specs with their tensors, and plain values."""

    chunks: list[ChunkSpec]
    tensors: dict[str, torch.Tensor]  # record_key -> local tensor data for the chunk
    values: dict[str, Any]
    paths: dict[str, Path]
    key_types: KeyTypes = field(default_factory=dict)
    """The types of the state dict's non-string keys (see :data:`~...core.flatten.KeyTypes`)."""
    containers: Containers = field(default_factory=dict)
    """Its empty and non-``dict`` mappings (see :data:`~...core.flatten.Containers`)."""

    @property
    def signature(self) -> LayoutSignature:
        """Everything that decides the plan, as a hashable tuple (the plan cache's key)."""
        typed = tuple((k, tuple(v)) for k, v in self.key_types.items())
        return (tuple(self.chunks), tuple(self.values), typed, tuple(self.containers.items()))

    def fingerprint(self) -> str:
        """A short digest of :attr:`signature`, comparable across ranks."""
        desc = json.dumps(
            [
                [c.fqn, c.dtype, c.global_shape, c.offsets, c.sizes, c.replicated]
                for c in self.chunks
            ]
            + [list(self.values)]
        )
        return hashlib.sha256(desc.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1 << 16)
def _whole_tensor_spec(fqn: str, dtype: torch.dtype, shape: torch.Size) -> ChunkSpec:
    """The spec of a plain (replicated) tensor; cached, since layouts repeat every save."""
    return ChunkSpec(fqn, dtype_name(dtype), tuple(shape), (0,) * len(shape), tuple(shape), True)


@torch.no_grad()  # DTensor.to_local then returns the local tensor without an autograd node
def local_layout(state_dict: Mapping[str, Any]) -> LocalLayout:
    key_types: KeyTypes = {}
    containers: Containers = {}
    flat, paths = flatten(resolve_stateful(state_dict), key_types, containers)
    chunks: list[ChunkSpec] = []
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            local = value.to_local()
            for offsets, sizes in local_chunks(value, tuple(local.shape)):
                spec = ChunkSpec(
                    fqn,
                    dtype_name(value.dtype),
                    tuple(value.shape),
                    offsets,
                    sizes,
                    replicated=False,
                )
                if tuple(local.shape) != spec.sizes:
                    raise CheckpointError(
                        f"DTensor {fqn!r}: local shard shape {tuple(local.shape)} does not match "
                        f"its chunk {spec.sizes}"
                    )
                chunks.append(spec)
                tensors[spec.record_key] = local
        elif isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                if isinstance(shard.tensor, (DTensor, ShardedTensor)):
                    raise CheckpointError(
                        f"ShardedTensor {fqn!r} holds {type(shard.tensor).__name__} shards "
                        "(FSDP1 over tensor parallelism); slipstream saves ShardedTensors of "
                        "plain tensors: save this one with torch.distributed.checkpoint.save"
                    )
                spec = ChunkSpec(
                    fqn,
                    dtype_name(value.dtype),
                    tuple(value.size()),
                    tuple(shard.metadata.shard_offsets),
                    tuple(shard.metadata.shard_sizes),
                    replicated=False,
                )
                if tuple(shard.tensor.shape) != spec.sizes:
                    raise CheckpointError(
                        f"ShardedTensor {fqn!r}: local shard shape {tuple(shard.tensor.shape)} "
                        f"does not match its metadata {spec.sizes}"
                    )
                chunks.append(spec)
                tensors[spec.record_key] = shard.tensor
        elif isinstance(value, torch.Tensor):
            if value.is_sparse or value.layout != torch.strided:
                raise CheckpointError(f"{fqn!r}: only strided (dense) tensors can be saved")
            spec = _whole_tensor_spec(fqn, value.dtype, value.shape)
            chunks.append(spec)
            tensors[spec.record_key] = value
        else:
            values[fqn] = value
    return LocalLayout(chunks, tensors, values, paths, key_types, containers)


def serialize_value(fqn: str, value: Any) -> bytes:
    """``torch.save`` bytes of a plain value, as DCP stores them; names the key at fault."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as exc:
        raise CheckpointError(
            f"value {fqn!r} of type {type(value).__name__} cannot be saved: {exc}"
        ) from exc
    return buf.getvalue()


_ATOMS = (type(None), bool, int, str, bytes)


def _frozen(value: Any) -> Hashable | None:
    """A key equal for two values exactly when they pickle alike: types, order and float
    bits included (``-0.0`` and ``0.0``, ``1`` and ``True`` differ); ``None`` for anything
    but atoms, floats and lists, tuples and dicts of them."""
    kind = type(value)
    if kind in _ATOMS:
        return kind, value
    if kind is float:
        return kind, value.hex()
    if kind is list or kind is tuple:
        items = tuple(_frozen(v) for v in value)
        return None if None in items else (kind, items)
    if kind is dict:
        pairs = tuple((_frozen(k), _frozen(v)) for k, v in value.items())
        return None if any(None in pair for pair in pairs) else (kind, pairs)
    return None


class ValueSerializer:
    """Serializes plain values (see :func:`serialize_value`), remembering the last bytes of
    each key: a value that freezes (:func:`_frozen`) to the key's last one gets the same
    bytes back without pickling. Optimizer hyperparameters repeat in every save, and each
    ``torch.save`` call costs the caller's thread time.

    Invariant: the bytes returned for a value are those ``torch.save`` writes for it."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Hashable, bytes]] = {}

    def __call__(self, values: Mapping[str, Any]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for fqn, value in values.items():
            key = _frozen(value)
            last = self._last.get(fqn)
            if key is not None and last is not None and last[0] == key:
                out[fqn] = last[1]
                continue
            out[fqn] = serialize_value(fqn, value)
            if key is not None:
                self._last[fqn] = (key, out[fqn])
        return out
