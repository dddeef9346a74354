"""The shared optimizer-state helpers of ``slipstream.integrations.training_state``: reading
an optimizer's state for a save changes nothing (torch's ``get_optimizer_state_dict`` makes
an optimizer that has not stepped take a zero-lr step), names match torch's FQNs, and a
round trip through a checkpoint restores the state exactly, also one saved before any step."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import slipstream as ss
from slipstream.integrations.training_state import (
    optimizer_parameter_names,
    optimizer_state,
    restore_optimizer_state,
    saved_subtree,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_reading_an_unstepped_optimizer_changes_nothing() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference = copy.deepcopy((model, optimizer))
    names = optimizer_parameter_names(optimizer, model)
    state = optimizer_state(optimizer, names)
    assert state["state"] == {} and len(optimizer.state) == 0
    assert all(p.grad is None for p in model.parameters())
    for seed in range(5):
        _step(model, optimizer, seed)
        _step(reference[0], reference[1], seed)
    assert _same(model.state_dict(), reference[0].state_dict())
    assert _same(optimizer.state_dict(), reference[1].state_dict())


def test_names_and_format_match_torch_after_a_step() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, 0)
    ours = optimizer_state(optimizer, optimizer_parameter_names(optimizer, model))
    assert _same(ours, get_optimizer_state_dict(model, optimizer))


def test_round_trip_before_and_after_steps(tmp_path: Path) -> None:
    for steps in (0, 3):
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for seed in range(steps):
            _step(model, optimizer, seed)
        names = optimizer_parameter_names(optimizer, model)
        ss.save({"optimizer": optimizer_state(optimizer, names)}, tmp_path / str(steps))

        fresh = copy.deepcopy(model)
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
        target = {"optimizer": saved_subtree(str(tmp_path / str(steps)), "optimizer")}
        ss.load(target, tmp_path / str(steps), strict=False)
        fresh_names = optimizer_parameter_names(fresh_optimizer, fresh)
        restore_optimizer_state(fresh_optimizer, fresh_names, target["optimizer"], "here")
        assert len(fresh_optimizer.state) == (0 if steps == 0 else 4)
        assert _same(fresh_optimizer.state_dict(), optimizer.state_dict())
        assert _same(fresh.state_dict(), model.state_dict())  # the load stepped nothing
