"""The data-file writer: direct and buffered paths, and the record format."""

import io
from collections import Counter

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fault_storage import FaultStorage

from slipstream.checkpoint import CheckpointSaver, SaveOptions
from slipstream.checkpoint.format.records import locate_tensor_data, tensor_frame
from slipstream.checkpoint.storage import LocalStorage


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(300_000, generator=g),
        "odd": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "ints": torch.arange(12345),
        "step": 9,
    }


def _save_with(state: dict, root, variants: dict[str, SaveOptions]) -> None:
    """Save ``state`` once per named options, each into ``root / name``."""
    for name, options in variants.items():
        saver = CheckpointSaver(options=options)
        try:
            saver.save(state, root / name).upload_completion.result(30)
        finally:
            saver.close()


def test_direct_and_buffered_writes_produce_identical_files(tmp_path):
    state = _state()
    variants = {"direct": SaveOptions(direct_io=True), "buffered": SaveOptions(direct_io=False)}
    _save_with(state, tmp_path, variants)
    direct_bytes = (tmp_path / "direct" / "__0_0.distcp").read_bytes()
    buffered_bytes = (tmp_path / "buffered" / "__0_0.distcp").read_bytes()
    assert direct_bytes == buffered_bytes
    loaded = {"big": torch.zeros(300_000), "odd": torch.zeros(7, 13, dtype=torch.bfloat16)}
    loaded.update({"ints": torch.zeros(12345, dtype=torch.int64), "step": 0})
    dcp.load(loaded, checkpoint_id=str(tmp_path / "direct"), no_dist=True)
    for key in ("big", "odd", "ints"):
        assert torch.equal(loaded[key], state[key]), key
    assert loaded["step"] == 9


def test_tensor_frame_is_what_torch_save_writes_around_the_data():
    t = torch.randn(5, 6, dtype=torch.float64)
    frame = tensor_frame(t.dtype, tuple(t.shape))
    record = frame.prefix + bytes(t.view(-1).view(torch.uint8).tolist()) + frame.suffix
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), t)
    buf = io.BytesIO()
    torch.save(t, buf)
    written = buf.getvalue()
    assert len(written) == frame.length
    layout = locate_tensor_data(lambda o, n: written[o : o + n], len(written), "torch.save")
    assert layout.data_offset == frame.data_offset
    assert layout.size == (5, 6) and layout.dtype == torch.float64 and layout.is_compact


def test_staging_split_over_two_threads_writes_the_same_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(9)}
    variants = {"split": SaveOptions(split_copy=True), "single": SaveOptions(split_copy=False)}
    _save_with(state, tmp_path, variants)
    split_bytes = (tmp_path / "split" / "__0_0.distcp").read_bytes()
    assert split_bytes == (tmp_path / "single" / "__0_0.distcp").read_bytes()
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "split"), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("piece_bytes", [64 * 1024, 256 * 1024])
def test_a_data_file_is_written_in_pieces_of_write_piece_bytes(tmp_path, piece_bytes):
    state = {"big": torch.randn(256 * 1024)}  # 1 MiB of data, plus the record's framing
    storage = FaultStorage(LocalStorage(tmp_path / "ck", direct_io=False))
    pieces: list[tuple[int, int]] = []
    storage.faults.hook("write", lambda writer, name, start, end: pieces.append((start, end)))
    saver = CheckpointSaver(options=SaveOptions(write_piece_bytes=piece_bytes))
    try:
        saver.save(state, storage).result(60)
    finally:
        saver.close()
    pieces.sort()
    assert pieces[0][0] == 0 and all(
        a[1] == b[0] for a, b in zip(pieces[:-1], pieces[1:], strict=True)
    )
    lengths = Counter(end - start for start, end in pieces[:-1])
    assert set(lengths) == {piece_bytes} and pieces[-1][1] - pieces[-1][0] <= piece_bytes
    loaded = {"big": torch.zeros(256 * 1024)}
    dcp.load(loaded, checkpoint_id=tmp_path / "ck")
    assert torch.equal(loaded["big"], state["big"])


@pytest.mark.parametrize("bad", [0, -4096, 100, 4096 + 1])
def test_write_piece_bytes_must_be_a_positive_multiple_of_the_page(bad):
    with pytest.raises(ValueError, match=f"write_piece_bytes={bad}: must be a positive multiple"):
        SaveOptions(write_piece_bytes=bad)
