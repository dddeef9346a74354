"""torchtitan 0.3.0's real ``CheckpointManager`` with its module's ``dcp`` bound to
``slipstream.dcp``, nothing else changed, on 2 gloo ranks.

Each mode trains 4 steps saving every 2, then new processes resume from the latest
checkpoint and train 4 more; the final weights must equal, bit for bit, those of one run of
8 steps that never stopped. The state is torchtitan's own: its ``ModelWrapper``, its
``OptimizersContainer`` (AdamW, FQN-flattened state) and ``LRSchedulersContainer``
(warmup), and a dataloader-like ``Stateful`` that saves one key per data-parallel rank
as torchtitan's ``ParallelAwareDataloader`` does (so each rank's resume meets a key it did
not ask for). ``async_with_pinned_mem`` runs the call as torchtitan makes it, with a stager
without pinned memory set up front (pinned memory needs an accelerator).
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

STEPS = 8
INTERRUPTED_AT = 4
FEATURES = 8


class _Data(Stateful):
    """A data stream per rank that resumes where it stopped; its state has one key per
    data-parallel rank, as torchtitan's ``ParallelAwareDataloader``'s has."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.position = rank, world_size, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * self.rank + self.position)
        self.position += 1
        inputs = torch.randn(4, FEATURES, generator=generator)
        return inputs, inputs.sum(dim=1, keepdim=True)

    def state_dict(self) -> dict:
        return {
            f"dp_rank_{self.rank}": pickle.dumps({"position": self.position}),
            "world_size": self.world_size,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        assert state_dict["world_size"] == self.world_size
        self.position = pickle.loads(state_dict[f"dp_rank_{self.rank}"])["position"]


class _TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])


def _train(
    rank: int,
    world_size: int,
    folder: str,
    mode: str,
    stop: int,
    out: str,
    interval: int = 2,
    before_first_step: bool = False,
    swap: bool = True,
    config: dict | None = None,
) -> None:
    """Trains to step ``stop`` saving every ``interval`` steps (``mode="none"``: never),
    and at step 0, before the first optimizer step, with ``before_first_step``; ``swap``
    binds torchtitan's ``dcp`` to ``slipstream.dcp`` (without it: DCP's own); ``config``
    sets further fields of torchtitan's ``CheckpointManager.Config``."""
    import torchtitan.components.checkpointer.dcp as titan
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    import slipstream.dcp

    if swap:
        titan.dcp = slipstream.dcp  # the one change: the module's DCP is slipstream's

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01}
                )
            ],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=STEPS
    )
    data, train_state = _Data(rank, world_size), _TrainState()
    manager = None
    if mode != "none":
        fields = dict(
            enable=True,
            folder="checkpoint",
            interval=interval,
            async_mode=mode,
            keep_latest_k=0,
            last_save_model_only=False,
        )
        manager = titan.CheckpointManager(
            titan.CheckpointManager.Config(**{**fields, **(config or {})}),
            dataloader=data,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={"train_state": train_state},
            sd_adapter=None,
            base_folder=folder,
        )
        if mode == "async_with_pinned_mem":
            # torchtitan makes a pinned, shared-memory stager on its first save; on a CPU
            # machine the same call gets one that stages on its thread without pinning.
            manager.stager = DefaultStager(StagingOptions(False, False, True, False))
        manager.load()
    resumed_at = train_state.step
    try:
        if manager is not None and before_first_step:
            manager.save(0)
            manager.maybe_wait_for_staging()
        while train_state.step < stop:
            train_state.step += 1
            inputs, targets = data.next_batch()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            if manager is not None:
                manager.save(train_state.step, last_step=train_state.step == STEPS)
                # torchtitan's trainer waits for staging before the next step's update
                manager.maybe_wait_for_staging()
        if manager is not None:
            manager.maybe_wait_for_saving()
    finally:
        if manager is not None:
            manager.close()
    if rank == 0:
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = [o.state_dict() for o in optimizers.optimizers]
        result = {"weights": weights, "optimizer": optimizer, "resumed_at": resumed_at}
        torch.save(result, out)


@pytest.fixture(scope="module")
def unsaved(tmp_path_factory) -> dict:
    """The run of ``STEPS`` steps that never saved: its weights and optimizer state."""
    root = tmp_path_factory.mktemp("reference")
    out = str(root / "weights.pt")
    run_workers(_train, 2, str(root), "none", STEPS, out, timeout=120)
    return torch.load(out)


@pytest.fixture(scope="module")
def uninterrupted(unsaved) -> dict:
    return unsaved["weights"]


def _assert_same_run(a: dict, b: dict) -> None:
    """Equal weights and optimizer states (every tensor bit for bit, param groups)."""
    assert a["weights"].keys() == b["weights"].keys()
    for name, tensor in a["weights"].items():
        assert torch.equal(tensor, b["weights"][name]), name
    assert len(a["optimizer"]) == len(b["optimizer"])
    for sa, sb in zip(a["optimizer"], b["optimizer"], strict=True):
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for idx, state in sa["state"].items():
            assert state.keys() == sb["state"][idx].keys()
            for key, value in state.items():
                assert torch.equal(value, sb["state"][idx][key]), (idx, key)


