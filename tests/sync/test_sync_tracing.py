"""A publish and a receive appear in slipstream's trace file as named ranges on the threads
that ran them, in the Trace Event Format, for both modes."""

from __future__ import annotations

import json
import threading

import torch
from sync_procs import spawn
from torch import nn
from trace_format import check_trace_event_format

import slipstream as ss
from slipstream.core import tracing

PUBLISH_STAGES = {
    "slipstream.sync.publish",
    "slipstream.sync.publish.send",
    "slipstream.sync.publish.await_acks",
}
RECEIVE_STAGES = {
    "slipstream.sync.receive",
    "slipstream.sync.receive.transfer",
    "slipstream.sync.receive.bucket",
}


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def _traced_sync(rank, port, root, mode):
    trace = f"{root}/trace.{mode}.{rank}.json"
    tracing.start(trace)
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        with ss.WeightPublisher(group, [0], [1], mode=mode, transport="broadcast") as pub:
            pub.publish(_weights(), version=1).delivered.result(timeout=30)
    else:
        target = nn.Module()
        for name, t in _weights().items():
            target.register_buffer(name, torch.zeros_like(t))
        with ss.WeightSubscriber(group, [0], [1]) as sub:
            assert sub.receive(target) == 1
        assert all(torch.equal(getattr(target, n), t) for n, t in _weights().items())
    group.close()
    tracing.stop()
    return {"file": trace, "main": threading.main_thread().name}


def _names_by_thread(path: str) -> dict[str, set[str]]:
    doc = json.loads(open(path).read())
    events = check_trace_event_format(doc)
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e["name"] == "thread_name"
    }
    by_thread: dict[str, set[str]] = {}
    for e in events:
        by_thread.setdefault(threads[(e["pid"], e["tid"])], set()).add(e["name"])
    return by_thread


def test_publish_and_receive_stages_are_ranges_in_the_trace_file(tmp_path):
    for mode in ("direct", "cached"):
        out = spawn(_traced_sync, 2, str(tmp_path), mode, timeout=90)
        trainer = _names_by_thread(out[0]["file"])
        rollout = _names_by_thread(out[1]["file"])
        everything_trainer = set().union(*trainer.values())
        assert "slipstream.sync.publish" in trainer[out[0]["main"]], (mode, trainer)
        assert PUBLISH_STAGES <= everything_trainer, (mode, sorted(everything_trainer))
        if mode == "cached":
            assert "slipstream.sync.publish.snapshot" in trainer[out[0]["main"]], trainer
        assert RECEIVE_STAGES <= rollout[out[1]["main"]], (mode, rollout)
