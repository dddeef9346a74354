"""Plan caching and rank coordination: behaviour that needs slipstream's internals."""

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, run_workers, worker_context

import slipstream as ss
from slipstream.checkpoint import CheckpointSaver, SaveOptions


def test_plan_is_made_once_per_layout(tmp_path):
    saver = CheckpointSaver()
    try:
        state = {"w": torch.randn(64, 8), "step": 1}
        for i in range(3):
            state["w"].add_(1)
            saver.save(state, tmp_path / f"a{i}").upload_completion.result(30)
        assert saver.plans_made == 1
        state["extra"] = torch.zeros(3)
        saver.save(state, tmp_path / "b").upload_completion.result(30)
        assert saver.plans_made == 2
        loaded = {"w": torch.zeros(64, 8), "step": 0, "extra": torch.ones(3)}
        ss.load(loaded, tmp_path / "b")
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["extra"], torch.zeros(3))
    finally:
        saver.close()


def _repeated_saves(rank, world_size, root):
    saver = CheckpointSaver()
    try:
        state = {"shared": torch.arange(1000.0), "own": torch.full((10,), float(rank))}
        state = {"shared": state["shared"], f"rank{rank}": state["own"]}
        for i in range(3):
            saver.save(state, os.path.join(root, f"s{i}")).upload_completion.result(30)
        assert saver.plans_made == 1, saver.plans_made
    finally:
        saver.close()


def test_two_ranks_plan_once_and_spread_replicated_writes(tmp_path):
    run_workers(_repeated_saves, 2, str(tmp_path))
    files = sorted(os.listdir(tmp_path / "s2"))
    assert files == [".metadata", ".slipstream.json", "__0_0.distcp", "__1_0.distcp"]
    loaded = {"shared": torch.zeros(1000), "rank0": torch.ones(10), "rank1": torch.zeros(10)}
    ss.load(loaded, tmp_path / "s2")
    assert torch.equal(loaded["shared"], torch.arange(1000.0))
    assert torch.equal(loaded["rank0"], torch.zeros(10))
    assert torch.equal(loaded["rank1"], torch.ones(10))


def _save_where_rank1_dies(rank, world_size, port, root, results):
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=30),
        )
        saver = CheckpointSaver(options=SaveOptions(timeout=3.0))
        state = {"w": torch.full((1000,), float(rank)), f"r{rank}": torch.zeros(4)}
        saver.save(state, os.path.join(root, "first")).upload_completion.result(30)
        if rank == 1:
            os._exit(17)
        response = saver.save(state, os.path.join(root, "second"))
        try:
            response.upload_completion.result(30)
            results.put((rank, "committed"))
        except ss.PeerTimeoutError as exc:
            results.put((rank, f"timeout: {exc}"))
        saver.close()
    except BaseException:
        results.put((rank, traceback.format_exc()))
    os._exit(0)


def test_rank_dying_mid_save_is_named_and_nothing_commits(tmp_path):
    ctx = worker_context()
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_save_where_rank1_dies, args=(r, 2, port, str(tmp_path), results))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert procs[1].exitcode == 17
    rank, outcome = results.get()
    assert rank == 0
    assert outcome.startswith("timeout:"), outcome
    assert "rank(s) [1]" in outcome
    assert (tmp_path / "first" / ".metadata").is_file()
    assert not (tmp_path / "second" / ".metadata").exists()


def test_saver_rejects_use_after_close(tmp_path):
    saver = CheckpointSaver()
    saver.close()
    with pytest.raises(ss.CheckpointError, match="closed"):
        saver.save({"w": torch.zeros(1)}, tmp_path / "x")


def test_async_save_coordinates_through_a_recreated_process_groups_store(tmp_path):
    for i in range(2):
        store = dist.TCPStore(
            "127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=10)
        )
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            before = store.num_keys()
            ss.save({"w": torch.full((4,), float(i))}, tmp_path / f"c{i}", timeout=10)
            # a save coordinated through a destroyed group's store would leave this one as
            # it was
            assert store.num_keys() > before, f"save {i} did not use the live group's store"
        finally:
            dist.destroy_process_group()
    loaded = {"w": torch.zeros(4)}
    ss.load(loaded, tmp_path / "c1")
    assert torch.equal(loaded["w"], torch.ones(4))
