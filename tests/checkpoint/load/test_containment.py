"""Loads stay inside the checkpoint, and in an indexed checkpoint read nothing unverified.

Hostile checkpoints are made the way an attacker would: a real checkpoint (written by
slipstream, or by DCP itself) whose ``.metadata`` (a pickle of DCP's ``Metadata``, rewritten
with torch's own classes) or slipstream index is edited afterwards. A control shows that
DCP's own loader follows such a path out of the checkpoint; slipstream refuses it, naming
it, on the local disk, ``memory://`` and S3 (moto) alike, and leaves the target untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import uuid
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import slipstream as ss
from slipstream.checkpoint.format.names import METADATA_FILE
from slipstream.checkpoint.load.contents import verify
from slipstream.checkpoint.storage import Storage, resolve_storage
from slipstream.errors import CorruptCheckpointError

INDEX_FILE = ".slipstream.json"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def _blank() -> dict:
    return {"w": torch.zeros(32, 16), "b": torch.zeros(8), "step": -1}


def _assert_untouched(target: dict) -> None:
    blank = _blank()
    assert target["step"] == -1
    assert torch.equal(target["w"], blank["w"]) and torch.equal(target["b"], blank["b"])


def _edit_metadata(storage: Storage, edit: Callable[[Metadata], None]) -> None:
    data = storage.get(METADATA_FILE)
    assert data is not None
    metadata = pickle.loads(data)
    assert isinstance(metadata, Metadata)
    edit(metadata)
    storage.put_atomic(METADATA_FILE, pickle.dumps(metadata))


def _point(fqn: str, relative_path: str, **changes: int) -> Callable[[Metadata], None]:
    """An edit that moves every storage entry of ``fqn`` to ``relative_path``."""

    def edit(metadata: Metadata) -> None:
        for index, info in list(metadata.storage_data.items()):
            if index.fqn == fqn:
                moved = dataclasses.replace(info, relative_path=relative_path, **changes)
                metadata.storage_data[index] = moved

    return edit


def _dcp_save(state: dict, directory: str) -> None:
    dcp.save(state, checkpoint_id=directory, no_dist=True)


def _write(kind: str, state: dict, directory: str) -> None:
    if kind == "slipstream":
        ss.save(state, directory)
    else:
        _dcp_save(state, directory)


OUTSIDE_NAMES = [
    "../secret.distcp",
    "sub/../../secret.distcp",
    "s3://another-bucket/secret.distcp",
    "file:///etc/hostname",
    "C:secret.distcp",
]


# -- the local disk --------------------------------------------------------------------


def test_control_dcp_itself_reads_a_file_outside_the_checkpoint(tmp_path):
    """What the refusal prevents: DCP follows ``../secret.distcp`` out of the checkpoint
    and loads another checkpoint's bytes into the caller's tensors."""
    _dcp_save(_state(1), str(tmp_path / "ck"))
    _dcp_save(_state(666), str(tmp_path / "other"))
    shutil.copy(tmp_path / "other" / "__0_0.distcp", tmp_path / "secret.distcp")
    storage = resolve_storage(str(tmp_path / "ck"))
    _edit_metadata(storage, _point("w", "../secret.distcp"))
    target = {"w": torch.zeros(32, 16)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(target["w"], _state(666)["w"])


@pytest.mark.parametrize("writer", ["slipstream", "dcp"])
@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_a_metadata_path_outside_the_checkpoint_is_refused_naming_it(tmp_path, writer, name):
    directory = str(tmp_path / "ck")
    _write(writer, _state(1), directory)
    _dcp_save(_state(666), str(tmp_path / "other"))
    shutil.copy(tmp_path / "other" / "__0_0.distcp", tmp_path / "secret.distcp")
    _edit_metadata(resolve_storage(directory), _point("w", name))
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="not inside the checkpoint") as caught:
        ss.load(target, directory)
    assert repr(name) in str(caught.value) and "'w'" in str(caught.value)
    _assert_untouched(target)


def test_an_absolute_metadata_path_is_refused(tmp_path):
    _dcp_save(_state(1), str(tmp_path / "ck"))
    _dcp_save(_state(666), str(tmp_path / "other"))
    secret = str(tmp_path / "other" / "__0_0.distcp")
    _edit_metadata(resolve_storage(str(tmp_path / "ck")), _point("b", secret))
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="absolute path") as caught:
        ss.load(target, tmp_path / "ck")
    assert repr(secret) in str(caught.value)
    _assert_untouched(target)
    with pytest.raises(CorruptCheckpointError, match="absolute path"):
        verify(tmp_path / "ck")


def test_an_index_path_outside_the_checkpoint_is_refused_naming_it(tmp_path):
    directory = tmp_path / "ck"
    ss.save(_state(1), directory)
    index = json.loads((directory / INDEX_FILE).read_text())
    index["records"]["../secret.distcp"] = index["records"].pop("__0_0.distcp")
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="not inside the checkpoint") as caught:
        ss.load(_blank(), directory)
    assert "'../secret.distcp'" in str(caught.value) and INDEX_FILE in str(caught.value)


def test_a_data_file_the_index_does_not_cover_is_refused_as_tampered(tmp_path):
    """A copy inside the checkpoint's own directory, with other bytes, that ``.metadata``
    was pointed at: the path stays inside, but slipstream's index has no checksums for
    that file, so nothing in it is read."""
    directory = tmp_path / "ck"
    ss.save(_state(1), directory)
    _dcp_save(_state(666), str(tmp_path / "other"))
    shutil.copy(tmp_path / "other" / "__0_0.distcp", directory / "__9_0.distcp")
    _edit_metadata(resolve_storage(str(directory)), _point("w", "__9_0.distcp"))
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="does not cover") as caught:
        ss.load(target, directory)
    assert "'__9_0.distcp'" in str(caught.value) and "'w'" in str(caught.value)
    _assert_untouched(target)


def test_an_entry_moved_within_an_indexed_file_is_refused(tmp_path):
    """The entry stays in an indexed file but at an offset the index has no record at:
    it would be read without checksums; it is refused instead."""
    directory = tmp_path / "ck"
    ss.save(_state(1), directory)
    metadata = pickle.loads((directory / METADATA_FILE).read_bytes())
    info = metadata.storage_data[MetadataIndex("w", torch.Size([0, 0]))]
    moved = _point("w", info.relative_path, offset=info.offset + 64)
    _edit_metadata(resolve_storage(str(directory)), moved)
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="no checksums") as caught:
        ss.load(target, directory)
    assert "'w@0,0'" in str(caught.value)
    _assert_untouched(target)


def test_a_value_moved_within_an_indexed_file_is_refused(tmp_path):
    directory = tmp_path / "ck"
    ss.save(_state(1), directory)
    metadata = pickle.loads((directory / METADATA_FILE).read_bytes())
    info = metadata.storage_data[MetadataIndex("step")]
    moved = _point("step", info.relative_path, offset=info.offset - 8, length=info.length + 8)
    _edit_metadata(resolve_storage(str(directory)), moved)
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="the value 'step'"):
        ss.load(target, directory)
    assert target["step"] == -1


def test_untampered_checkpoints_of_both_writers_still_load(tmp_path):
    for writer in ("slipstream", "dcp"):
        directory = str(tmp_path / writer)
        _write(writer, _state(5), directory)
        target = _blank()
        ss.load(target, directory)
        want = _state(5)
        assert target["step"] == 5
        assert torch.equal(target["w"], want["w"]) and torch.equal(target["b"], want["b"])


# -- object storage ---------------------------------------------------------------------


def _object_location(kind: str, request) -> str:
    if kind == "memory":
        return f"memory://contain-{uuid.uuid4().hex[:8]}/run/ck"
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run/ck"


@pytest.mark.parametrize("kind", ["memory", "s3"])
@pytest.mark.parametrize(
    "name", ["../other/__0_0.distcp", "/run/other/__0_0.distcp", "s3://another-bucket/x"]
)
def test_object_storage_refuses_a_path_outside_the_prefix(request, kind, name):
    url = _object_location(kind, request)
    ss.save(_state(1), url)
    other = url.rsplit("/", 1)[0] + "/other"
    ss.save(_state(666), other)  # a real object that '../other/...' would reach
    storage = resolve_storage(url)
    _edit_metadata(storage, _point("w", name))
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="not inside the checkpoint") as caught:
        ss.load(target, url)
    assert repr(name) in str(caught.value) and url in str(caught.value)
    _assert_untouched(target)


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_object_storage_refuses_an_object_the_index_does_not_cover(request, kind):
    url = _object_location(kind, request)
    ss.save(_state(1), url)
    storage = resolve_storage(url)
    data = storage.get("__0_0.distcp")
    assert data is not None
    storage.put_atomic("__7_0.distcp", data)  # same bytes: only the index can tell
    _edit_metadata(storage, _point("b", "__7_0.distcp"))
    target = _blank()
    with pytest.raises(CorruptCheckpointError, match="does not cover"):
        ss.load(target, url)
    _assert_untouched(target)


def test_outside_names_are_refused_and_inside_names_accepted():
    from slipstream.checkpoint.format.names import outside_reason

    for name in [*OUTSIDE_NAMES, "", ".", "a//b", "/abs", "\\\\host\\share", "a\\..\\..\\b"]:
        assert outside_reason(name) is not None, name
    for name in ["__0_0.distcp", "__3_0.g2.distcp", "shard/__0_0.distcp", "model..bin"]:
        assert outside_reason(name) is None, name
    assert os.sep == "/" or outside_reason("a\\..\\b") is not None


def test_a_safetensors_index_naming_a_file_outside_the_directory_is_refused(tmp_path):
    from safetensors.torch import save_file

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    weights = {"a": torch.randn(4, 4), "b": torch.randn(3)}
    save_file({"a": weights["a"]}, str(model_dir / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.randn(3)}, str(tmp_path / "secret.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "../secret.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    target = {"a": torch.zeros(4, 4), "b": torch.zeros(3)}
    with pytest.raises(CorruptCheckpointError, match="not inside the checkpoint") as caught:
        ss.load_hf(target, model_dir)
    assert "'../secret.safetensors'" in str(caught.value)
    assert torch.equal(target["b"], torch.zeros(3))
