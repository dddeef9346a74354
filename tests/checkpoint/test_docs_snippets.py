"""The Python snippets of docs/checkpoint.md and docs/save-cost.md run as written."""

from __future__ import annotations

import pathlib
import re

import torch

import slipstream as ss

DOC = pathlib.Path(__file__).parents[2] / "docs" / "checkpoint.md"
SAVE_COST = DOC.with_name("save-cost.md")


def _snippet(section: str, doc: pathlib.Path = DOC) -> str:
    text = doc.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", body, re.S)
    assert match, f"no python snippet under '## {section}'"
    return match.group(1)


def test_managing_a_run_snippet_saves_and_resumes_a_bare_stateful(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(_snippet("Managing a run"), str(DOC), "exec")
    first: dict = {}
    exec(code, first)
    trained = {k: v.clone() for k, v in first["model"].state_dict().items()}
    assert first["state"].step == 9
    steps = sorted(p.name for p in (tmp_path / "runs" / "exp1").glob("step_*"))
    assert steps == ["step_7", "step_8", "step_9"]
    second: dict = {}
    exec(code, second)  # a new model and optimizer, resumed from step 9
    assert second["state"].step == 9 and second["start"] == 10
    for key, value in second["model"].state_dict().items():
        assert torch.equal(value, trained[key]), key
    resumed_optim = second["optim"].state_dict()["state"]
    trained_optim = first["optim"].state_dict()["state"]
    for index, buffers in trained_optim.items():
        for name, value in buffers.items():
            assert torch.equal(resumed_optim[index][name], value), (index, name)


def test_options_snippet_counts_one_staging_buffer_and_every_staging_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(_snippet("Options"), str(DOC), "exec"), namespace)
    assert namespace["started"] == ["staging"] * 3
    assert sorted(p.name for p in (tmp_path / "options-demo").iterdir()) == ["0", "1", "2"]
    assert all((tmp_path / "options-demo" / s / ".metadata").is_file() for s in "012")


def test_staging_budget_snippet_streams_a_save_within_its_budget(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    code = _snippet("Staging under a memory budget", SAVE_COST)
    exec(compile(code, str(SAVE_COST), "exec"), namespace)
    got = {"w": torch.zeros(1_000_000), "step": 0}
    ss.load(got, tmp_path / "budget-demo")
    assert torch.equal(got["w"], namespace["state"]["w"]) and got["step"] == 3
