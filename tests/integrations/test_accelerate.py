"""``SlipstreamAccelerator.save_state`` writes accelerate's own files: exactly the set a
plain ``Accelerator`` writes for the same objects, which a plain ``Accelerator`` loads in a
process where slipstream cannot be imported, giving back bit for bit the state at the
``save_state`` call (the state moved on while the write went on in the background); a
directory a plain ``Accelerator`` wrote loads into a ``SlipstreamAccelerator``; training
after a round trip continues as the uninterrupted run did; rotation keeps only finished
checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from accelerate_plain_load import build, load_without_slipstream, state_of, train
from same_tree import assert_same_tree

from slipstream import CheckpointError
from slipstream.integrations.accelerate import SlipstreamAccelerator

pytestmark = pytest.mark.timeout(180)


def _plain_listing(directory: Path, safe_serialization: bool) -> list[str]:
    """What a plain ``Accelerator`` writes for the objects :func:`build` makes, trained."""
    plain = Accelerator(cpu=True)
    objects = build(plain)
    train(plain, *objects, steps=1)
    plain.save_state(str(directory), safe_serialization=safe_serialization)
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_a_plain_accelerator_without_slipstream_loads_the_state_at_the_save(
    tmp_path: Path, safe_serialization: bool
) -> None:
    accelerator = SlipstreamAccelerator(cpu=True, background_write=True)
    objects = build(accelerator)
    train(accelerator, *objects, steps=3)
    at_save = state_of(accelerator, *objects)
    path = accelerator.save_state(str(tmp_path / "ckpt"), safe_serialization=safe_serialization)
    train(accelerator, *objects, steps=2)  # everything saved moves on during the write
    assert accelerator.step == 5
    accelerator.wait_for_checkpoints()

    assert sorted(os.listdir(path)) == _plain_listing(tmp_path / "plain", safe_serialization)
    loaded = load_without_slipstream(str(path), str(tmp_path / "loaded.pt"))
    assert_same_tree(at_save, loaded)
    assert loaded["step"] == 3 and loaded["counter"]["seen"] == 3


def test_round_trip_continues_training_as_the_uninterrupted_run(tmp_path: Path) -> None:
    accelerator = SlipstreamAccelerator(cpu=True, background_write=True)
    objects = build(accelerator)
    train(accelerator, *objects, steps=3)
    path = accelerator.save_state(str(tmp_path / "ckpt"))
    losses_after = train(accelerator, *objects, steps=4)
    expected = state_of(accelerator, *objects)
    accelerator.end_training()

    fresh = SlipstreamAccelerator(cpu=True)
    restored = build(fresh)
    fresh.load_state(str(path))
    assert fresh.step == 3 and restored[3].seen == 3
    assert train(fresh, *restored, steps=4) == losses_after
    assert_same_tree(expected, state_of(fresh, *restored))


def test_a_directory_a_plain_accelerator_wrote_loads(tmp_path: Path) -> None:
    plain = Accelerator(cpu=True)
    objects = build(plain)
    train(plain, *objects, steps=2)
    plain.save_state(str(tmp_path / "plain"))
    expected = state_of(plain, *objects)

    accelerator = SlipstreamAccelerator(cpu=True)
    restored = build(accelerator)
    accelerator.load_state(str(tmp_path / "plain"))
    assert_same_tree(expected, state_of(accelerator, *restored))


def test_automatic_naming_rotates_only_finished_checkpoints(tmp_path: Path) -> None:
    """Every save is still being written when the next one starts: rotation must wait for
    it before deleting, and the last two, each complete, remain."""
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = SlipstreamAccelerator(cpu=True, project_config=config, background_write=True)
    objects = build(accelerator)
    for _ in range(4):
        train(accelerator, *objects, steps=1)
        expected = state_of(accelerator, *objects)
        accelerator.save_state()
    accelerator.end_training()
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]
    listing = _plain_listing(tmp_path / "plain", safe_serialization=True)
    for name in os.listdir(root):
        assert sorted(os.listdir(root / name)) == listing, name

    fresh = SlipstreamAccelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True
        ),
    )
    restored = build(fresh)
    fresh.load_state()  # the newest
    assert_same_tree(expected, state_of(fresh, *restored))


def test_a_save_into_a_directory_that_holds_files_leaves_them(tmp_path: Path) -> None:
    """As accelerate's: files already in ``output_dir`` stay; the save's files replace
    their names, each whole."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "optimizer.bin").write_text("an older save's")
    accelerator = SlipstreamAccelerator(cpu=True)
    objects = build(accelerator)
    train(accelerator, *objects, steps=1)
    expected = state_of(accelerator, *objects)
    accelerator.save_state(str(out))
    listing = _plain_listing(tmp_path / "plain", safe_serialization=True)
    assert sorted(os.listdir(out)) == sorted([*listing, "notes.txt"])
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["out", "plain"]  # no hidden directory left
    loaded = load_without_slipstream(str(out), str(tmp_path / "loaded.pt"))
    assert_same_tree(expected, loaded)


class Unpicklable:
    """A registered object whose state ``torch.save`` cannot write."""

    def state_dict(self) -> dict[str, Any]:
        return {"call": lambda: 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("background_write", [False, True], ids=["default", "background"])
def test_a_failed_write_raises_and_leaves_nothing(tmp_path: Path, background_write: bool) -> None:
    accelerator = SlipstreamAccelerator(cpu=True, background_write=background_write)
    accelerator.register_for_checkpointing(Unpicklable())
    accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="save_state to .*ckpt failed"):
        accelerator.save_state(str(tmp_path / "ckpt"))
        accelerator.wait_for_checkpoints()  # where the write goes on in the background
    assert os.listdir(tmp_path) == []  # nothing under the name, no hidden directory left
    accelerator.wait_for_checkpoints()  # the failure was raised once


def _two_processes(rank: int, world_size: int, root: str) -> None:
    """Each process saves with a ``SlipstreamAccelerator`` in the background, moves on,
    then loads the checkpoint with a plain ``Accelerator``: its state at the save."""
    from dist_utils import free_port

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),  # unused: the process group is already up
    )
    accelerator = SlipstreamAccelerator(cpu=True, background_write=True)
    assert accelerator.num_processes == world_size
    objects = build(accelerator)
    torch.manual_seed(10 + rank)  # each process's generators differ
    train(accelerator, *objects, steps=2)
    at_save = state_of(accelerator, *objects)
    path = accelerator.save_state(os.path.join(root, "slipstream"))
    train(accelerator, *objects, steps=2)
    accelerator.wait_for_checkpoints()  # on every process (end_training ends the group)

    plain = Accelerator(cpu=True)
    train(plain, *build(plain), steps=1)
    plain.save_state(os.path.join(root, "plain"))
    plain.wait_for_everyone()
    assert sorted(os.listdir(path)) == sorted(os.listdir(os.path.join(root, "plain")))
    assert f"random_states_{rank}.pkl" in os.listdir(path)
    reader = Accelerator(cpu=True)
    restored = build(reader)
    reader.load_state(str(path))
    loaded = state_of(reader, *restored)
    if rank != 0:  # as accelerate's: a registered object's state is the main process's
        assert loaded.pop("counter")["seen"] == at_save.pop("counter")["seen"]
    assert_same_tree(at_save, loaded, f"rank {rank}")


def test_two_processes_write_one_directory_a_plain_accelerator_loads(tmp_path: Path) -> None:
    from dist_utils import run_workers

    run_workers(_two_processes, 2, str(tmp_path), timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["plain", "slipstream"]  # none hidden left
