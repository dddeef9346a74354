"""Checkpointer(reuse_files=True): the next save writes over a retired step's data files,
never over one that a reader still holds open, and loads match DCP's reading of them."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from checkpoint_states import step_state

import slipstream as ss

DATA = "__0_0.distcp"


def _saved(ck: ss.Checkpointer, step: int, rows: int) -> None:
    ck.save(step, step_state(step, (rows, 64))).result(60)


def _dcp_read(path, rows: int) -> dict:
    target = step_state(-1, (rows, 64))
    dcp.load(target, checkpoint_id=str(path))
    return target


def test_next_save_writes_over_the_retired_steps_data_file(tmp_path):
    with ss.Checkpointer(tmp_path, keep_last=1) as ck:
        _saved(ck, 1, rows=4096)
        _saved(ck, 2, rows=4096)
        spare = tmp_path / ".spare" / DATA
        retired_inode = os.stat(spare).st_ino
        # A smaller state than the retired file held: the file must be cut to its new end.
        _saved(ck, 3, rows=1000)
        step_3_data = Path(ck.path(3)) / DATA
        assert os.stat(step_3_data).st_ino == retired_inode
        # Step 3's commit retired step 2, whose file is the spare now.
        assert os.stat(spare).st_ino not in (retired_inode, os.stat(step_3_data).st_ino)
        got = _dcp_read(ck.path(3), rows=1000)
        assert torch.equal(got["w"], step_state(3, (1000, 64))["w"]) and got["step"] == 3
        target = step_state(-1, (1000, 64))
        assert ck.load(target) == 3 and torch.equal(target["w"], step_state(3, (1000, 64))["w"])
        fresh = tmp_path / "fresh"
        ss.save(step_state(3, (1000, 64)), checkpoint_id=fresh)
        assert step_3_data.read_bytes() == (fresh / DATA).read_bytes()
    assert not (tmp_path / ".spare").exists()


def test_a_retired_file_a_reader_holds_open_is_deleted_not_written_over(tmp_path):
    with ss.Checkpointer(tmp_path, keep_last=1) as ck:
        _saved(ck, 1, rows=2048)
        with open(Path(ck.path(1)) / DATA, "rb") as reader:
            before = reader.read()
            held_inode = os.fstat(reader.fileno()).st_ino
            for step in (2, 3, 4):
                _saved(ck, step, rows=2048)
            reader.seek(0)
            assert reader.read() == before
        assert os.stat(Path(ck.path(4)) / DATA).st_ino != held_inode
        assert ck.steps() == [4]


def test_retirement_goes_on_when_a_save_claims_a_spare_while_it_is_checked(tmp_path, monkeypatch):
    """A replica received on the peer link's thread may claim a spare the moment retirement
    moves it there: retirement neither fails nor deletes the claimed file, and still moves
    the step's other files and removes the step (the race the two-tier benchmark hit)."""
    from slipstream.checkpoint.storage import recycle

    step, spares = tmp_path / "step_1", tmp_path / ".spare"
    step.mkdir()
    for rank in (0, 1):
        (step / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 4096)
    claimed = tmp_path / "step_3" / "__0_0.distcp"
    claimed.parent.mkdir()
    checked = recycle._open_nowhere_else

    def claimed_meanwhile(path: Path) -> bool:
        if path.name == "__0_0.distcp":
            recycle.claim(spares, path.name, str(claimed))
        return checked(path)

    monkeypatch.setattr(recycle, "_open_nowhere_else", claimed_meanwhile)
    recycle.retire(step, spares)
    assert not step.exists()
    assert claimed.read_bytes() == bytes([0]) * 4096
    assert not (spares / "__0_0.distcp").exists()
    assert (spares / "__1_0.distcp").read_bytes() == bytes([1]) * 4096
