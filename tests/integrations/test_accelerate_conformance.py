"""accelerate's own checkpoint tests pass with ``SlipstreamAccelerator`` swapped in, and went
through slipstream: every test that passes as shipped passes swapped, and every one of them
that calls ``save_state``/``load_state`` made those calls through slipstream's own code (not
a fallback to accelerate's): each ``save_state`` wrote its files through slipstream's
background writer, and each ``load_state`` waited for it and then read them with
accelerate's own ``load_state``, so the tests' checks of what was restored are checks that
the files on disk are accelerate's. See :mod:`accelerate_conformance` for what runs and
how."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from accelerate_conformance import run_both

pytestmark = pytest.mark.timeout(1200)


def test_accelerate_checkpoint_tests_pass_through_slipstream(
    tmp_path: Path, summary_line: Callable[[str], None]
) -> None:
    shipped, swapped = run_both(tmp_path, timeout=550)
    assert shipped.passed, f"no test passed as shipped:\n{shipped.output[-4000:]}"
    failed = sorted(shipped.passed - swapped.passed)
    missed = {
        call: sorted((tests & shipped.passed) - swapped.calls.get(call, set()))
        for call, tests in shipped.calls.items()
    }
    saving = set().union(*shipped.calls.values()) & shipped.passed
    reached = {t for t in saving if not any(t in tests for tests in missed.values())}
    line = (
        f"accelerate conformance: {len(shipped.passed)} passed as shipped, "
        f"{len(shipped.passed & swapped.passed)} of them passed swapped, "
        f"{len(reached)} of the {len(saving)} that save or load reached slipstream"
    )
    summary_line(line)
    assert not failed, f"{line}\nfailed swapped: {failed}\n{swapped.output[-6000:]}"
    assert not any(missed.values()), f"{line}\nnot through slipstream: {missed}"
