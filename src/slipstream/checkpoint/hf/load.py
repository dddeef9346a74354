"""Loading a directory of Hugging Face safetensors into a state dict, in place.

The files' headers are parsed here (see :mod:`.safetensors_format`) and described as a
checkpoint whose every tensor is one saved chunk; from there loading is the same as for a
DCP checkpoint (:mod:`..load.loader`): each rank plans, for each of its tensors and DTensor
shards, only the byte ranges it covers, and reads them in parallel straight into the
tensors' memory. :func:`load_hf` runs no collective; ``ss.load`` of such a directory runs
the plan (:func:`open_hf`) on every rank of its group, replicas splitting the reads
(:mod:`..collective_load`).

Names: the state dict's flat keys (DCP's flattening) are the files' tensor names, under
``prefix`` if one is given or found (``{"model": model.state_dict()}`` flattens to
``model.<name>``). A key the files lack is an error unless its tensor shares memory
with one they hold (tied weights, which ``save_pretrained`` writes once). A tensor whose
dtype differs from the file's is read in the file's dtype and cast, with a warning that
names it.

Invariant: every check (names, shapes, the files' headers and sizes) runs before the
first byte lands in the state dict.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from ...core import tracing
from ...core.flatten import flatten, resolve_stateful
from ...core.threads import usable_cores
from ...errors import CheckpointError, CorruptCheckpointError
from ..format.names import METADATA_FILE, check_inside
from ..load.loader import MAX_IO_THREADS, OBJECT_STORE_IO_THREADS, PlannedLoad, plan_reads
from ..load.reader import CheckpointReader, ReadRequest, SourceRecord
from ..storage import Location, Storage, resolve_storage
from ..storage.local import LocalStorage
from .safetensors_format import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsEntry,
    header_length,
    parse_header,
)

logger = logging.getLogger(__name__)

HEAD_BYTES = 256 * 1024
"""Bytes fetched first from each file of an object store, where every request is a round
trip: the whole header of nearly every model's file. From a local file, the 8 bytes of
the header's length are read first, then the header, and no tensor byte."""
MAX_NAMES_IN_ERRORS = 20
BYTES_PER_THREAD = 64 * 1024 * 1024


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first
    frame outside slipstream (the user's call of ``ss.load``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back
        level += 1
    return level


def _names(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:MAX_NAMES_IN_ERRORS])
    more = len(keys) - MAX_NAMES_IN_ERRORS
    return f"{shown} and {more} more" if more > 0 else shown


def _local_safetensors(storage: Storage) -> list[str]:
    if not isinstance(storage, LocalStorage) or not storage.path.is_dir():
        return []
    return sorted(n for n in os.listdir(storage.path) if n.endswith(".safetensors"))


def is_hf_directory(storage: Storage) -> bool:
    """Whether ``storage`` holds Hugging Face safetensors and no DCP checkpoint."""
    if storage.exists(METADATA_FILE):
        return False
    return (
        storage.exists(INDEX_FILE)
        or storage.exists(SINGLE_FILE)
        or bool(_local_safetensors(storage))
    )


def _weight_map(storage: Storage) -> dict[str, str] | None:
    data = storage.get(INDEX_FILE)
    if data is None:
        return None
    path = f"{storage.url.rstrip('/')}/{INDEX_FILE}"
    try:
        weight_map = json.loads(data)["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path} is not a safetensors index ({exc!r})") from exc
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{path}: its weight_map is not a JSON object")
    return {
        str(k): check_inside(v, storage.url, f"{INDEX_FILE} (for {k!r})")
        for k, v in weight_map.items()
    }


