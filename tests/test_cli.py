import torch
from safetensors.torch import load_file

import slipstream as ss
from slipstream.cli import main


def _make(tmp_path):
    state = {"model": {"w": torch.randn(8, 4), "b": torch.arange(3)}, "step": 4}
    ss.save(state, tmp_path / "ck")
    return state


def test_inspect_lists_keys(tmp_path, capsys):
    _make(tmp_path)
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and "[8, 4]" in out and "step" in out and "checksums: yes" in out


def test_verify_detects_corruption(tmp_path, capsys):
    _make(tmp_path)
    assert main(["verify", str(tmp_path / "ck")]) == 0
    data_file = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    raw[800] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "ck")]) == 1
    assert "checksum mismatch" in capsys.readouterr().err


def test_convert_to_safetensors_matches_state(tmp_path):
    state = _make(tmp_path)
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(tmp_path / "ck"), str(out)]) == 0
    tensors = load_file(str(out))
    assert torch.equal(tensors["model.w"], state["model"]["w"])
    assert torch.equal(tensors["model.b"], state["model"]["b"])
    assert "step" not in tensors
