"""Several publishers and subscribers on one sync group at once: each set has a channel of
its own (store keys, process groups, shared-memory rings), named explicitly or numbered in
creation order per (trainer ranks, rollout ranks)."""

from __future__ import annotations

import threading

import pytest
import torch
from sync_procs import remote_reads_allowed, spawn
from torch import nn

import slipstream as ss
from slipstream.sync.group import _Channels, default_channel_name

BUCKET = 64 * 1024
SEPARATE = 4096
TRANSPORTS = ["relay", "broadcast", "shm", *(["cma"] if remote_reads_allowed() else [])]


def test_default_channel_names_count_per_rank_sets_and_a_name_is_opened_once():
    channels = _Channels()
    assert channels.claim(None, [0], [1, 2]) == default_channel_name([0], [1, 2], 0)
    assert channels.claim("mine", [0], [1, 2]) == "mine"  # named ones are not counted
    assert channels.claim(None, [0], [3]) == default_channel_name([0], [3], 0)
    assert channels.claim(None, [0], [1, 2]) == default_channel_name([0], [1, 2], 1)
    names = {default_channel_name(t, r, n) for t, r, n in [([0], [1, 2], 0), ([0], [3], 0)]}
    assert len(names) == 2  # other ranks, another name: their store keys never meet
    for taken in ("mine", default_channel_name([0], [3], 0)):
        with pytest.raises(ValueError, match="already opened"):
            channels.claim(taken, [0], [1, 2])


def model(which: str, version: int) -> dict[str, torch.Tensor]:
    """Two different models: ``a`` (float32, one tensor over two buckets), ``b`` (bfloat16
    and int64); from version 2 on, every tensor changes."""
    g = torch.Generator().manual_seed(100 * "ab".index(which) + version)
    if which == "a":
        return {f"a.{i}": torch.randn(n, generator=g) for i, n in enumerate((7, 5000, 40_000))}
    return {
        "b.emb": torch.randn(300, 16, generator=g).to(torch.bfloat16),
        "b.ids": torch.randint(0, 99, (1234,), generator=g),
    }


def holder(which: str) -> nn.Module:
    m = nn.Module()
    for name, t in model(which, 0).items():
        m.register_buffer(flat(name), torch.zeros_like(t))
    return m


def exact(target: nn.Module | dict, which: str, version: int) -> bool:
    for name, t in model(which, version).items():
        got = target[name] if isinstance(target, dict) else target.get_buffer(flat(name))
        if not torch.equal(got, t):
            return False
    return True


def flat(name: str) -> str:
    return name.replace(".", "_")


VERSIONS = (1, 2, 3)


def _trainer(pub: ss.WeightPublisher, which: str) -> None:
    for version in VERSIONS:
        pub.publish(model(which, version), version=version).staged.result(timeout=20)
    pub.close()


def take(sub: ss.WeightSubscriber, target: nn.Module | dict, which: str, version: int) -> bool:
    """Receive ``version`` of model ``which`` into a module or, through a ``load_weights``
    callable, a dict; whether it holds exactly that version then."""
    if isinstance(target, nn.Module):
        assert sub.receive(target, name_map=flat) == version
    else:
        sub.receive(lambda batch: target.update((n, t.clone()) for n, t in batch))
    return exact(target, which, version)


def _rollout(sub: ss.WeightSubscriber, which: str, into_module: bool) -> list[bool]:
    target: nn.Module | dict = holder(which) if into_module else {}
    seen = [take(sub, target, which, version) for version in VERSIONS]
    sub.close()
    return seen


def _two_channels_run(rank, port, transport):
    """Per channel pair: ``a`` in direct mode, ``b`` in cached mode, both from trainer 0 to
    rollouts 1 (into modules) and 2 (into callables). First alternately, on one thread,
    with default channel names; then concurrently, one thread per channel, named ones."""
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=30)
    opts = dict(bucket_bytes=BUCKET, transport=transport, separate_min_bytes=SEPARATE)
    out = {}
    # alternately, default names (both sides create them in the same order)
    if rank == 0:
        pubs = {
            "a": ss.WeightPublisher(group, [0], [1, 2], mode="direct", **opts),
            "b": ss.WeightPublisher(group, [0], [1, 2], mode="cached", **opts),
        }
        assert all(p.transport == transport for p in pubs.values())
        out["names"] = {w: p.channel for w, p in pubs.items()}
        for version in VERSIONS:
            for which, pub in pubs.items():
                pub.publish(model(which, version), version=version)
        for pub in pubs.values():
            pub.close()
    else:
        subs = {w: ss.WeightSubscriber(group, [0], [1, 2]) for w in ("a", "b")}
        out["names"] = {w: s.channel for w, s in subs.items()}
        targets = {w: holder(w) if rank == 1 else {} for w in subs}
        seen = []
        for version in VERSIONS:
            for which, sub in subs.items():
                seen.append(take(sub, targets[which], which, version))
        out["alternately"] = seen
        for sub in subs.values():
            sub.close()
    # concurrently: one thread per channel on every rank
    results: dict[str, list[bool]] = {}
    errors: list[BaseException] = []

    def run(which: str) -> None:
        try:
            channel = f"model-{which}"
            if rank == 0:
                mode = "direct" if which == "a" else "cached"
                pub = ss.WeightPublisher(group, [0], [1, 2], mode=mode, channel=channel, **opts)
                _trainer(pub, which)
            else:
                sub = ss.WeightSubscriber(group, [0], [1, 2], channel=channel)
                results[which] = _rollout(sub, which, into_module=rank == 1)
        except BaseException as exc:  # re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a channel's thread hung"
    if errors:
        raise errors[0]
    out["concurrently"] = results
    group.close()
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_models_on_one_group_alternately_and_concurrently_arrive_exact(transport):
    out = spawn(_two_channels_run, 3, transport, timeout=90)
    names = out[0]["names"]
    assert names["a"] != names["b"]
    for rank in (1, 2):
        assert out[rank]["names"] == names  # numbered alike on both sides
        assert out[rank]["alternately"] == [True] * 2 * len(VERSIONS), (rank, out[rank])
        assert out[rank]["concurrently"] == {w: [True] * len(VERSIONS) for w in "ab"}, rank
