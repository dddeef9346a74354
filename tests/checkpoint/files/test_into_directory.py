"""files_into: a new (or empty) directory appears whole under its name; into one that holds
files, each file lands whole over its name and the others stay; a failure leaves the
target as it was and no hidden directory behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream.checkpoint.files.into_directory import files_into


def _write(directory: str, names: dict[str, str]) -> None:
    for name, text in names.items():
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        Path(directory, name).write_text(text)


def test_a_new_directory_appears_only_once_complete(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with files_into(target) as hidden:
        _write(hidden, {"a.bin": "a", "sub/b.bin": "b"})
        assert not target.exists()
        assert os.path.basename(hidden).startswith(".ckpt.saving-")
    assert sorted(os.listdir(target)) == ["a.bin", "sub"]
    assert (target / "sub" / "b.bin").read_text() == "b"
    assert os.listdir(tmp_path) == ["ckpt"]


def test_an_empty_directory_is_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    with files_into(target) as hidden:
        _write(hidden, {"a.bin": "a"})
    assert os.listdir(target) == ["a.bin"]
    assert os.listdir(tmp_path) == ["ckpt"]


def test_into_a_directory_with_files_the_others_stay(tmp_path: Path) -> None:
    target = tmp_path / "out"
    _write(str(target), {"notes.txt": "mine", "a.bin": "old", "sub/keep.txt": "k"})
    with files_into(target) as hidden:
        _write(hidden, {"a.bin": "new", "sub/b.bin": "b"})
        assert (target / "a.bin").read_text() == "old"
    assert (target / "a.bin").read_text() == "new"
    assert (target / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(target / "sub")) == ["b.bin", "keep.txt"]
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("existing", [False, True], ids=["new", "with files"])
def test_a_failure_leaves_the_target_as_it_was(tmp_path: Path, existing: bool) -> None:
    target = tmp_path / "out"
    if existing:
        _write(str(target), {"a.bin": "old"})
    with pytest.raises(RuntimeError, match="mid-write"), files_into(target) as hidden:
        _write(hidden, {"a.bin": "new"})
        raise RuntimeError("mid-write")
    assert os.listdir(tmp_path) == (["out"] if existing else [])
    if existing:
        assert (target / "a.bin").read_text() == "old"
