"""slipstream's verl checkpoint engine, driven by verl 0.9.1's own registry and base classes
through the call sequence of its ``CheckpointEngineManager`` on every update.

Two trainer processes hold an FSDP2 (``fully_shard``, gloo on CPU) Llama with tied
embeddings and hand the engine a generator of ``full_tensor()``s, as verl's FSDP actor does;
two rollout processes load what ``receive_weights`` yields into their own copy of the model.
This test plays the manager: ``prepare`` on every worker, the engine class's
``build_topology`` (looked up in verl's registry after importing ``custom_backend_module``),
``init_process_group`` with what it returned, ``send_weights`` / ``receive_weights``, then
``finalize``. After each update every rollout that took part holds exactly the trainer's
weights (gathered by the trainers themselves).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import traceback
import weakref
from datetime import timedelta

import pytest
from dist_utils import free_port, worker_context

BACKEND = "slipstream"
MODULE = "slipstream.integrations.verl"
TIMEOUT = 60.0
TRAINERS = 2
BUCKET = 4096
ROLLOUTS = ["rolloutA", "rolloutB", "rolloutC", "rolloutD"]


def _model(seed: int):
    from hf_models import model

    return model("llama-tied", seed, hidden_size=32, intermediate_size=64)


def _engine(engine_kwargs: dict, **built_with):
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)  # what verl does with custom_backend_module
    return CheckpointEngineRegistry.new(BACKEND, bucket_size=BUCKET, **built_with, **engine_kwargs)


class _Trainer:
    """One FSDP2 trainer rank with its checkpoint engine, built as verl's actor builds it."""

    def __init__(self, rank: int, port: int, engine_kwargs: dict) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=TRAINERS,
            timeout=timedelta(seconds=TIMEOUT),
        )
        mesh = init_device_mesh("cpu", (TRAINERS,))
        self.model = _model(seed=0)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.engine = _engine(engine_kwargs, is_master=dist.get_rank() == 0)

    def train(self, step: int, sparse: bool = False) -> None:
        """One SGD step; ``sparse``: instead, add 1 to every 64th value of every parameter
        (every tensor changes, a few of its words do: what deltas are for)."""
        import torch

        if sparse:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.to_local().view(-1)[step % 64 :: 64] += 1.0
            return
        torch.manual_seed(100 + step)
        tokens = torch.randint(0, 96, (2, 8))
        loss = self.model(tokens, labels=tokens).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def per_tensor_param(self):
        """verl's FSDP engine's ``get_per_tensor_param``: one gathered tensor per item. It
        counts the bytes of the tensors it yielded that are still alive (``peak_alive``)."""
        from torch.distributed.tensor import DTensor

        self.alive = self.peak_alive = 0
        for name, p in self.model.state_dict().items():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            self.alive += t.nbytes
            self.peak_alive = max(self.peak_alive, self.alive)
            weakref.finalize(t, self._freed, t.nbytes)
            yield name, t
            del t

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes

    def send(self, global_steps):
        metrics = asyncio.run(self.engine.send_weights(self.per_tensor_param(), global_steps))
        gathered = [p.full_tensor() for p in self.model.state_dict().values()]
        return {
            "metrics": metrics,
            "peak_alive": self.peak_alive,
            "model_bytes": sum(t.nbytes for t in gathered),
            "largest": max(t.nbytes for t in gathered),
        }

    def weights(self):
        return {name: t.clone() for name, t in self.per_tensor_param()}


class _Rollout:
    """One rollout worker: its engine and the model the server adapter would load into."""

    def __init__(self, engine_kwargs: dict) -> None:
        self.model = _model(seed=1)  # starts from other weights than the trainer's
        self.engine = _engine(engine_kwargs)

    def _load(self, model, stream) -> list[str]:
        import torch

        params = dict(model.named_parameters(remove_duplicate=False))

        async def consume() -> list[str]:
            names = []
            async for name, tensor in stream:
                with torch.no_grad():
                    params[name].copy_(tensor)
                names.append(name)
            return names

        return asyncio.run(consume())

    def receive(self, global_steps):
        names = self._load(self.model, self.engine.receive_weights(global_steps))
        return {"names": names, "version": self.engine.version}

    def get_weights(self):
        fresh = _model(seed=2)
        names = self._load(fresh, self.engine.get_weights())
        return {"names": names, "weights": _weights(fresh), "tied": _tied(fresh)}

    def weights(self):
        return _weights(self.model)

    def tied(self) -> bool:
        return _tied(self.model)

    def group(self):
        g = self.engine.group
        return None if g is None else (id(g), g.rank, g.incarnation)


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def _serve(role: str, rank: int, conn, port: int, engine_kwargs: dict) -> None:
    """A worker process: build the trainer or rollout, then run the driver's calls."""
    try:
        worker = (
            _Trainer(rank, port, engine_kwargs) if role == "trainer" else _Rollout(engine_kwargs)
        )
        conn.send(("ok", None))
        while True:
            method, args, *kwargs = conn.recv()
            if method == "exit":
                break
            try:
                target = worker if hasattr(worker, method) else worker.engine
                conn.send(("ok", getattr(target, method)(*args, **dict(*kwargs))))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    conn.close()
    os._exit(0)


