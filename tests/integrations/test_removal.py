"""Rotated-out checkpoints leave their name at once and are deleted off the caller's thread."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from slipstream.errors import CheckpointError
from slipstream.integrations import removal
from slipstream.integrations.removal import Remover, is_being_removed


def _checkpoint(path) -> None:
    os.makedirs(path / "sub")
    (path / "sub" / "data.bin").write_bytes(b"x" * 4096)
    (path / ".metadata").write_bytes(b"m")


def test_the_name_is_free_on_return_and_the_files_go_in_the_background(tmp_path, monkeypatch):
    release = threading.Event()
    started = threading.Event()
    delete = removal._delete

    def held_delete(hidden: str) -> None:
        started.set()
        assert release.wait(10)
        delete(hidden)

    monkeypatch.setattr(removal, "_delete", held_delete)
    _checkpoint(tmp_path / "epoch=1.ckpt")
    remover = Remover()
    remover.remove(str(tmp_path / "epoch=1.ckpt"))
    assert started.wait(10)
    names = os.listdir(tmp_path)
    assert "epoch=1.ckpt" not in names
    assert len(names) == 1 and is_being_removed(names[0]), names
    assert not names[0].endswith(".ckpt")
    release.set()
    remover.wait(10)
    assert os.listdir(tmp_path) == []
    (tmp_path / "last.ckpt").write_bytes(b"file")  # a file, and a second round on a new thread
    remover.remove(str(tmp_path / "last.ckpt"))
    remover.wait(10)
    assert os.listdir(tmp_path) == []


def test_a_wait_that_runs_out_names_what_is_still_being_deleted(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(removal, "_delete", lambda hidden: release.wait(10))
    _checkpoint(tmp_path / "step=4.ckpt")
    remover = Remover()
    remover.remove(str(tmp_path / "step=4.ckpt"))
    with pytest.raises(CheckpointError, match="step=4.ckpt.removing-"):
        remover.wait(0.05)
    release.set()
    remover.wait(10)


def test_a_failed_deletion_is_logged_with_the_hidden_path(tmp_path, monkeypatch, caplog):
    def refuse(path, *args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(removal.shutil, "rmtree", refuse)
    _checkpoint(tmp_path / "epoch=2.ckpt")
    remover = Remover()
    with caplog.at_level(logging.ERROR, logger="slipstream.integrations.removal"):
        remover.remove(str(tmp_path / "epoch=2.ckpt"))
        remover.wait(10)
    (hidden,) = os.listdir(tmp_path)
    assert is_being_removed(hidden)
    assert hidden in caplog.text and "read-only" in caplog.text


def test_a_missing_path_is_an_error_at_the_call(tmp_path):
    with pytest.raises(FileNotFoundError):
        Remover().remove(str(tmp_path / "absent.ckpt"))


def test_a_sweep_removes_what_a_killed_run_left_and_nothing_else(tmp_path, caplog):
    committed = tmp_path / "epoch=1.ckpt"
    _checkpoint(committed)
    (committed / ".metadata.tmp").write_bytes(b"cut short")
    (tmp_path / ".epoch=0.ckpt.removing-1234abcd" / "sub").mkdir(parents=True)
    (tmp_path / ".last.ckpt.saving-1234abcd").write_bytes(b"half a torch.save")
    user = tmp_path / "notes.ckpt"  # a directory of the user's, not a save's files
    user.mkdir()
    (user / "readme.txt").write_text("mine")
    (tmp_path / "mine.tmp").write_text("mine")
    (tmp_path / "logs").mkdir()
    with caplog.at_level(logging.WARNING, logger=removal.__name__):
        removed = removal.sweep(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt", "logs", "mine.tmp", "notes.ckpt"]
    assert sorted(os.listdir(committed)) == [".metadata", "sub"]
    assert len(removed) == 3
    assert len([r for r in caplog.records if "earlier run" in r.getMessage()]) == 1
    assert removal.sweep(str(tmp_path)) == []
