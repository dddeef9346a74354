"""DCP tensor records: the bytes ``torch.save`` would write, without serializing the data.

A DCP data file is a run of records; a tensor record is a complete ``torch.save`` zip
archive of one compact CPU tensor, stored uncompressed with its data 64-byte aligned.
For a given dtype and shape every byte of that archive except the tensor's own data is
fixed, so :func:`tensor_frame` computes the bytes around the data once (via torch's own
writer with ``skip_data``) and the writer then emits ``prefix + raw bytes + suffix``
straight from the staging buffer: no serialized copy of tensor bytes is ever made.

:func:`locate_tensor_data` does the reverse for records written by anyone (``dcp.save``
included): it walks the zip's local headers to find where the raw bytes start, and
reads the record's small pickle, through an allow-list, to learn the tensor's layout.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ...errors import CorruptCheckpointError, UnsafeCheckpointError

_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_BYTES = 30


@dataclass(frozen=True)
class RecordFrame:
    """The constant bytes of one tensor record: ``prefix + <nbytes of data> + suffix``."""

    prefix: bytes
    suffix: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)

    @property
    def data_offset(self) -> int:
        return len(self.prefix)


class _FrameRecorder:
    """A write-only stream that keeps every byte written and notes the one skipped gap."""

    def __init__(self) -> None:
        self.pos = 0
        self.pieces: list[tuple[int, bytes]] = []
        self.gaps: list[tuple[int, int]] = []

    def write(self, data: bytes | bytearray | memoryview) -> int:
        chunk = bytes(data)
        self.pieces.append((self.pos, chunk))
        self.pos += len(chunk)
        return len(chunk)

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.pos + offset
        if target > self.pos:
            self.gaps.append((self.pos, target - self.pos))
        self.pos = target
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=1 << 16)
def tensor_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordFrame:
    """The record frame of a compact CPU tensor of ``dtype`` and ``shape`` (cached)."""
    probe = torch.empty(shape, dtype=dtype)
    nbytes = probe.numel() * probe.element_size()
    sink = _FrameRecorder()
    with torch.serialization.skip_data():
        torch.save(probe, sink)  # type: ignore[arg-type]  # any writable, seekable object works
    head = b"".join(chunk for pos, chunk in sink.pieces if pos < _gap_start(sink, nbytes))
    tail = b"".join(chunk for pos, chunk in sink.pieces if pos >= _gap_start(sink, nbytes))
    return RecordFrame(prefix=head, suffix=tail, nbytes=nbytes)


def _gap_start(sink: _FrameRecorder, nbytes: int) -> int:
    if nbytes == 0:
        if sink.gaps:
            raise AssertionError("torch.save skipped bytes of an empty tensor")
        return _empty_data_offset(sink)
    if len(sink.gaps) != 1 or sink.gaps[0][1] != nbytes:
        raise AssertionError(f"unexpected torch.save layout: gaps {sink.gaps} for {nbytes} bytes")
    return sink.gaps[0][0]


def _empty_data_offset(sink: _FrameRecorder) -> int:
    """For an empty tensor the data entry has no bytes: split right after its header."""
    blob = b"".join(chunk for _, chunk in sink.pieces)
    entries = _central_directory(blob, len(blob), "<tensor frame>")
    return _entry_data_offset(blob, entries["data/0"][0], "<tensor frame>")


def _central_directory(tail: bytes, record_length: int, where: str) -> dict[str, tuple[int, int]]:
    """Map entry name (without the archive folder) -> (local header offset, size).

    ``tail`` is the last bytes of a record of ``record_length`` bytes; offsets are from the
    record's start.
    """
    base = record_length - len(tail)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise CorruptCheckpointError(f"{where}: tensor record has no zip directory (truncated?)")
    entries_count, cd_size, cd_offset = struct.unpack_from("<HII", tail, eocd + 10)
    if cd_offset == 0xFFFFFFFF or entries_count == 0xFFFF:
        loc = tail.rfind(b"PK\x06\x07", 0, eocd)
        if loc < 0:
            raise CorruptCheckpointError(f"{where}: zip64 directory locator missing")
        (z64_eocd,) = struct.unpack_from("<Q", tail, loc + 8)
        rel = z64_eocd - base
        entries_count, cd_size, cd_offset = struct.unpack_from("<QQQ", tail, rel + 32)
    rel = cd_offset - base
    if rel < 0:
        raise CorruptCheckpointError(f"{where}: zip directory starts before the bytes read")
    found: dict[str, tuple[int, int]] = {}
    for _ in range(entries_count):
        if tail[rel : rel + 4] != b"PK\x01\x02":
            raise CorruptCheckpointError(f"{where}: damaged zip directory")
        comp_size, _, name_len, extra_len, comment_len = struct.unpack_from(
            "<IIHHH", tail, rel + 20
        )
        (header_offset,) = struct.unpack_from("<I", tail, rel + 42)
        name = tail[rel + 46 : rel + 46 + name_len].decode("utf-8", "replace")
        extra = tail[rel + 46 + name_len : rel + 46 + name_len + extra_len]
        if 0xFFFFFFFF in (comp_size, header_offset):
            comp_size, header_offset = _zip64_fields(extra, comp_size, header_offset)
        found[name.split("/", 1)[-1]] = (header_offset, comp_size)
        rel += 46 + name_len + extra_len + comment_len
    return found


def _zip64_fields(extra: bytes, comp_size: int, header_offset: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            # Order: uncompressed size, compressed size, local header offset (each if 0xFFFFFFFF).
            if comp_size == 0xFFFFFFFF:
                values.pop(0)
                comp_size = values.pop(0)
            if header_offset == 0xFFFFFFFF:
                header_offset = values.pop(0)
            return comp_size, header_offset
        pos += 4 + size
    raise CorruptCheckpointError("zip64 fields missing from a tensor record")


def _entry_data_offset(head: bytes, header_offset: int, where: str) -> int:
    if head[header_offset : header_offset + 4] != _LOCAL_HEADER:
        raise CorruptCheckpointError(f"{where}: damaged zip entry header at {header_offset}")
    name_len, extra_len = struct.unpack_from("<HH", head, header_offset + 26)
    offset: int = header_offset + _LOCAL_HEADER_BYTES + name_len + extra_len
    return offset


@dataclass(frozen=True)
class TensorLayout:
    """Where a saved tensor's elements sit inside its record's raw data."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int  # from the start of the record

    @property
    def is_compact(self) -> bool:
        """True when the data is exactly the tensor in row-major order."""
        expected = 1
        for dim, stride in zip(reversed(self.size), reversed(self.stride), strict=True):
            if dim != 1 and stride != expected:
                return False
            expected *= dim
        return self.storage_offset == 0