def _zygote(specs: list, port: int, engine_kwargs: dict, pids) -> None:
    """Import torch, transformers and verl once, then fork the workers from here (each would
    otherwise pay the imports itself on a host of two cores); join them within the timeout."""
    import multiprocessing

    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import transformers  # noqa: F401
    import verl.checkpoint_engine  # noqa: F401

    import slipstream.integrations.verl  # noqa: F401

    torch.set_num_threads(1)
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_serve, args=(*spec, port, engine_kwargs)) for spec in specs]
    for p in procs:
        p.start()
        pids.put(p.pid)
    for p in procs:
        p.join(TIMEOUT * 4)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


class _Cluster:
    """The worker processes and the driver's side of their pipes; every reply is awaited
    with a timeout naming the worker that did not answer, and every process is joined or
    killed by :meth:`close`."""

    def __init__(self, engine_kwargs: dict) -> None:
        ctx = worker_context()
        self.names = ["trainer0", "trainer1", *ROLLOUTS]
        self.conns, specs = {}, []
        for name in self.names:
            here, there = ctx.Pipe()
            role = "trainer" if name.startswith("trainer") else "rollout"
            specs.append((role, int(name[-1]) if role == "trainer" else 0, there))
            self.conns[name] = here
        self.pids = ctx.SimpleQueue()
        self.zygote = ctx.Process(
            target=_zygote, args=(specs, free_port(), engine_kwargs, self.pids)
        )  # not a daemon: daemons may not have children
        self.zygote.start()
        import verl.checkpoint_engine  # noqa: F401  (the driver's, while the workers start)

        self.gather(self.names, timeout=120)

    def call(self, calls: dict[str, tuple[str, tuple]], timeout: float = TIMEOUT) -> dict:
        for name, call in calls.items():
            self.conns[name].send(call)
        return self.gather(list(calls), timeout)

    def gather(self, names, timeout: float) -> dict:
        out = {}
        deadline = time.monotonic() + timeout
        for name in names:
            while not self.conns[name].poll(0.2):
                if not self.zygote.is_alive():
                    raise AssertionError(f"the workers' parent exited before {name} answered")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{name} did not answer within {timeout} s")
            status, value = self.conns[name].recv()
            if status != "ok":
                raise AssertionError(f"{name} failed:\n{value}")
            out[name] = value
        return out

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(("exit", ()))
            except OSError:
                pass
        self.zygote.join(TIMEOUT)
        if self.zygote.is_alive():  # a worker hangs: kill the workers, then their parent
            while not self.pids.empty():
                try:
                    os.kill(self.pids.get(), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.zygote.kill()
            self.zygote.join(5)


def _update(cluster: _Cluster, rollouts: list[str], global_steps, early=None) -> dict:
    """One ``CheckpointEngineManager.update_weights`` over the trainers and ``rollouts``;
    the ``early`` calls (to workers) run between ``init_process_group`` and the transfer."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    trainers = ["trainer0", "trainer1"]
    workers = trainers + rollouts
    import_external_libs(MODULE)
    cls = CheckpointEngineRegistry.get(BACKEND)
    prepared = cluster.call({w: ("prepare", ()) for w in workers})
    metadata = [prepared[w] for w in workers]
    actor_kwargs, rollout_kwargs = cls.build_topology(len(trainers), len(rollouts), metadata)
    calls = {}
    # the manager dispatches each keyword's list, one entry per worker, by name
    for i, w in enumerate(trainers):
        calls[w] = ("init_process_group", (), {k: v[i] for k, v in actor_kwargs.items()})
    for i, w in enumerate(rollouts):
        calls[w] = ("init_process_group", (), {k: v[i] for k, v in rollout_kwargs.items()})
    cluster.call(calls)
    early = cluster.call(early) if early else None
    calls = {w: ("send", (global_steps,)) for w in trainers}
    calls.update({w: ("receive", (global_steps,)) for w in rollouts})
    results = cluster.call(calls)
    cluster.call({w: ("finalize", ()) for w in workers})
    results["channel"] = actor_kwargs["topology"][0].channel
    results["ranks"] = {w: rollout_kwargs["topology"][i].rank for i, w in enumerate(rollouts)}
    results["world_size"] = actor_kwargs["topology"][0].world_size
    results["early"] = early
    return results


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "mode, local_cache", [("direct", False), ("cached", False), ("cached", True)]
)
def test_verl_manager_sequence_syncs_fsdp2_trainers_to_rollouts_as_they_come_and_go(
    mode, local_cache
):
    kwargs = {"mode": mode, "host": "127.0.0.1", "timeout": TIMEOUT, "local_cache": local_cache}
    cluster = _Cluster(kwargs)
    try:
        # global_steps as verl passes them: 0 at start, a step repeated, None, then on
        steps = [0, 1, 1, None, 2]
        # rollout sets 2 -> 4 -> 1 -> 3 (-> 3): C and D join past the group's first size
        # (ranks 4 and 5 of a group built for 4), three leave, B and C come back
        present = [
            ["rolloutA", "rolloutB"],
            ["rolloutA", "rolloutB", "rolloutC", "rolloutD"],  # add_replicas(C, D)
            ["rolloutA"],  # remove_replicas(B, C, D)
            ["rolloutA", "rolloutB", "rolloutC"],  # add_replicas(B, C): verl appends them
            ["rolloutA", "rolloutB", "rolloutC"],
        ]
        ranks = {"rolloutA": 2, "rolloutB": 3, "rolloutC": 4, "rolloutD": 5}
        groups: dict = {}
        trained: dict = {}
        held_before: dict = {}
        peaks: dict = {}
        for u, global_steps in enumerate(steps):
            cluster.call({t: ("train", (u, mode == "cached")) for t in ("trainer0", "trainer1")})
            rollouts = present[u]
            joining = [r for r in rollouts if r not in groups]
            # cached mode: a joining rollout gets the version in the trainers' caches at
            # once, without a publish (the last one: not what they train now)
            refetch = mode == "cached" and not local_cache and bool(trained)
            early = {r: ("get_weights", ()) for r in joining} if refetch else None
            results = _update(cluster, rollouts, global_steps, early)
            assert results["channel"] == "verl-0"  # one channel throughout
            assert results["world_size"] == (4 if u == 0 else 6)  # grown by C and D
            assert results["ranks"] == {r: ranks[r] for r in rollouts}  # kept by each
            if results["early"] is not None:
                assert joining and set(results["early"]) == set(joining)
                for r, got in results["early"].items():
                    assert _equal(got["weights"], trained), f"update {u}: {r}'s refetch"
            versions = {results[r]["version"] for r in rollouts}
            assert versions == {u}, (u, versions)  # 0, 1, then the next number: 2, 3, 4
            for t in ("trainer0", "trainer1"):
                sent = results[t]
                assert sent["metrics"]["slipstream/version"] == u
                # every update streams verl's generator, the first too (its buckets carry
                # the layout): a few buckets of tensors alive at once, never the model;
                # cached mode's first update reads it whole (its snapshot needs the plan)
                if mode == "cached" and u == 0:
                    assert sent["peak_alive"] == sent["model_bytes"], sent
                else:
                    assert sent["peak_alive"] <= 4 * BUCKET + sent["largest"], (u, sent)
                    assert sent["peak_alive"] < sent["model_bytes"] / 2, (u, sent)
                    peaks.setdefault(t, []).append(sent["peak_alive"])
                # every tensor changed at every update, so only deltas send fewer bytes: they
                # go once every rollout of the update received the previous version into its
                # local cache; the trainers kept their base through the set's changes, so
                # update 2 (A alone, which held update 1) goes as deltas, and update 4 (the
                # set of update 3 again) too
                sent_bytes = sent["metrics"]["slipstream/sent_bytes"]
                dense = sent["metrics"]["slipstream/dense_bytes"]
                if local_cache and u in (2, 4):
                    assert sent_bytes < dense / 2, (u, sent)
                else:
                    assert sent_bytes == dense, (u, sent)
            reference = cluster.call({t: ("weights", ()) for t in ("trainer0", "trainer1")})
            trained = reference["trainer0"]
            assert _equal(trained, reference["trainer1"])
            held = cluster.call(
                {r: ("weights", ()) for r in ROLLOUTS if r in groups or r in rollouts}
            )
            for r in rollouts:
                assert _equal(held[r], trained), f"update {u}: {r} differs from the trainer"
            for r in held.keys() - set(rollouts):  # left out: untouched, its last version
                assert _equal(held[r], held_before[r]), f"update {u}: {r} was changed"
            held_before = held
            tied = cluster.call({r: ("tied", ()) for r in rollouts})
            assert all(tied.values())  # the rollout's tie is kept
            for r, g in cluster.call({r: ("group", ()) for r in rollouts}).items():
                groups.setdefault(r, g)
                assert g == groups[r], f"{r}'s sync group was rebuilt"  # built once, reused

        if mode == "direct":  # the first update holds no more than a later one (a bucket)
            for t, (first, *later) in peaks.items():
                assert first <= max(later) + BUCKET, (t, peaks)
        if mode == "cached":
            # get_weights: the last version published, from the trainers' caches (or the
            # rollout's local cache), without a publish; the trainers have trained on since,
            # so it is update 4's weights, not theirs now
            cluster.call({t: ("train", (99,)) for t in ("trainer0", "trainer1")})
            now = cluster.call({t: ("weights", ()) for t in ("trainer0", "trainer1")})
            got = cluster.call({"rolloutA": ("get_weights", ())})["rolloutA"]
            assert _equal(got["weights"], trained) and got["tied"]
            assert not _equal(got["weights"], now["trainer0"])
            assert set(got["names"]) >= {"lm_head.weight", "model.embed_tokens.weight"}
        else:
            with pytest.raises(AssertionError, match="direct mode"):
                cluster.call({"rolloutA": ("get_weights", ())})
        closing = {w: ("close", ()) for w in cluster.names}
        cluster.call(closing)
    finally:
        cluster.close()


def test_ranks_are_kept_the_group_grows_and_the_channel_stays():
    from slipstream.integrations.verl import GroupState, assign

    state = GroupState("127.0.0.1", 1234)

    def update(rollouts: list[str]):
        nonlocal state
        state = assign(state, 2, rollouts)
        return {r: state.rank_of(r) for r in rollouts}, state.world_size, state.epoch

    assert update(["a", "b"]) == ({"a": 2, "b": 3}, 4, 0)
    assert update(["b", "a"]) == ({"b": 3, "a": 2}, 4, 0)  # the order does not matter
    assert update(["a"]) == ({"a": 2}, 4, 1)  # b removed: a new set
    # a new engine (b's actor restarted by Ray) takes the rank no present rollout holds
    assert update(["a", "c"]) == ({"a": 2, "c": 3}, 4, 2)
    # more rollouts than ever: the new ones take ranks past the group's size, which grows
    assert update(["a", "b", "c", "d"]) == ({"a": 2, "b": 4, "c": 3, "d": 5}, 6, 3)
    assert update(["d"]) == ({"d": 5}, 6, 4)
    assert update(["c", "b", "e"]) == ({"c": 3, "b": 4, "e": 2}, 6, 5)  # e takes absent a's
    assert state.channel == "verl-0"  # one channel throughout
    with pytest.raises(ValueError, match="built for 2 trainer"):
        assign(state, 1, ["b"])
    with pytest.raises(ValueError, match="twice"):
        assign(state, 2, ["b", "b"])


def test_build_topology_needs_the_master_engine_first():
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    cls = CheckpointEngineRegistry.get(BACKEND)
    master = cls(bucket_size=BUCKET, is_master=True, host="127.0.0.1")
    rollout = cls(bucket_size=BUCKET)
    actor, rollouts = cls.build_topology(1, 1, [master.prepare(), rollout.prepare()])
    (mine,), (theirs,) = actor["topology"], rollouts["topology"]
    assert (mine.rank, theirs.rank, mine.world_size, mine.host) == (0, 1, 2, "127.0.0.1")
    assert master.prepare().group.port == mine.port  # the address is picked once
    with pytest.raises(ValueError, match="is_master=True"):
        cls.build_topology(1, 1, [rollout.prepare(), master.prepare()])
