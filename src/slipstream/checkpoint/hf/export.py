"""Exporting a checkpoint's model weights as a Hugging Face model directory.

What is written is what ``save_pretrained`` writes: the model's tensors under their own
names (the checkpoint's prefix, e.g. ``model.`` of ``{"model": ..., "optim": ...}``,
stripped), each tied weight once, in ``model.safetensors`` or, past ``max_shard_size``,
in shards ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``
(``{"metadata": {"total_parameters", "total_size"}, "weight_map"}``), and the config
beside them when one is given. Optimizer state is never written.

With a config and transformers installed, the names and shapes are checked against the
model the config builds before anything is written; a missing or unexpected tensor is an
error that names it, so ``from_pretrained`` never fills a weight with random values.

Invariants: a shard is read (and cast) only when it is written, so memory holds at most
one shard; each file appears under its name whole (written to a temporary name first);
files of an earlier export that this one does not replace are removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...core.buffers import byte_view
from ...core.shapes import numel
from ...errors import CheckpointError
from ..load import loader
from ..load.reader import CheckpointReader
from ..storage import Location
from ..storage.files import fsync_dir, write_atomic
from .architecture import Architecture, architecture
from .safetensors_format import INDEX_FILE, NAMES, SINGLE_FILE, encode_header, shard_file_name

DEFAULT_MAX_SHARD_SIZE = "5GB"
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_OPTIMIZER_PARTS = ("state", "param_groups")
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

Progress = Callable[[int, int], None]
"""Called with (bytes written so far, bytes to write) after each tensor."""


@dataclass(frozen=True)
class HfExport:
    """What :func:`export_hf` wrote."""

    out_dir: str
    files: list[str]
    prefix: str
    """The checkpoint prefix that was stripped from the names."""
    weight_map: dict[str, str]
    """Tensor name -> the file that holds it."""
    total_size: int
    tied: dict[str, str] = field(default_factory=dict)
    """Tied copies left out -> the name they are written under."""
    skipped: list[str] = field(default_factory=list)
    """Checkpoint keys not exported (outside the prefix, optimizer state, plain values)."""
    architecture: str | None = None
    """The model class the names were checked against, if any."""

    def output_description(self) -> str:
        """Where the weights went, e.g. ``out/model.safetensors`` or ``out (3 shards)``."""
        if len(self.files) == 1:
            return os.path.join(self.out_dir, self.files[0])
        return f"{self.out_dir} ({len(self.files)} shards and {INDEX_FILE})"


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9 (KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB of 2)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in SIZE_UNITS):
        raise CheckpointError(
            f"cannot read the size {size!r}: write a number of bytes or e.g. 5GB, 500MB, 2GiB"
        )
    return int(float(match.group(1)) * SIZE_UNITS.get(unit, 1))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (floating dtypes only)."""
    if isinstance(name, torch.dtype):
        return name
    dtype = DTYPE_NAMES.get(name.lower().removeprefix("torch."))
    if dtype is None:
        raise CheckpointError(
            f"unknown dtype {name!r} to export to; one of {', '.join(sorted(DTYPE_NAMES))}"
        )
    return dtype


def _tensor_specs(
    checkpoint_id: Location, storage_options: dict[str, Any] | None
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[str]]:
    """The checkpoint's tensors (key -> dtype, shape) and its other keys."""
    reader = CheckpointReader(checkpoint_id, storage_options)
    try:
        specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        values: list[str] = []
        for key, md in reader.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                specs[key] = (md.properties.dtype, tuple(md.size))
            else:
                values.append(key)
        return specs, values
    finally:
        reader.close()


def _optimizer_groups(keys: list[str]) -> set[str]:
    """Where optimizer state sits among ``keys``: the path before a ``state`` or
    ``param_groups`` segment (``optim`` of ``optim.state.0.exp_avg``, ``train.optim`` of
    ``train.optim.state.layer.weight.exp_avg``)."""
    groups = set()
    for key in keys:
        parts = key.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i] in _OPTIMIZER_PARTS:
                groups.add(".".join(parts[:i]))
                break
    return groups


def _choose_prefix(keys: list[str], arch: Architecture | None, optimizer: set[str]) -> str:
    """The prefix of the model's weights among ``keys`` (optimizer state already left out).

    Against an architecture: the prefix (none, or up to the first three name segments)
    under which most names are the model's. Without one: the leading segments all keys
    share, then ``model.`` where a ``model`` entry sits beside optimizer state (a training
    state such as ``{"model": ..., "optim": ..., "rng": ...}``), then again the leading
    segments all keys below it share.
    """
    if arch is not None:
        known = set(arch.shapes) | set(arch.tied)
        candidates = {""}
        for key in keys:
            parts = key.split(".")
            candidates.update(".".join(parts[:n]) + "." for n in (1, 2, 3) if len(parts) > n)
        return max(
            sorted(candidates, key=len),
            key=lambda p: sum(k[len(p) :] in known for k in keys if k.startswith(p)),
        )
    prefix = ""
    while True:
        rest = [k[len(prefix) :] for k in keys if k.startswith(prefix)]
        first = {r.split(".", 1)[0] for r in rest}
        if len(first) == 1 and all("." in r for r in rest):
            prefix += f"{first.pop()}."
        elif "model" in first and any(
            g.startswith(prefix) and "." not in g[len(prefix) :] for g in optimizer
        ):
            prefix += "model."
        else:
            return prefix


