"""A ``load_weights`` rollout that reads only part of some tensors (a tensor-parallel
worker's loaders: rows of a column-parallel weight, a band of columns of a row-parallel one,
a range of a middle dimension) says so with ``keeps`` and receives only those bytes: two
such rollouts, each keeping its own half, get exactly the trainer's bytes in their part
(zeros elsewhere, never an older version's) after every version, in place and with
``atomic=True``, over shared memory and over the network (relayed and broadcast), and
receive at most their parts' bytes plus 10%. The reference is the trainer's own tensors
narrowed with ``torch.narrow``. Small buckets cut tensors mid-row, so slices start and end
inside a run. Rank 1 passes its parts, rank 2 a function of the version's layout that
gives them. A ``keeps`` that does not fit the version is refused naming the tensor,
before any byte is applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sync_procs import publish_each, spawn

import slipstream as ss
from slipstream.sync import Narrow
from slipstream.sync.rollout.apply import make_target

BUCKET = 1024
VERSIONS = (1, 2, 3)
SHAPES = {"up": (33, 16), "down": (7, 33), "cube": (3, 10, 4), "norm": (33,)}


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(shape, generator=g) for n, shape in SHAPES.items()}


def _keeps(half: int) -> dict[str, Narrow]:
    """Rank ``half``'s part: the first or second half of each tensor's split dimension
    (uneven where the size is odd); ``norm`` whole."""
    out = {}
    for name, dim in (("up", 0), ("down", 1), ("cube", 1)):
        n = SHAPES[name][dim]
        first = (n + 1) // 2
        out[name] = Narrow(dim, 0, first) if half == 0 else Narrow(dim, first, n - first)
    return out


def _keeps_of_layout(layout):
    """Rank 2's keeps, as a function of the version's layout (what a worker that learns its
    parts from its loaders passes)."""
    assert layout == {n: (shape, torch.float32) for n, shape in SHAPES.items()}, layout
    return _keeps(1)


def _run(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 3, rank, timeout=60)
    if rank == 0:
        return publish_each(
            group, [1, 2], _weights, VERSIONS, bucket_bytes=BUCKET, transport=transport
        )
    held: dict = {"received": []}
    with ss.WeightSubscriber(group, [0], [1, 2]) as sub:
        for version in VERSIONS:
            got: dict = {}

            def load(batch, got=got):
                got.update({n: t.numpy().copy() for n, t in batch})

            before = sub.bytes_received
            keeps = _keeps(0) if rank == 1 else _keeps_of_layout
            assert sub.receive(load, atomic=version == 2, keeps=keeps) == version
            held["received"].append(sub.bytes_received - before)
            held[version] = got
    group.close()
    return held


@pytest.mark.parametrize("transport", ["shm", "relay", "broadcast"])
def test_each_rollout_receives_only_the_part_of_each_tensor_it_keeps(transport):
    out = spawn(_run, 3, transport, timeout=120)
    for rollout in (1, 2):
        keeps = _keeps(rollout - 1)
        for version in VERSIONS:
            for name, full in _weights(version).items():
                got = out[rollout][version][name]
                assert got.shape == full.shape, (name, got.shape)
                narrow = keeps.get(name)
                if narrow is None:
                    assert np.array_equal(got, full.numpy()), (transport, version, name)
                    continue
                part = full.narrow(narrow.dim, narrow.start, narrow.length)
                mine = torch.from_numpy(got).narrow(narrow.dim, narrow.start, narrow.length)
                assert torch.equal(mine, part), (transport, version, name, rollout)
                outside = torch.from_numpy(got).clone()
                outside.narrow(narrow.dim, narrow.start, narrow.length).zero_()
                assert not outside.any(), (transport, version, name, "bytes outside its part")
        kept = sum(
            _weights(1)[n].narrow(k.dim, k.start, k.length).nbytes for n, k in keeps.items()
        ) + sum(_weights(1)[n].nbytes for n in SHAPES if n not in keeps)
        dense = sum(t.nbytes for t in _weights(1).values())
        received = out[rollout]["received"]
        assert all(0 < n <= 1.1 * kept for n in received), (transport, kept, received)
        assert kept < 0.65 * dense, (kept, dense)


def _refused(rank, port, keeps):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    if rank == 0:
        with ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, transport="relay") as p:
            with pytest.raises(ss.SyncError, match="rollout rank 1 rejected version 1"):
                p.publish(_weights(1), version=1).delivered.result(timeout=60)
            p.publish(_weights(2), version=2).delivered.result(timeout=60)
        group.close()
        return None
    calls = []
    with ss.WeightSubscriber(group, [0], [1]) as sub:
        with pytest.raises(ss.SyncError) as refused:
            sub.receive(calls.append, keeps=keeps)
        refused_calls = len(calls)
        assert sub.receive(calls.append) == 2  # the group stays usable
    group.close()
    return str(refused.value), refused_calls, len(calls)


@pytest.mark.parametrize(
    ("keeps", "named"),
    [
        ({"missing": Narrow(0, 0, 1)}, "missing"),
        ({"up": Narrow(0, 30, 4)}, "up"),
        ({"down": Narrow(2, 0, 1)}, "down"),
    ],
)
def test_keeps_that_do_not_fit_the_version_are_refused_naming_the_tensor(keeps, named):
    out = spawn(_refused, 2, keeps, timeout=60)
    message, refused_calls, calls = out[1]
    assert named in message and "keeps" in message, message
    assert refused_calls == 0 < calls, "only the second version reached load_weights"


def test_keeps_is_refused_for_a_module_target():
    with pytest.raises(TypeError, match="keeps is for a load_weights callable"):
        make_target(torch.nn.Linear(2, 2), None, {}, {"weight": Narrow(0, 0, 1)})


def _tied(version: int) -> dict[str, torch.Tensor]:
    emb = torch.randn(20, 8, generator=torch.Generator().manual_seed(version))
    return {"emb": emb, "head": emb}  # one tensor, sent once under both names


TIED_KEEPS = (
    ({"emb": Narrow(0, 4, 8), "head": Narrow(0, 0, 0)}, (4, 8)),  # head read not at all
    ({"emb": Narrow(0, 4, 8), "head": Narrow(0, 10, 6)}, (4, 12)),  # the span of both
    ({"emb": Narrow(0, 4, 8)}, (0, 20)),  # head not named: read whole
)


def _tied_run(rank, port):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=60)
    versions = range(1, len(TIED_KEEPS) + 1)
    if rank == 0:
        return publish_each(group, [1], _tied, versions, bucket_bytes=256, transport="relay")
    out = []
    with ss.WeightSubscriber(group, [0], [1]) as sub:
        for version, (keeps, _) in zip(versions, TIED_KEEPS, strict=True):
            got: dict = {}
            before = sub.bytes_received
            load = lambda b, got=got: got.update({n: t.numpy().copy() for n, t in b})  # noqa: E731
            assert sub.receive(load, keeps=keeps) == version
            out.append((got, sub.bytes_received - before))
    group.close()
    return out


def test_a_tied_tensor_is_received_for_every_name_it_is_read_by():
    out = spawn(_tied_run, 2, timeout=60)[1]
    for version, ((got, received), (_, (start, length))) in enumerate(
        zip(out, TIED_KEEPS, strict=True), 1
    ):
        full = _tied(version)["emb"].numpy()
        assert set(got) == {"emb", "head"} and np.array_equal(got["emb"], got["head"])
        emb = got["emb"]
        assert np.array_equal(emb[start : start + length], full[start : start + length])
        assert not emb[:start].any() and not emb[start + length :].any()
        assert received == length * 8 * 4, (version, received)