def _run(
    tmp_path,
    name: str,
    before_first_step: bool = False,
    swap: bool = True,
    mode: str = "async",
    **config,
) -> dict:
    """8 steps saving after each (and before the first, if asked)."""
    out = str(tmp_path / f"{name}.pt")
    folder = str(tmp_path / name)
    args = (folder, mode, STEPS, out, 1, before_first_step, swap, config)
    run_workers(_train, 2, *args, timeout=120)
    return torch.load(out)


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_resume_from_latest_matches_an_uninterrupted_run(tmp_path, uninterrupted, mode):
    first = str(tmp_path / "first.pt")
    run_workers(_train, 2, str(tmp_path), mode, INTERRUPTED_AT, first, timeout=120)
    saved = sorted(os.listdir(tmp_path / "checkpoint"))
    assert saved == ["step-2", "step-4"], saved
    assert os.path.exists(tmp_path / "checkpoint" / "step-4" / ".slipstream.json")
    final = str(tmp_path / "final.pt")
    run_workers(_train, 2, str(tmp_path), mode, STEPS, final, timeout=120)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4", "step-6", "step-8"]
    got, interrupted = torch.load(final), torch.load(first)["weights"]
    assert got["resumed_at"] == INTERRUPTED_AT, "the new processes did not resume"
    assert any(not torch.equal(interrupted[k], uninterrupted[k]) for k in uninterrupted)
    for name, want in uninterrupted.items():
        assert torch.equal(got["weights"][name], want), name


def test_saves_after_every_step_change_nothing(tmp_path, unsaved):
    """Saved (asynchronously) after every one of 8 steps, the run ends with the weights and
    the optimizer state of the run that never saved, bit for bit."""
    saved = _run(tmp_path, "every")
    _assert_same_run(saved, unsaved)
    assert sorted(os.listdir(tmp_path / "every" / "checkpoint")) == [
        f"step-{s}" for s in range(1, STEPS + 1)
    ]


def test_a_save_before_the_first_step_changes_the_run_as_with_dcp_itself(tmp_path, unsaved):
    """torchtitan's ``OptimizersContainer.state_dict()`` creates the state of an optimizer
    that never stepped with a zero-lr step (its documented side effect), which counts as
    AdamW's first step: a save at step 0 changes the run whatever writes it. Through
    slipstream.dcp the run saved at step 0 and after every step ends bit for bit where the
    same run through DCP itself ends: slipstream adds no change of its own."""
    ours = _run(tmp_path, "slipstream", before_first_step=True)
    theirs = _run(tmp_path, "dcp", before_first_step=True, swap=False)
    _assert_same_run(ours, theirs)
    steps = {float(s["step"]) for o in ours["optimizer"] for s in o["state"].values()}
    assert steps == {STEPS + 1.0}  # one step more than the unsaved run's
    assert {float(s["step"]) for o in unsaved["optimizer"] for s in o["state"].values()} == {
        float(STEPS)
    }
    assert "step-0" in os.listdir(tmp_path / "slipstream" / "checkpoint")


def test_keeps_the_latest_k_and_a_model_only_last_step_loads_as_initial_weights(tmp_path):
    """torchtitan's ``test_save_and_purge_keeps_last_k_checkpoints`` and
    ``test_last_save_model_only_and_initial_load_model_only``, through slipstream.dcp on
    real state: ``keep_latest_k=2`` leaves what DCP itself leaves; the last step, saved model
    only, holds the weights and nothing else, and a new run given it as
    ``initial_load_path`` (model only) starts from those weights at step 0."""
    # Saved synchronously: torchtitan lists the folder to purge right after each save,
    # where an asynchronous one may not have made its directory yet (with DCP alike).
    config = dict(keep_latest_k=2, last_save_model_only=True)
    first = _run(tmp_path, "first", mode="disabled", **config)
    _run(tmp_path, "dcp", swap=False, mode="disabled", **config)
    folder = tmp_path / "first" / "checkpoint"
    kept = sorted(os.listdir(folder))
    assert kept == sorted(os.listdir(tmp_path / "dcp" / "checkpoint"))
    # The last step is saved with no purge after it: torchtitan leaves k + 1.
    assert kept == ["step-6", "step-7", "step-8"]
    keys = _saved_keys(folder / "step-8")
    assert keys == set(first["weights"]), keys
    assert any(k.startswith("optimizer") for k in _saved_keys(folder / "step-7"))

    initial = str(folder / "step-8")
    out = str(tmp_path / "second.pt")
    config = dict(initial_load_path=initial, initial_load_model_only=True)
    args = (str(tmp_path / "second"), "disabled", 0, out, 1, False, True, config)
    run_workers(_train, 2, *args, timeout=120)
    second = torch.load(out)
    assert second["resumed_at"] == 0
    for name, want in first["weights"].items():
        assert torch.equal(second["weights"][name], want), name


def _saved_keys(path) -> set[str]:
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
