"""Applying received bytes to a target: a module written in place under every name of a tied
tensor, and a ``load_weights`` callable given every name (no processes)."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.sync.layout.aliases import unique_tensors
from slipstream.sync.layout.plan import BucketPlan
from slipstream.sync.rollout.apply import CallableTarget, ModuleTarget

BUCKET = 64 * 1024


def _tied_module(tied: bool) -> nn.Module:
    m = nn.Module()
    m.emb = nn.Embedding(8, 4)
    m.head = nn.Linear(4, 8, bias=False)
    if tied:
        m.head.weight = m.emb.weight
    return m


def test_a_module_target_writes_a_tie_once_an_untied_pair_twice_and_names_missing_aliases():
    sent = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    specs, _ = unique_tensors([("emb.weight", sent), ("head.weight", sent)])
    plan = BucketPlan.build(specs, BUCKET, [0])
    (s,) = plan.slices
    data = sent.view(-1).view(torch.uint8)
    for tied in (True, False):
        module = _tied_module(tied)
        target = ModuleTarget(module)
        assert target.check(plan) == []
        assert len(target._dest[0]) == (1 if tied else 2)
        target.write(s, data)
        assert torch.equal(module.emb.weight, sent) and torch.equal(module.head.weight, sent)
        assert (module.head.weight is module.emb.weight) == tied
        # received in place into the first destination: the others are copied from it
        module = _tied_module(tied)
        target = ModuleTarget(module)
        assert target.check(plan) == []
        target.direct_view(s).copy_(data)
        target.landed(s)
        assert torch.equal(module.emb.weight, sent) and torch.equal(module.head.weight, sent)
    lone = nn.Module()
    lone.emb = nn.Embedding(8, 4)
    assert ModuleTarget(lone).check(plan) == ["not in the target: ['head.weight']"]
    # an alias mapped to None is skipped
    skip = ModuleTarget(lone, {"head.weight": None})
    assert skip.check(plan) == [] and len(skip._dest[0]) == 1


def test_a_callable_target_gets_every_name_of_an_aliased_tensor():
    sent = torch.arange(6, dtype=torch.int64)
    specs, _ = unique_tensors([("a", sent), ("b", torch.ones(2)), ("a_tied", sent)])
    plan = BucketPlan.build(specs, BUCKET, [0])
    batches = []
    target = CallableTarget(batches.append, {"b": None})
    assert target.check(plan) == []
    for i, spec in enumerate(plan.specs):
        target.tensor_done(i, spec, torch.ones(spec.nbytes, dtype=torch.uint8))
    target.flush()
    (batch,) = batches
    assert [n for n, _ in batch] == ["a", "a_tied"]
    assert batch[0][1] is batch[1][1] and batch[0][1].shape == (6,)
