"""``slipstream.dcp`` against what PyTorch's own DCP tests assert of DCP (read in PyTorch's
test/distributed/checkpoint: test_compatibility.py, test_file_system_checkpoint_cpu.py,
test_save_load_api.py): the same call, made through both modules, gives the same result.

- the storage writer / reader as the second positional argument, with DCP's warning;
- ``Metadata.storage_meta`` is the writer's (its ``save_id``), as ``dcp.save`` records it;
- a tensor saved in another dtype loads cast, as DCP's ``copy_`` casts it (``ss.load``
  refuses unless ``cast=True``);
- a checkpoint written through ``FileSystemWriter(_extensions=...)`` loads through
  ``FileSystemReader(_extension_registry=...)``, decoded by slipstream.
"""

from __future__ import annotations

import io
import logging
import pickle
import warnings
import zlib
from typing import IO, Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from checkpoint_states import small_state
from torch.distributed.checkpoint._extension import (
    ExtensionRegistry,
    StreamTransformExtension,
    ZStandard,
)

import slipstream as ss
import slipstream.dcp as dcp

BC_WARNING = "The argument order of {} has been changed"


def _state() -> dict[str, Any]:
    """A small state with a note that nests non-tensor values."""
    return small_state(7, shape=(32, 8), note={"lr": 0.5, "names": ["a", "b"]})


def _blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(32, 8), "b": torch.zeros(7)},
        "step": 0,
        "note": {"lr": 0.0, "names": []},
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["model"]["w"], b["model"]["w"])
        and torch.equal(a["model"]["b"], b["model"]["b"])
        and a["step"] == b["step"]
        and a["note"] == b["note"]
    )


# --- positional storage writer / reader ------------------------------------------------


@pytest.mark.parametrize("module", [torch_dcp, dcp], ids=["torch", "slipstream"])
def test_writer_and_reader_passed_positionally_work_with_dcps_warning(tmp_path, module):
    path = str(tmp_path / "ck")
    with pytest.warns(UserWarning, match=BC_WARNING.format("save")):
        metadata = module.save(_state(), torch_dcp.FileSystemWriter(path))
    assert isinstance(metadata, torch_dcp.Metadata)
    loaded = _blank()
    with pytest.warns(UserWarning, match=BC_WARNING.format("load")):
        module.load(loaded, torch_dcp.FileSystemReader(path))
    assert _equal(loaded, _state())


def test_positional_save_and_load_are_served_by_slipstream(tmp_path):
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), torch_dcp.FileSystemWriter(path))
    assert (tmp_path / "ck" / ".slipstream.json").exists(), "slipstream wrote it"
    loaded = _blank()
    torch_dcp.load(loaded, checkpoint_id=path)  # DCP reads what slipstream wrote
    assert _equal(loaded, _state())


@pytest.mark.parametrize("module", [torch_dcp, dcp], ids=["torch", "slipstream"])
def test_every_argument_by_keyword_as_dcps_docs_write_it(tmp_path, module):
    path = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no argument-order warning for keywords
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        module.save(state_dict=_state(), storage_writer=torch_dcp.FileSystemWriter(path))
        module.async_save(state_dict=_state(), checkpoint_id=str(tmp_path / "a")).result(30)
        loaded = _blank()
        module.load(state_dict=loaded, storage_reader=torch_dcp.FileSystemReader(path))
    assert _equal(loaded, _state())


def test_a_writer_given_twice_or_a_path_given_positionally_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    writer = torch_dcp.FileSystemWriter(path)
    with pytest.raises(TypeError, match=r"save\(\) got storage_writer twice"):
        dcp.save(_state(), writer, storage_writer=writer)
    with pytest.raises(TypeError, match=r"takes from 1 to 2 positional arguments but 3"):
        dcp.save(_state(), writer, writer)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"second positional argument is DCP's storage_writer"):
        dcp.save(_state(), path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"second positional argument is DCP's storage_reader"):
        dcp.load(_blank(), path)  # type: ignore[arg-type]
    assert not (tmp_path / "ck" / ".metadata").exists()


# --- storage_meta --------------------------------------------------------------------


