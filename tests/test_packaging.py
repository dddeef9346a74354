import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import slipstream as ss

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    match = re.search(r'^version\s*=\s*"([^"]+)"', project, re.MULTILINE)
    assert match, "no version in [project] of pyproject.toml"
    return match.group(1)


def test_version_comes_from_pyproject():
    assert ss.__version__ == _pyproject_version()


def test_wheel_ships_py_typed(tmp_path):
    # Build from a copy so the source tree gets no build/ or egg-info.
    src = tmp_path / "tree"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(src)],
        check=True,
        timeout=120,
    )
    (wheel,) = out.glob("slipstream-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "slipstream/py.typed" in names
    assert f"slipstream-{_pyproject_version()}.dist-info/METADATA" in names