def _read_file_header(storage: Storage, file: str) -> dict[str, SafetensorsEntry]:
    path = f"{storage.url.rstrip('/')}/{file}"
    size = storage.size(file)
    first = 8 if storage.small_reads_are_cheap else HEAD_BYTES
    head = bytes(storage.read(file, 0, min(size, first)))
    length = header_length(head, path)
    if 8 + length > size:
        raise CorruptCheckpointError(
            f"{path} is truncated: {size} bytes, but its header alone takes {8 + length}"
        )
    if 8 + length > len(head):
        head += bytes(storage.read(file, len(head), 8 + length - len(head)))
    return parse_header(head[8 : 8 + length], file, size, path)


def read_entries(storage: Storage, io_threads: int) -> dict[str, SafetensorsEntry]:
    """Every tensor of the directory ``storage``: from the files its index names, else
    ``model.safetensors``, else (on the local disk) every ``*.safetensors`` file in it."""
    weight_map = _weight_map(storage)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    elif storage.exists(SINGLE_FILE):
        files = [SINGLE_FILE]
    else:
        files = _local_safetensors(storage)
    if not files:
        raise CheckpointError(
            f"{storage.url} holds no Hugging Face safetensors: no {INDEX_FILE}, no "
            f"{SINGLE_FILE}, no *.safetensors file"
        )
    for file in files:
        if not storage.exists(file):
            raise CorruptCheckpointError(
                f"{storage.url.rstrip('/')}/{INDEX_FILE} names {file}, which does not exist"
            )
    if storage.small_reads_are_cheap or len(files) == 1:
        headers = [_read_file_header(storage, f) for f in files]
    else:
        with ThreadPoolExecutor(
            min(io_threads, len(files)), thread_name_prefix="slipstream-hf"
        ) as p:
            headers = list(p.map(lambda f: _read_file_header(storage, f), files))
    entries: dict[str, SafetensorsEntry] = {}
    for header in headers:
        for name, entry in header.items():
            if name in entries:
                raise CorruptCheckpointError(
                    f"{storage.url}: tensor {name!r} is in both {entries[name].file} and "
                    f"{entry.file}"
                )
            entries[name] = entry
    if weight_map is not None:
        for name, file in weight_map.items():
            if entries.get(name) is None or entries[name].file != file:
                raise CorruptCheckpointError(
                    f"{storage.url.rstrip('/')}/{INDEX_FILE} maps {name!r} to {file}, "
                    f"which does not hold it"
                )
    return entries


class SafetensorsReader(CheckpointReader):
    """A directory of safetensors files seen as a checkpoint: one saved chunk per tensor,
    at its place in its file, without checksums (the format has none).

    Built from headers already parsed (:func:`read_entries`), so it reads no metadata
    file as :class:`CheckpointReader` does; the loader's planning and reads then use it
    as they use a checkpoint's reader."""

    def __init__(self, storage: Storage, entries: dict[str, SafetensorsEntry]) -> None:
        self.storage = storage
        self.path = storage.url
        self.entries = entries
        self.index = None
        self._layouts = {}
        state: dict[str, Any] = {}
        where: dict[MetadataIndex, Any] = {}
        for name, e in entries.items():
            zeros = torch.Size([0] * len(e.shape))
            state[name] = TensorStorageMetadata(
                TensorProperties(dtype=e.dtype),
                torch.Size(e.shape),
                [ChunkStorageMetadata(zeros, torch.Size(e.shape))],
            )
            where[MetadataIndex(name, zeros)] = _StorageInfo(e.file, e.data_offset, e.nbytes)
        self.metadata = Metadata(state_dict_metadata=state, storage_data=where)

    def source(
        self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype
    ) -> SourceRecord:
        e = self.entries[fqn]
        return SourceRecord(e.file, e.data_offset, e.nbytes, None, 0)

    def vanished(self, error: CorruptCheckpointError) -> CheckpointError | CorruptCheckpointError:
        """``error`` as it is: the directory has no ``.metadata`` whose absence would say it
        was deleted meanwhile."""
        return error


