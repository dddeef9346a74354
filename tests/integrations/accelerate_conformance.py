"""Runs accelerate's own checkpoint tests twice: as shipped, and with ``SlipstreamAccelerator``
swapped in on their import line (the documented one-line swap), and reports which tests
passed and which reached slipstream.

The tests come from accelerate's sdist for the installed version, which ``make setup``
extracts under ``<venv>/conformance/accelerate-<version>/`` (never committed here). They run
from a temporary copy, with a generated ``conftest.py`` that records each passed test and,
in the shipped run, each call of ``Accelerator.save_state``/``load_state``; in the swapped
run ``SlipstreamAccelerator`` records the calls that went through its own code (its
background writer for ``save_state``, its wait before accelerate's own ``load_state``; not
a fallback to accelerate's ``save_state``) when ``SLIPSTREAM_ACCELERATE_PROBE`` names a
file.

Selected: the whole of ``test_state_checkpointing.py`` and, of ``test_accelerator.py``, the
tests that call ``save_state``/``load_state`` (:data:`ACCELERATOR_TESTS`, a ``-k``
expression): ``test_save_load_model*`` (weights, tied weights, save and load hooks) and
``test_save_model_with_stateful_dataloader*`` (mid-epoch resume).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import accelerate

import slipstream

FILES = ("test_state_checkpointing.py", "test_accelerator.py")
ACCELERATOR_TESTS = "save_load_model or save_model_with_stateful_dataloader"
SELECTION = f"not test_accelerator.py or {ACCELERATOR_TESTS}"
"""The ``-k`` expression: all of the first file, the checkpoint tests of the second."""

SWAPS = {
    "from accelerate import Accelerator\n": (
        "from slipstream.integrations.accelerate import SlipstreamAccelerator as Accelerator\n"
    ),
    "from accelerate.accelerator import Accelerator\n": (
        "from slipstream.integrations.accelerate import SlipstreamAccelerator as Accelerator\n"
    ),
}
"""The import line of each file and its swapped form."""

_CONFTEST = """
import os

import accelerate

_OUT = os.environ["CONFORMANCE_OUT"]


def _write(kind, nodeid):
    with open(_OUT, "a") as out:
        out.write(f"{kind}\\t{nodeid}\\n")


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _write("passed", report.nodeid)


def _recording(name, original):
    def wrapper(self, *args, **kwargs):
        _write("accelerate:" + name, os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0])
        return original(self, *args, **kwargs)

    return wrapper


if os.environ.get("CONFORMANCE_SHIPPED"):
    for _name in ("save_state", "load_state"):
        _original = getattr(accelerate.Accelerator, _name)
        setattr(accelerate.Accelerator, _name, _recording(_name, _original))
"""


@dataclass
class Run:
    """What one run of the selected tests did, by pytest node id."""

    passed: set[str] = field(default_factory=set)
    calls: dict[str, set[str]] = field(default_factory=dict)
    """``"save_state"``/``"load_state"`` -> the tests that called it (shipped: any call of
    accelerate's; swapped: a call that went through slipstream's own code)."""
    output: str = ""


def tests_dir() -> Path:
    """Where ``make setup`` extracted accelerate's tests for the installed version; raises
    (never skips) naming the command when they are not there."""
    name = f"accelerate-{accelerate.__version__}"
    repo = Path(__file__).resolve().parents[2]
    candidates = [Path(sys.prefix) / "conformance" / name, repo / ".venv" / "conformance" / name]
    override = os.environ.get("SLIPSTREAM_ACCELERATE_SDIST")
    if override:
        candidates.insert(0, Path(override))
    for candidate in candidates:
        if all((candidate / "tests" / f).is_file() for f in FILES):
            return candidate / "tests"
    raise FileNotFoundError(
        f"accelerate {accelerate.__version__}'s tests are not in any of "
        f"{', '.join(map(str, candidates))}: run `make setup` (it downloads accelerate's sdist "
        "and extracts it there), or set SLIPSTREAM_ACCELERATE_SDIST to an extracted sdist"
    )


def _copy(source: Path, workdir: Path, swapped: bool) -> None:
    workdir.mkdir(parents=True)
    for name in FILES:
        text = (source / name).read_text()
        if swapped:
            hits = [line for line in SWAPS if line in text]
            if len(hits) != 1 or text.count(hits[0]) != 1:
                raise AssertionError(f"{source / name}: no single Accelerator import to swap")
            text = text.replace(hits[0], SWAPS[hits[0]])
        (workdir / name).write_text(text)
    (workdir / "conftest.py").write_text(_CONFTEST)


def start(source: Path, workdir: Path, swapped: bool) -> tuple[subprocess.Popen[str], Path]:
    """Start one run in ``workdir`` (a fresh directory); returns the process and the file
    its records go to."""
    _copy(source, workdir, swapped)
    out = workdir / "records.tsv"
    env = dict(os.environ, CONFORMANCE_OUT=str(out), OMP_NUM_THREADS="1")
    src = str(Path(slipstream.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    if swapped:
        env["SLIPSTREAM_ACCELERATE_PROBE"] = str(out)
        env.pop("CONFORMANCE_SHIPPED", None)
    else:
        env["CONFORMANCE_SHIPPED"] = "1"
        env.pop("SLIPSTREAM_ACCELERATE_PROBE", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs"]
    command += ["-W", "ignore::UserWarning", *FILES, "-k", SELECTION]
    process = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return process, out


def finish(process: subprocess.Popen[str], out: Path, timeout: float) -> Run:
    """Wait for a run (killing it past ``timeout``) and read its records."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    run = Run(output=output)
    lines = out.read_text().splitlines() if out.exists() else []
    for line in lines:
        kind, nodeid = line.split("\t", 1)
        if kind == "passed":
            run.passed.add(nodeid)
        else:
            run.calls.setdefault(kind.split(":", 1)[1], set()).add(nodeid)
    return run


def run_both(workdir: Path, timeout: float) -> tuple[Run, Run]:
    """The shipped and the swapped run, one after the other (side by side, their data
    loader workers contend for the cores: twice slower in all on two)."""
    source = tests_dir()
    shutil.rmtree(workdir, ignore_errors=True)
    shipped = finish(*start(source, workdir / "shipped", swapped=False), timeout=timeout)
    swapped = finish(*start(source, workdir / "swapped", swapped=True), timeout=timeout)
    return shipped, swapped
