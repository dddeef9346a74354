"""The safetensors header: parsed as the safetensors library writes it, refused when bad."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save

from slipstream.checkpoint.hf.safetensors_format import encode_header, header_length, parse_header
from slipstream.errors import CorruptCheckpointError

TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.tensor([1, 2, 3], dtype=torch.int64),
    "c": torch.ones(2, 2, dtype=torch.bfloat16),
    "empty": torch.zeros(0, 5),
}


def _parse(data: bytes):
    n = header_length(data[:8], "f")
    return parse_header(data[8 : 8 + n], "f", len(data), "f")


def test_offsets_of_a_file_written_by_safetensors_point_at_each_tensor():
    data = save(TENSORS, metadata={"format": "pt"})
    for name, entry in _parse(data).items():
        want = TENSORS[name]
        assert entry.dtype == want.dtype and entry.shape == tuple(want.shape)
        raw = bytearray(data[entry.data_offset : entry.data_offset + entry.nbytes])
        assert len(raw) == want.numel() * want.dtype.itemsize
        got = torch.tensor(list(raw), dtype=torch.uint8).view(want.dtype).reshape(want.shape)
        assert torch.equal(got, want), name


def test_encoded_header_reads_back_in_safetensors():
    from safetensors.torch import load

    order = sorted(TENSORS, key=lambda n: (-TENSORS[n].dtype.itemsize, n))
    header = encode_header([(n, TENSORS[n].dtype, tuple(TENSORS[n].shape)) for n in order], {})
    body = b"".join(TENSORS[n].contiguous().view(torch.uint8).numpy().tobytes() for n in order)
    assert len(header) % 8 == 0
    loaded = load(header + body)
    for name, value in TENSORS.items():
        assert torch.equal(loaded[name], value), name


def _file(table: dict, body: int) -> bytes:
    text = json.dumps(table).encode()
    return struct.pack("<Q", len(text)) + text + bytes(body)


@pytest.mark.parametrize(
    "table, body, message",
    [
        ({"x": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, 8, "dtype 'F33'"),
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "needs 12 bytes"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4, "truncated"),
        ({"x": {"dtype": "F32", "shape": "two", "data_offsets": [0, 8]}}, 8, "no valid dtype"),
        ({"x": {"dtype": "F32", "shape": [2]}}, 8, "no valid dtype"),
    ],
)
def test_bad_headers_name_the_tensor(table, body, message):
    with pytest.raises(CorruptCheckpointError, match=message):
        _parse(_file(table, body))


def test_a_header_length_past_the_limit_is_refused():
    with pytest.raises(CorruptCheckpointError, match="not a safetensors file"):
        header_length(struct.pack("<Q", 2**40), "f")
    with pytest.raises(CorruptCheckpointError, match="fewer than the 8"):
        header_length(b"abc", "f")