def _check_architecture(
    arch: Architecture,
    names: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    config: str | os.PathLike[str],
    prefix: str,
) -> None:
    """Raise, naming them, if any tensor is missing, unexpected or of another shape."""
    missing = [n for n in arch.shapes if n not in names]
    unexpected = [n for n in names if n not in arch.shapes]
    wrong = [
        f"{n!r} (checkpoint {list(names[n][1])}, {arch.name} {list(shape)})"
        for n, shape in arch.shapes.items()
        if n in names and tuple(names[n][1]) != tuple(shape)
    ]
    if missing or unexpected or wrong:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)}: {', '.join(map(repr, missing[:20]))}")
        if unexpected:
            problems.append(
                f"unexpected {len(unexpected)}: {', '.join(map(repr, unexpected[:20]))}"
            )
        if wrong:
            problems.append(f"shape mismatch {len(wrong)}: {', '.join(wrong[:20])}")
        raise CheckpointError(
            f"the checkpoint's tensors under the prefix {prefix!r} do not match {arch.name} "
            f"built from {os.fspath(config)}: {'; '.join(problems)}. Nothing was written; pick "
            "the subtree with prefix= (--prefix) or check the config"
        )


def _shards(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into shards as transformers groups them: in order, a new shard when
    the next tensor would overflow, a tensor larger than ``max_bytes`` on its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name in names:
        size = sizes[name]
        if size > max_bytes:
            shards.append([name])
            continue
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def _held_tensors(
    staged: Mapping[str, torch.Tensor],
    prefix: str,
    names: dict[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[str, torch.Tensor]:
    """The exported names that ``staged`` holds, each checked against the checkpoint."""
    held: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in names.items():
        tensor = staged.get(prefix + name)
        if tensor is None:
            continue
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape) or tensor.is_cuda:
            raise CheckpointError(
                f"staged tensor {prefix + name!r} is {tensor.dtype}{list(tensor.shape)} on "
                f"{tensor.device}; the checkpoint holds {dtype}{list(shape)} (host memory)"
            )
        held[name] = tensor
    return held


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as one safetensors file, widest dtypes first (every tensor then
    starts aligned to its dtype), under a temporary name renamed into place."""
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header = encode_header(
        [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in order], {"format": "pt"}
    )
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for name in order:
                t = tensors[name].contiguous()
                if t.numel():
                    f.write(byte_view(t))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _remove_stale(out: Path, keep: set[str]) -> None:
    for entry in out.iterdir():
        stale = entry.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(entry.name)
        if stale and entry.name not in keep and entry.is_file():
            entry.unlink()


@dataclass(frozen=True)
class _Selection:
    """The checkpoint's tensors an export writes: ``names`` (exported name -> saved dtype
    and shape) in file ``order``, under ``prefix`` in the checkpoint; ``tied`` weights
    dropped; ``specs`` and ``values`` are everything the checkpoint holds."""

    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    values: list[str]
    prefix: str
    names: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    order: list[str]
    tied: dict[str, str]


def _select(
    checkpoint_id: Location,
    storage_options: dict[str, Any] | None,
    prefix: str | None,
    arch: Architecture | None,
    config: str | os.PathLike[str] | None,
) -> _Selection:
    """The model tensors to export: optimizer state left out, the prefix found (or the one
    given) and stripped, tied weights dropped, checked against ``arch`` when given."""
    specs, values = _tensor_specs(checkpoint_id, storage_options)
    optimizer = _optimizer_groups(list(specs) + values)
    candidates = [k for k in specs if not any(k.startswith(f"{g}.") for g in optimizer)]
    if prefix is None:
        prefix = _choose_prefix(candidates, arch, optimizer)
    chosen = [k for k in candidates if k.startswith(prefix)] if prefix else candidates
    if not chosen:
        raise CheckpointError(
            f"no tensors of {checkpoint_id} are under the prefix {prefix!r}; its top-level "
            f"names: {sorted({k.split('.', 1)[0] for k in specs})}"
        )
    names = {k[len(prefix) :]: specs[k] for k in chosen}
    tied = {n: kept for n, kept in (arch.tied if arch else {}).items() if n in names}
    for name in tied:
        del names[name]
    if arch is not None and config is not None:
        _check_architecture(arch, names, config, prefix)
        order = [n for n in arch.shapes if n in names]
    else:
        order = list(names)
    return _Selection(specs, values, prefix, names, order, tied)


def _out_dtypes(sel: _Selection, cast: torch.dtype | None) -> dict[str, torch.dtype]:
    """Each exported tensor's dtype in the files: ``cast`` for floating tensors, if given."""
    out = {}
    for name in sel.order:
        saved = sel.names[name][0]
        out[name] = cast if cast is not None and saved.is_floating_point else saved
    unknown = sorted({str(d) for d in out.values() if d not in NAMES})
    if unknown:
        raise CheckpointError(f"safetensors cannot hold the dtypes {unknown}")
    return out


def _write_shards(
    checkpoint_id: Location,
    storage_options: dict[str, Any] | None,
    sel: _Selection,
    out: Path,
    files: list[str],
    shards: list[list[str]],
    dtypes: dict[str, torch.dtype],
    held: dict[str, torch.Tensor],
    progress: Progress | None,
    total: int,
) -> dict[str, str]:
    """Read (or take from ``held``), cast and write each shard in turn; the weight map."""
    done = 0
    weight_map: dict[str, str] = {}
    prefix, names = sel.prefix, sel.names
    for file, shard in zip(files, shards, strict=True):
        target = {
            prefix + n: torch.empty(names[n][1], dtype=names[n][0]) for n in shard if n not in held
        }
        if target:
            loader.load(target, checkpoint_id, strict=False, storage_options=storage_options)
        tensors = {n: (held[n] if n in held else target[prefix + n]).to(dtypes[n]) for n in shard}
        del target
        _write_file(out / file, tensors)
        for n in shard:
            weight_map[n] = file
            done += numel(names[n][1]) * dtypes[n].itemsize
            if progress is not None:
                progress(done, total)
    return weight_map


def _write_index(out: Path, sel: _Selection, total: int, weight_map: dict[str, str]) -> None:
    """``model.safetensors.index.json`` of a sharded export, as transformers writes it."""
    index = {
        "metadata": {
            "total_parameters": sum(numel(sel.names[n][1]) for n in sel.order),
            "total_size": total,
        },
        "weight_map": weight_map,
    }
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    write_atomic(out / INDEX_FILE, text.encode())


def export_hf(
    checkpoint_id: Location,
    out_dir: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    config: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    staged: Mapping[str, torch.Tensor] | None = None,
) -> HfExport:
    """Write the model weights of a checkpoint as a Hugging Face model directory.

    ``prefix``: the checkpoint keys' prefix of the model's weights (``"model."``); ``None``
    finds it (see the module docstring), ``""`` exports every tensor but optimizer state.
    ``dtype``: cast floating tensors (``"bf16"``, ``torch.float16``...). ``config``: a
    ``config.json`` copied beside the weights and, with transformers installed, checked
    against. ``progress(done, total)`` is called in bytes after each tensor.
    ``staged``: host tensors, by checkpoint key, that hold what the checkpoint holds under
    that key (the snapshot it was saved from, :func:`~..save.snapshot.stage`): they are written
    as they are instead of read back; any key missing from it is read from the checkpoint.
    """
    max_bytes = parse_size(max_shard_size)
    if max_bytes <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {max_shard_size!r}")
    cast = parse_dtype(dtype) if dtype is not None else None
    arch = architecture(config) if config is not None else None
    sel = _select(checkpoint_id, storage_options, prefix, arch, config)
    dtypes = _out_dtypes(sel, cast)
    sizes = {n: numel(sel.names[n][1]) * dtypes[n].itemsize for n in sel.order}
    shards = _shards(sel.order, sizes, max_bytes)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
    )
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the output directory {out}: {exc}") from exc
    total = sum(sizes.values())
    held = _held_tensors(staged or {}, sel.prefix, sel.names)
    weight_map = _write_shards(
        checkpoint_id, storage_options, sel, out, files, shards, dtypes, held, progress, total
    )
    if len(files) > 1:
        _write_index(out, sel, total, weight_map)
    _remove_stale(out, set(files) | ({INDEX_FILE} if len(files) > 1 else set()))
    if config is not None and not (out / "config.json").resolve() == Path(config).resolve():
        shutil.copyfile(config, out / "config.json")
    exported = {sel.prefix + n for n in sel.names} | {sel.prefix + n for n in sel.tied}
    skipped = [k for k in sel.specs if k not in exported] + sel.values
    return HfExport(
        os.fspath(out),
        files,
        sel.prefix,
        weight_map,
        total,
        sel.tied,
        skipped,
        arch.name if arch else None,
    )