@dataclass
class _Target:
    """One state-dict tensor to fill from the file's tensor ``name``; ``read_into`` is the
    tensor itself, or one in the file's dtype that is cast into it afterwards."""

    name: str
    value: torch.Tensor
    read_into: torch.Tensor


def _storage_key(value: torch.Tensor) -> tuple[Any, ...] | None:
    local = value.to_local() if isinstance(value, DTensor) else value
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
    )


def _pick_prefix(keys: list[str], names: dict[str, SafetensorsEntry]) -> str:
    """The prefix under which the most state-dict keys are tensor names: none, or the first
    segment every key shares (``model.`` for ``{"model": model.state_dict()}``)."""
    candidates = [""]
    first = {k.split(".", 1)[0] for k in keys}
    if len(first) == 1 and all("." in k for k in keys):
        candidates.append(f"{first.pop()}.")
    return max(candidates, key=lambda p: sum(k[len(p) :] in names for k in keys))


def _read_target(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the file's bytes of ``value`` land: ``value`` itself, or, where the dtypes
    differ, a tensor of the file's dtype laid out as ``value`` (same shard, same device)."""
    if value.dtype == dtype:
        return value
    if isinstance(value, DTensor):
        shard = value.to_local()
        local = torch.empty(tuple(shard.shape), dtype=dtype, device=shard.device)
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return torch.empty(tuple(value.shape), dtype=dtype, device=value.device)


def _targets(
    flat: dict[str, Any],
    entries: dict[str, SafetensorsEntry],
    prefix: str,
    strict: bool,
    where: str,
) -> list[_Target]:
    """Match state-dict keys to tensor names and check them (see the module docstring)."""
    outside = [k for k in flat if not k.startswith(prefix)]
    if outside:
        raise CheckpointError(
            f"{where}: state-dict keys {_names(outside)} are not under the prefix {prefix!r}"
        )
    not_tensors = [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(
            f"{where} holds only tensors, but the state dict has other values at "
            f"{_names(not_tensors)}"
        )
    targets: list[_Target] = []
    missing: list[str] = []
    for key, value in flat.items():
        name = key[len(prefix) :]
        entry = entries.get(name)
        if entry is None:
            missing.append(key)
            continue
        if tuple(entry.shape) != tuple(value.shape):
            raise CheckpointError(
                f"{where}: shape mismatch for {name!r}: the file {entry.file} has "
                f"{list(entry.shape)}, the state dict has {list(value.shape)}"
            )
        targets.append(_Target(name, value, _read_target(value, entry.dtype)))
    if missing:  # a tied weight shares memory with one the files hold
        loaded = {_storage_key(t.value) for t in targets} - {None}
        missing = [k for k in missing if _storage_key(flat[k]) not in loaded]
    if missing:
        raise CheckpointError(
            f"{where}: keys missing from the safetensors files: {_names(missing)}"
            + (f" (looked up without the prefix {prefix!r})" if prefix else "")
        )
    if strict:
        unexpected = set(entries) - {t.name for t in targets}
        if unexpected:
            raise CheckpointError(
                f"{where}: unexpected tensors in the safetensors files (not in the state "
                f"dict): {_names(unexpected)}; pass strict=False to load only the keys you "
                "ask for"
            )
    cast: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
    for t in targets:
        if t.read_into is not t.value:
            cast.setdefault((entries[t.name].dtype, t.value.dtype), []).append(t.name)
    if cast:
        pairs = "; ".join(
            f"{len(names)} from {a} to {b} (first {names[0]!r})" for (a, b), names in cast.items()
        )
        warnings.warn(
            f"{where}: casting tensors to the state dict's dtype: {pairs}",
            stacklevel=_user_stacklevel(),
        )
    return targets


def _default_threads(storage: Storage, nbytes: int) -> int:
    """Read threads for ``nbytes``: on an object store ``OBJECT_STORE_IO_THREADS``; on the
    local disk one per ``BYTES_PER_THREAD`` of reads, at most one more than the usable
    cores (see :func:`slipstream.checkpoint.loader.load`). Starting a thread costs more than
    copying a few MiB, and ranks that share a host (each loading its shards) share its
    cores: a rank with little to read reads it in the caller's thread."""
    if not storage.small_reads_are_cheap:
        return OBJECT_STORE_IO_THREADS
    return max(1, min(MAX_IO_THREADS, usable_cores() + 1, -(-nbytes // BYTES_PER_THREAD)))


def open_hf(
    state_dict: dict[str, Any],
    storage: Storage,
    *,
    prefix: str | None = None,
    strict: bool = True,
    io_threads: int | None = None,
) -> PlannedLoad:
    """:func:`load_hf`'s checks and plan, nothing read into ``state_dict`` yet: the caller
    carries it out (:mod:`..collective_load`, where replicas split the reads) and closes its
    reader (which closes ``storage``)."""
    try:
        entries = read_entries(storage, io_threads or OBJECT_STORE_IO_THREADS)
        return plan_hf(SafetensorsReader(storage, entries), state_dict, prefix, strict, io_threads)
    except BaseException:
        storage.close()
        raise


def load_hf(
    state_dict: dict[str, Any],
    checkpoint_id: Location,
    *,
    prefix: str | None = None,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    io_threads: int | None = None,
) -> None:
    """Load a directory of Hugging Face safetensors into ``state_dict`` in place, on this
    process alone (``ss.load`` of such a directory loads it on every rank of a group,
    replicas splitting the reads).

    ``prefix``: the part of the state dict's keys the files' names lack (``"model."`` for
    ``{"model": model.state_dict()}``); ``None`` finds it. ``strict``: tensors of the files
    the state dict lacks are an error. ``io_threads``: parallel reads (default: one per
    64 MiB to read, at most one more than the usable cores; 16 on an object store).
    """
    started = time.perf_counter()
    storage = resolve_storage(checkpoint_id, storage_options)
    with tracing.span("slipstream.load", url=storage.url, format="huggingface"):
        planned = open_hf(state_dict, storage, prefix=prefix, strict=strict, io_threads=io_threads)
        try:
            nbytes = planned.read()
            planned.finish()
        finally:
            planned.reader.close()
    seconds = time.perf_counter() - started
    logger.info(
        "loaded %s (Hugging Face safetensors): %.3f GiB in %.3f s",
        storage.url,
        nbytes / 2**30,
        seconds,
    )


def plan_hf(
    reader: SafetensorsReader,
    state_dict: dict[str, Any],
    prefix: str | None,
    strict: bool,
    io_threads: int | None,
) -> PlannedLoad:
    """Check ``state_dict`` against the files and plan the reads that fill it; a tensor
    read in the file's dtype is cast into place by the plan's last copies."""
    resolved = resolve_stateful(state_dict)
    flat, paths = flatten(resolved)
    if prefix is None:
        prefix = _pick_prefix(list(flat), reader.entries)
    targets = _targets(flat, reader.entries, prefix, strict, reader.path)
    reads: list[ReadRequest] = []
    copies: list[Any] = []
    for t in targets:
        md = reader.metadata.state_dict_metadata[t.name]
        assert isinstance(md, TensorStorageMetadata)
        plan_reads(reader, t.name, t.read_into, md, reads, copies)
    for t in targets:
        if t.read_into is not t.value:
            copies.append((_local(t.value), _local(t.read_into), None))
    reads.sort(key=lambda r: (r.source.file, r.source.data_offset + r.start))
    nbytes = sum(r.end - r.start for r in reads)
    threads = io_threads or _default_threads(reader.storage, nbytes)
    return PlannedLoad(reader, state_dict, resolved, paths, reads, copies, [], threads)


def _local(value: torch.Tensor) -> torch.Tensor:
    return (value.to_local() if isinstance(value, DTensor) else value).detach()
