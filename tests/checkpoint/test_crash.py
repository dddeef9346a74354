"""A process saving every step and killed with SIGKILL at random points never leaves a
checkpoint that is listed but does not load and verify.

Each trial forks a saver (from the preloaded forkserver, so a trial costs milliseconds
of start-up), lets it save for a seeded random time, kills it, then checks from the test
process: every committed step, ``latest()`` first, loads, passes every checksum and holds
exactly what that step saved. The next run resumes after ``latest()`` and its first save
removes the directories the killed run left behind.
"""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_utils import run_workers, worker_context
from fault_storage import FaultStorage

import slipstream as ss
from slipstream.checkpoint.format.names import METADATA_FILE
from slipstream.checkpoint.load.contents import read_all
from slipstream.checkpoint.save import saver as saver_module
from slipstream.checkpoint.storage import LocalStorage

TRIALS = 8
SEED = 1234
SHAPES = {"a": (1024, 1024), "b": (512, 1024), "c": (3, 7)}


def step_state(step: int) -> dict:
    """What step ``step`` saves: every element depends on the step and its position."""
    tensors = {
        name: torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + step * 1000
        for name, (rows, cols) in SHAPES.items()
    }
    return {"model": tensors, "step": step, "note": f"step {step}"}


def save_until_killed(root: str, started) -> None:
    """Save step after step (resuming after the latest commit) until killed."""
    torch.set_num_threads(1)
    ck = ss.Checkpointer(root, keep_last=2)
    step = (ck.latest() or 0) + 1
    started.set()
    while True:
        ck.save(step, step_state(step)).staging_completion.result(60)
        step += 1


def _uncommitted(root) -> set[str]:
    return {
        entry.name
        for entry in os.scandir(root)
        if entry.is_dir() and not os.path.exists(os.path.join(entry.path, METADATA_FILE))
    }


def _check_committed_steps(root) -> list[int]:
    with ss.Checkpointer(root) as ck:
        steps = ck.steps()
        for step in reversed(steps):
            flat = read_all(ck.path(step))
            want = step_state(step)
            assert flat["step"] == step and flat["note"] == f"step {step}"
            for name, tensor in want["model"].items():
                assert torch.equal(flat[f"model.{name}"], tensor), (step, name)
    return steps


def test_sigkill_during_repeated_saves_always_leaves_latest_loadable_and_verified(tmp_path):
    ctx = worker_context()
    rng = random.Random(SEED)
    latest_seen: list[int] = []
    killed_mid_save = 0
    for _ in range(TRIALS):
        started = ctx.Event()
        proc = ctx.Process(target=save_until_killed, args=(str(tmp_path), started), daemon=True)
        proc.start()
        try:
            assert started.wait(60), "the saving process did not start"
            time.sleep(rng.uniform(0.05, 0.6))
        finally:
            proc.kill()
            proc.join(10)
        assert proc.exitcode == -9
        killed_mid_save += bool(_uncommitted(tmp_path))
        steps = _check_committed_steps(tmp_path)
        # keep_last=2, plus one when the kill fell between a commit and its retention.
        assert len(steps) <= 3
        if steps:
            assert not latest_seen or steps[-1] >= latest_seen[-1]
            latest_seen.append(steps[-1])
    assert latest_seen and latest_seen[-1] > 1, "no save ever committed"
    assert killed_mid_save > 0, "no kill landed in the middle of a save"

    leftovers = _uncommitted(tmp_path)
    with ss.Checkpointer(tmp_path, keep_last=2) as ck:
        resume = ck.latest() + 1
        ck.save(resume, step_state(resume)).result(60)
        assert ck.steps()[-2:] == [resume - 1, resume] and len(ck.steps()) == 2
    assert not (leftovers - {f"step_{resume}"}) & set(os.listdir(tmp_path))
    assert _uncommitted(tmp_path) == set()


def _overwrite_same_path(rank: int, world: int, root: str) -> None:
    store = dist.distributed_c10d._get_default_store()
    path = os.path.join(root, "ck")
    state = {f"own{rank}": torch.full((1000,), float(rank))}
    saver = saver_module.CheckpointSaver()
    try:
        saver.save(state, path).result(30)
        target = path
        if rank == 1:

            def first_write_loads_the_old_checkpoint(writer, name, start, end):
                if store.check(["test/old_during_write"]):
                    return
                old = {"own0": torch.zeros(1000), "own1": torch.zeros(1000)}
                try:
                    ss.load(old, path, no_dist=True)  # a reader of its own, not the group
                    seen = f"{old['own0'][0].item()},{old['own1'][0].item()}"
                except ss.CheckpointError as exc:
                    seen = f"error: {exc}"
                store.set("test/old_during_write", seen)

            target = FaultStorage(LocalStorage(path))
            target.faults.hook("write", first_write_loads_the_old_checkpoint)
        else:
            store.wait(["test/old_during_write"], timedelta(seconds=30))
        state[f"own{rank}"].add_(10)
        saver.save(state, target).result(30)
        assert store.get("test/old_during_write") == b"0.0,1.0"
    finally:
        saver.close()


def test_overwriting_a_checkpoint_keeps_the_old_one_loadable_until_the_new_one_commits(tmp_path):
    run_workers(_overwrite_same_path, 2, str(tmp_path), timeout=60)
    target = {"own0": torch.zeros(1000), "own1": torch.zeros(1000)}
    ss.load(target, tmp_path / "ck")
    assert torch.equal(target["own0"], torch.full((1000,), 10.0))
    assert torch.equal(target["own1"], torch.full((1000,), 11.0))
    # the old checkpoint's files went once the new one committed
    assert sorted(os.listdir(tmp_path / "ck")) == [
        ".metadata",
        ".slipstream.g1.json",
        "__0_0.g1.distcp",
        "__1_0.g1.distcp",
    ]
