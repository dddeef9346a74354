"""The saver's lifetime against concurrent calls (issue 47, items d and e): a call's
``timeout`` never rewrites the waits of a save already in flight on the shared saver, and a
save racing ``close()`` either runs or fails telling the other ranks, never takes a number
that no rank hears of."""

from __future__ import annotations

import pytest
import torch
from fault_storage import GATE_TIMEOUT, FaultStorage

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, api
from slipstream.checkpoint.save.messages import Topics
from slipstream.checkpoint.storage import resolve_storage
from slipstream.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_calls_timeout_never_changes_the_save_in_flight(tmp_path):
    api._close_savers()
    storage = FaultStorage(resolve_storage(tmp_path / "a"))
    gate = storage.faults.gate("finish")
    state = {"w": torch.arange(10.0)}
    first = ss.async_save(state, storage)  # the default timeout: 600 s
    try:
        with pytest.raises(CheckpointError, match="previous save did not finish"):
            ss.async_save(state, tmp_path / "b", timeout=0.05)
        saver = api._savers[("local",)]
        assert saver.options.timeout == 600.0, (
            "the second call's timeout rewrote the shared saver's options, and so the waits "
            "of the save still in flight"
        )
    finally:
        gate.set()
        first.result(timeout=GATE_TIMEOUT)
        api._close_savers()


def test_a_save_racing_close_fails_and_tells_the_other_ranks(tmp_path):
    saver = CheckpointSaver()
    prepare = saver._prepare

    def close_meanwhile(*args, **kwargs):
        # close() comes in between the save taking its number and queueing its work
        saver.close()
        return prepare(*args, **kwargs)

    saver._prepare = close_meanwhile  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match="closed"):
        saver.save({"w": torch.arange(10.0)}, tmp_path / "ck")
    channel = saver.channel
    written = channel._key(Topics.written(0), 0)
    assert channel.store.check([written]), (
        "the save took number 0 and failed without posting its failure: the other ranks "
        "would wait for it until their timeout"
    )
    assert not (tmp_path / "ck" / ".metadata").exists()
