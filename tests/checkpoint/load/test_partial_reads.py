"""Reads of part of a record, across several checksum blocks (the resharding path)."""

import pytest
import torch

import slipstream as ss
from slipstream.checkpoint.load.reader import CheckpointReader, ReadRequest, read_all
from slipstream.core.buffers import byte_view
from slipstream.core.checksum import BLOCK_BYTES
from slipstream.errors import CorruptCheckpointError

ROWS, COLS = 1000, 1111  # about 4.2 blocks of fp32


@pytest.fixture
def saved(tmp_path):
    tensor = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    ss.save({"w": tensor}, checkpoint_id=tmp_path / "ck")
    return tmp_path / "ck", tensor


def _read_rows(path, first: int, last: int) -> torch.Tensor:
    reader = CheckpointReader(path)
    try:
        src = reader.source("w", (0, 0), (ROWS, COLS), torch.float32)
        assert src.blocks is not None and len(src.blocks) > 4
        out = torch.empty(last - first, COLS)
        start, end = first * COLS * 4, last * COLS * 4
        read_all(reader, [ReadRequest(src, "w", start, end, byte_view(out))], io_threads=1)
        return out
    finally:
        reader.close()


def test_a_row_range_that_starts_and_ends_inside_blocks_is_read_exactly(saved):
    path, tensor = saved
    first, last = 237, 761  # neither end on a block boundary
    assert (first * COLS * 4) % BLOCK_BYTES and (last * COLS * 4) % BLOCK_BYTES
    assert torch.equal(_read_rows(path, first, last), tensor[first:last])


def test_corruption_in_a_partly_read_block_is_detected(saved):
    path, _ = saved
    reader = CheckpointReader(path)
    src = reader.source("w", (0, 0), (ROWS, COLS), torch.float32)
    reader.close()
    corrupt_at = src.data_offset + 2 * BLOCK_BYTES + 12  # inside the third block
    with open(path / "__0_0.distcp", "r+b") as f:
        f.seek(corrupt_at)
        f.write(b"\xff\xff\xff\xff")
    row = (2 * BLOCK_BYTES) // (COLS * 4)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        _read_rows(path, row - 3, row + 300)
