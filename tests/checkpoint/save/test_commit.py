"""The commit builds DCP's metadata from the classes DCP's metadata module holds when the
save commits, as DCP's own planner does, not from copies bound when slipstream was
imported (a test or a tool that swaps a class sees slipstream's metadata made of it)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

import slipstream as ss


class RecordedProperties(dcp_metadata.TensorProperties):
    """DCP's TensorProperties under another name."""


def test_metadata_is_built_from_the_classes_dcp_holds_at_commit_time(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_metadata, "TensorProperties", RecordedProperties)
    metadata = ss.save({"w": torch.ones(3), "b": torch.zeros(2)}, checkpoint_id=str(tmp_path))
    for fqn in ("w", "b"):
        assert type(metadata.state_dict_metadata[fqn].properties) is RecordedProperties
