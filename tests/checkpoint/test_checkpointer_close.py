"""``Checkpointer.close`` joins the durable saver's threads even when closing the local
tier raises (issue 47, item c)."""

from __future__ import annotations

import pytest

import slipstream as ss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _BrokenTier:
    def close(self) -> None:
        raise OSError("the local tier's disk is gone")


def test_close_closes_the_durable_saver_when_the_local_tier_fails_to_close(tmp_path):
    ckpt = ss.Checkpointer(tmp_path / "run")
    ckpt.local_tier = _BrokenTier()  # type: ignore[assignment]
    with pytest.raises(OSError, match="disk is gone"):
        ckpt.close()
    assert ckpt._saver._closed, "the durable saver was left open, its threads never joined"
    ckpt.local_tier = None
    ckpt.close()
