"""The safetensors file format and the Hugging Face layout of a directory of them.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON,
then the tensors' raw bytes. The JSON maps each tensor name to its ``dtype`` (``"F32"``,
``"BF16"``...), ``shape`` and ``data_offsets`` ``[begin, end)`` counted from the first byte
after the header; the optional ``__metadata__`` entry holds strings. Tensors are
row-major and little-endian, so a tensor's bytes (or any row-major box of it) can be read
straight into a tensor's memory.

A Hugging Face model directory holds either one ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).

Invariant: :func:`parse_header` returns only entries whose bytes lie inside the file and
whose byte count equals their shape times their dtype's size; anything else raises
:class:`~slipstream.CorruptCheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ...core.shapes import numel
from ...errors import CorruptCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The safetensors library refuses headers larger than this; so does this reader."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_offset: int
    """Offset of the tensor's first byte in the file (past the header)."""
    nbytes: int


def shard_file_name(index: int, count: int) -> str:
    """The name transformers gives shard ``index`` (from 1) of ``count``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def header_length(prefix: bytes, path: str) -> int:
    """The JSON header's length from a file's first 8 bytes."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            f"{path} is not a safetensors file: {len(prefix)} bytes, fewer than the 8 of the "
            "header length"
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{path} is not a safetensors file: its header claims {length} bytes "
            f"(at most {MAX_HEADER_BYTES})"
        )
    return int(length)


def parse_header(
    header: bytes, file: str, file_size: int, path: str
) -> dict[str, SafetensorsEntry]:
    """The tensors of the file ``file`` (of ``file_size`` bytes, at ``path`` for messages)
    whose JSON header is ``header``; see the module docstring for what is checked."""
    try:
        table: dict[str, Any] = json.loads(header)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: the safetensors header is not JSON ({exc})") from exc
    if not isinstance(table, dict):
        raise CorruptCheckpointError(f"{path}: the safetensors header is not a JSON object")
    base = 8 + len(header)
    entries: dict[str, SafetensorsEntry] = {}
    for name, info in table.items():
        if name == "__metadata__":
            continue
        try:
            code, (begin, end) = info["dtype"], (int(x) for x in info["data_offsets"])
            shape = tuple(int(s) for s in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has no valid dtype, shape or data_offsets in the header"
            ) from exc
        dtype = DTYPES.get(code)
        if dtype is None:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has dtype {code!r}, which this reader does not know "
                f"(known: {', '.join(DTYPES)})"
            )
        nbytes = numel(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} of shape {list(shape)} and dtype {code} needs "
                f"{nbytes} bytes, but its data_offsets are [{begin}, {end})"
            )
        if base + end > file_size:
            raise CorruptCheckpointError(
                f"{path} is truncated: {file_size} bytes, but tensor {name!r} ends at byte "
                f"{base + end}"
            )
        entries[name] = SafetensorsEntry(file, dtype, shape, base + begin, nbytes)
    return entries


def encode_header(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> bytes:
    """The header (length and JSON, padded with spaces to 8 bytes as the safetensors
    library pads it) of a file holding ``tensors`` back to back, in order."""
    table: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = numel(shape) * dtype.itemsize
        table[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