@pytest.mark.parametrize("module", [torch_dcp, dcp], ids=["torch", "slipstream"])
def test_storage_meta_is_the_writers(tmp_path, module):
    path = str(tmp_path / "ck")
    writer = torch_dcp.FileSystemWriter(path)
    returned = module.save(_state(), storage_writer=writer)
    storage_meta = torch_dcp.FileSystemReader(path).read_metadata().storage_meta
    assert storage_meta is not None
    assert str(storage_meta.checkpoint_id) == path
    assert storage_meta.save_id == writer.save_id
    assert returned.storage_meta.save_id == writer.save_id
    assert returned.storage_meta.load_id is None


@pytest.mark.parametrize("module", [torch_dcp, dcp], ids=["torch", "slipstream"])
def test_checkpoint_id_resets_the_writer_to_a_new_save_id(tmp_path, module):
    writer = torch_dcp.FileSystemWriter(str(tmp_path / "first"))
    before = writer.save_id
    second = str(tmp_path / "second")
    module.save(_state(), checkpoint_id=second, storage_writer=writer)
    storage_meta = torch_dcp.FileSystemReader(second).read_metadata().storage_meta
    assert writer.save_id != before
    assert storage_meta.save_id == writer.save_id
    assert str(storage_meta.checkpoint_id) == second


def test_async_save_records_the_writers_storage_meta(tmp_path):
    path = str(tmp_path / "ck")
    writer = torch_dcp.FileSystemWriter(path)
    metadata = dcp.async_save(_state(), storage_writer=writer).result(30)
    assert metadata.storage_meta.save_id == writer.save_id
    on_disk = torch_dcp.FileSystemReader(path).read_metadata().storage_meta
    assert on_disk.save_id == writer.save_id
    loaded = _blank()
    ss.load(loaded, path)  # slipstream's own index still matches the .metadata
    assert _equal(loaded, _state())


# --- dtype casts ---------------------------------------------------------------------


def _cast_state(dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(1)
    return {"w": (torch.randn(16, 12) * 3).to(dtype), "b": torch.randn(12).to(dtype), "k": 2}


@pytest.mark.parametrize(
    ("saved", "wanted"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float64),
    ],
)
@pytest.mark.parametrize("writer", ["torch", "slipstream"])
def test_load_casts_as_dcp_casts(tmp_path, saved, wanted, writer):
    path = str(tmp_path / "ck")
    (torch_dcp if writer == "torch" else dcp).save(_cast_state(saved), checkpoint_id=path)
    theirs = {"w": torch.zeros(16, 12, dtype=wanted), "b": torch.zeros(12, dtype=wanted), "k": 0}
    ours = {"w": torch.zeros(16, 12, dtype=wanted), "b": torch.zeros(12, dtype=wanted), "k": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.load(theirs, checkpoint_id=path)
    dcp.load(ours, checkpoint_id=path)
    reference = _cast_state(saved)
    for key in ("w", "b"):
        assert ours[key].dtype == wanted
        assert torch.equal(ours[key], theirs[key]), key
        assert torch.equal(ours[key], reference[key].to(wanted)), key
        if wanted.itemsize > saved.itemsize:  # widening: exact
            assert torch.equal(ours[key].to(saved), reference[key]), key
    assert ours["k"] == 2


def test_cast_into_a_non_contiguous_view_and_a_reshard(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.arange(48, dtype=torch.float32).reshape(6, 8)}, checkpoint_id=path)
    storage = torch.full((8, 6), -1.0, dtype=torch.bfloat16)
    target = {"w": storage.t()}  # (6, 8), not contiguous
    dcp.load(target, checkpoint_id=path)
    assert torch.equal(storage.t(), torch.arange(48, dtype=torch.bfloat16).reshape(6, 8))


def test_ss_load_refuses_a_dtype_change_unless_asked(tmp_path):
    path = str(tmp_path / "ck")
    ss.save(_cast_state(torch.float32), path)
    target = {"w": torch.zeros(16, 12, dtype=torch.bfloat16), "b": torch.zeros(12), "k": 0}
    with pytest.raises(ss.CheckpointError, match=r"dtype mismatch for 'w'.*cast=True"):
        ss.load(target, path)
    assert not target["w"].any() and not target["b"].any(), "nothing landed before the error"
    ss.load(target, path, cast=True)
    reference = _cast_state(torch.float32)
    assert torch.equal(target["w"], reference["w"].to(torch.bfloat16))
    assert torch.equal(target["b"], reference["b"])