class _StorageRef:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _storage_dtype(storage_type: object) -> torch.dtype:
    if not isinstance(storage_type, str):
        return torch.uint8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtype: torch.dtype = getattr(torch, storage_type).dtype
        return dtype


def _rebuild_layout(
    storage: _StorageRef,
    storage_offset: int,
    size: Iterable[int],
    stride: Iterable[int],
    *_rest: object,
) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]:
    return (storage.dtype, tuple(size), tuple(stride), int(storage_offset))


class _RecordPickleReader(pickle.Unpickler):
    """Reads a tensor record's ``data.pkl`` into a layout tuple; refuses everything else."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_layout
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"tensor record refers to {module}.{name}, which is not allowed"
        )

    def persistent_load(self, pid: object) -> _StorageRef:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise CorruptCheckpointError(f"unexpected persistent id in tensor record: {pid!r}")
        return _StorageRef(_storage_dtype(pid[1]))


def locate_tensor_data(
    read: Callable[[int, int], bytes], record_length: int, where: str
) -> TensorLayout:
    """Find a tensor record's layout and raw data offset without deserializing it.

    ``read(offset, n)`` returns ``n`` bytes of the record from ``offset`` (record-relative).
    """
    tail_len = min(record_length, 64 * 1024)
    tail = read(record_length - tail_len, tail_len)
    entries = _central_directory(tail, record_length, where)
    if "data.pkl" not in entries or "data/0" not in entries:
        raise CorruptCheckpointError(f"{where}: record is not a single-tensor torch.save archive")
    pkl_header, pkl_size = entries["data.pkl"]
    data_header, _ = entries["data/0"]
    head = read(0, max(data_header, pkl_header) + 1024)
    pkl_start = _entry_data_offset(head, pkl_header, where)
    pkl = (
        read(pkl_start, pkl_size)
        if pkl_start + pkl_size > len(head)
        else head[pkl_start : pkl_start + pkl_size]
    )
    try:
        dtype, size, stride, storage_offset = _RecordPickleReader(io.BytesIO(pkl)).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: unreadable tensor record header ({exc})") from exc
    data_offset = _entry_data_offset(head, data_header, where)
    return TensorLayout(dtype, size, stride, storage_offset, data_offset)
