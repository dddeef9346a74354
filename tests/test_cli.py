import io
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import slipstream as ss
from slipstream.cli import EXIT_FAILED, EXIT_OK, EXIT_UNVERIFIED, EXIT_USAGE, main
from slipstream.progress import Progress


class _Config:
    """A class of the user's own, not on the allow-list."""

    def __init__(self) -> None:
        self.depth = 4


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


def test_verify_says_what_it_checked(tmp_path, capsys):
    ss.save({"w": torch.randn(600, 1000), "step": 1}, tmp_path / "ck")  # 2.3 MiB: 3 blocks
    assert main(["verify", str(tmp_path / "ck")]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("verified ")
    assert "2 entries" in out and "from 1 file(s)" in out and "2.3 MiB of tensors" in out
    assert "3 checksummed blocks and 1 value(s) match: OK" in out


@pytest.mark.parametrize("how", ["dcp", "index_removed"])
def test_verify_without_checksums_says_so_with_its_own_status(tmp_path, capsys, how):
    state = {"w": torch.randn(8, 4), "step": 2}
    if how == "dcp":
        dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    else:
        ss.save(state, tmp_path / "ck")
        (tmp_path / "ck" / ".slipstream.json").unlink()
    assert main(["verify", str(tmp_path / "ck")]) == EXIT_UNVERIFIED == 3
    out = capsys.readouterr().out
    assert out.startswith("NOT verified") and "structure and sizes only" in out
    assert "OK" not in out


def test_verify_of_a_truncated_dcp_checkpoint_fails(tmp_path, capsys):
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    data = tmp_path / "ck" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    assert main(["verify", str(tmp_path / "ck")]) == EXIT_FAILED
    assert "truncated" in capsys.readouterr().err


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_convert_into_a_missing_directory_is_a_one_line_usage_error(tmp_path, capsys):
    _make(tmp_path)
    out = tmp_path / "no" / "such" / "model.safetensors"
    assert main(["convert", str(tmp_path / "ck"), str(out)]) == EXIT_USAGE == 2
    err = _one_line_error(capsys)
    assert f"output directory {tmp_path / 'no' / 'such'} does not exist" in err


def test_missing_checkpoint_is_a_one_line_error_naming_it(tmp_path, capsys):
    for command in ("inspect", "verify"):
        assert main([command, str(tmp_path / "nothing")]) == EXIT_FAILED
        assert str(tmp_path / "nothing") in _one_line_error(capsys)


def test_unsafe_value_needs_trust_on_the_command_line(tmp_path, capsys):
    ss.save({"w": torch.ones(2), "cfg": _Config()}, tmp_path / "ck")
    name = f"{_Config.__module__}._Config"
    assert main(["verify", str(tmp_path / "ck")]) == EXIT_FAILED
    err = _one_line_error(capsys)
    assert name in err and f"--trust {name}" in err
    assert main(["verify", str(tmp_path / "ck"), "--trust", name]) == EXIT_OK
    assert main(["verify", str(tmp_path / "ck"), "--trust-all"]) == EXIT_OK


def test_python_dash_m_and_version():
    run = subprocess.run(
        [sys.executable, "-m", "slipstream", "--version"], capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == f"slipstream {ss.__version__}"
    run = subprocess.run(
        [sys.executable, "-m", "slipstream", "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0
    assert all(c in run.stdout for c in ("inspect", "verify", "convert"))


def test_progress_is_drawn_on_a_terminal_only():
    shown = io.StringIO()
    with Progress("verify", 4 * 2**20, stream=shown, enabled=True, min_interval=0) as bar:
        bar.advance(2**21)
        bar.advance(2**21)
    text = shown.getvalue()
    assert "\r" in text and "50.0%" in text and "100.0%" in text and "4/4 MiB" in text
    quiet = io.StringIO()  # not a terminal: nothing at all
    with Progress("verify", 100, stream=quiet, min_interval=0) as bar:
        bar.advance(100)
    assert quiet.getvalue() == ""


def test_commands_print_no_progress_when_not_on_a_terminal(tmp_path, capsys):
    _make(tmp_path)
    assert main(["verify", str(tmp_path / "ck")]) == EXIT_OK
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err and captured.err == ""


def test_s3_checkpoints(s3_bucket, tmp_path, capsys):
    state = {"model": {"w": torch.randn(8, 4)}, "step": 4}
    url = f"s3://{s3_bucket}/run/step_4"
    ss.save(state, url)
    assert main(["inspect", url]) == EXIT_OK
    assert "model.w" in capsys.readouterr().out
    assert main(["verify", url]) == EXIT_OK
    assert capsys.readouterr().out.startswith(f"verified {url}")
    out = tmp_path / "m.safetensors"
    assert main(["convert", url, str(out)]) == EXIT_OK
    assert torch.equal(load_file(str(out))["model.w"], state["model"]["w"])