# --- stream extensions ---------------------------------------------------------------


class _Deflate(StreamTransformExtension):
    """A user's own stream extension: zlib, with a version in its descriptor."""

    @staticmethod
    def registry_name() -> str:
        return "tests.deflate"

    @staticmethod
    def from_descriptor(version: str) -> _Deflate:
        if version != "1":
            raise ValueError(f"unknown version {version}")
        return _Deflate()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _DeflateWriter(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(zlib.decompress(input.read()))


class _DeflateWriter(io.RawIOBase):
    def __init__(self, output: IO[bytes]) -> None:
        self.output = output
        self.compressor = zlib.compressobj()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.output.write(self.compressor.compress(bytes(data)))
        return len(memoryview(data))

    def close(self) -> None:
        if not self.closed:
            self.output.write(self.compressor.flush())
            self.output.close()
        super().close()


def _registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(_Deflate)
    return registry


def _save_deflated(path: str) -> None:
    writer = torch_dcp.FileSystemWriter(path, _extensions=[_Deflate()])
    dcp.save(_state(), storage_writer=writer)
    descriptors = [
        info.transform_descriptors
        for info in torch_dcp.FileSystemReader(path).read_metadata().storage_data.values()
    ]
    assert descriptors and all(d == ["tests.deflate/1"] for d in descriptors), descriptors


def test_extension_checkpoint_loads_through_dcp_load_served_by_slipstream(tmp_path, caplog):
    path = str(tmp_path / "ck")
    _save_deflated(path)
    reference = _blank()
    torch_dcp.load(
        reference, storage_reader=torch_dcp.FileSystemReader(path, _extension_registry=_registry())
    )
    assert _equal(reference, _state())
    loaded = _blank()
    with caplog.at_level(logging.INFO, logger="slipstream.dcp"):
        dcp.load(
            loaded, storage_reader=torch_dcp.FileSystemReader(path, _extension_registry=_registry())
        )
    assert _equal(loaded, _state())
    assert not [r for r in caplog.records if "hands this load" in r.getMessage()], "served"


def test_extension_checkpoint_loads_through_ss_load(tmp_path):
    path = str(tmp_path / "ck")
    _save_deflated(path)
    loaded = _blank()
    ss.load(
        loaded, storage_reader=torch_dcp.FileSystemReader(path, _extension_registry=_registry())
    )
    assert _equal(loaded, _state())


def test_an_extension_the_reader_does_not_know_is_one_clear_error(tmp_path):
    path = str(tmp_path / "ck")
    _save_deflated(path)
    loaded = _blank()
    for load in (ss.load, dcp.load):
        with pytest.raises(ss.CheckpointError) as info:
            load(loaded, checkpoint_id=path)
        message = str(info.value)
        assert "\n" not in message
        assert "tests.deflate/1" in message and "_extension_registry" in message
        assert "model." in message  # names the record
    assert _equal(loaded, _blank()), "nothing landed before the error"


def test_a_writer_with_extensions_is_saved_by_dcp(tmp_path, caplog):
    path = str(tmp_path / "ck")
    with caplog.at_level(logging.INFO, logger="slipstream.dcp"):
        _save_deflated(path)
    assert not (tmp_path / "ck" / ".slipstream.json").exists()
    assert any("stream extensions" in r.getMessage() for r in caplog.records)


def test_a_known_extension_missing_its_module_says_so(tmp_path):
    path = tmp_path / "ck"
    _save_deflated(str(path))
    metadata = pickle.loads((path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["stream.zstd/1"]  # DCP's own ZStandard
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    if ZStandard.is_available():
        pytest.skip("zstandard is installed: this is about a host without it")
    with pytest.raises(ss.CheckpointError, match=r"stream\.zstd/1.*zstandard.*install") as info:
        dcp.load(_blank(), checkpoint_id=str(path))
    assert "\n" not in str(info.value) and "_extension_registry" not in str(info.value)
