"""Every crash leaves a resumable run, in every integration.

Each test runs one integration's training loop, saving every step, and kills it with
SIGKILL at a random point of a save in flight (after a random number of saves, a random
delay later), 20 seeded times; each next run resumes through the integration's own resume
path (``Checkpointer.latest()``, ``load_state()``, ``resume_from_checkpoint=True``,
``ckpt_path="last"``, torchtitan's ``CheckpointManager.load()``). Every resume must load a
complete checkpoint whose state equals, bit for bit, an uninterrupted run's at that step,
and every run that reaches the end must end bit-exact with it (see ``crash_harness``). At
the end, nothing a crash left may remain in the run's directory (the sweeps at start).
"""

from __future__ import annotations

import os

import pytest
import torch
from crash_harness import Zygote, crash_trials, state_digest
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRIALS = 20
STEPS = 12
MAX_DELAY = 0.03
"""Seconds after a save call returns within which the kill lands: its write is in flight
for part of that (the tests check that some kills cut a save short)."""
WIDTH = 256


_ZYGOTE_MODULES = {
    "checkpointer": ["slipstream"],
    "accelerate": ["accelerate", "slipstream.integrations.accelerate"],
    "lightning": ["lightning.pytorch", "slipstream.integrations.lightning"],
    "transformers": ["transformers", "slipstream.integrations.transformers"],
    "torchtitan": ["torchtitan.components.checkpointer.dcp", "slipstream.dcp"],
}


@pytest.fixture
def zygote(request):
    """A zygote with the test's framework imported (one framework each: a fork copies
    whatever threads an import started, so none shares one with another framework)."""
    z = Zygote(["torch", *_ZYGOTE_MODULES[request.param], "crash_harness", "test_crash_anywhere"])
    yield z
    z.close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, WIDTH, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _leftovers(root: str) -> list[str]:
    """What a crash leaves that a start must sweep, anywhere under ``root``."""
    found = []
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            if ".removing-" in name or ".saving-" in name or name.endswith(".tmp"):
                found.append(os.path.join(parent, name))
    return found


# -- Checkpointer ------------------------------------------------------------------------


def _checkpointer_run(report, root: str, steps: int, local: bool = False) -> None:
    from slipstream import Checkpointer, LocalTier

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tier = LocalTier(root=os.path.join(root, "local"), replicas=0, keep_last=2) if local else None
    ckpt = Checkpointer(
        os.path.join(root, "durable"),
        keep_last=2,
        local_tier=tier,
        durable_every=3 if local else 1,
    )
    step = ckpt.latest()
    if step is None:
        report("resumed", 0, None, None, False)
        step = 0
    else:
        target = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
        ckpt.load(target, step)
        set_state_dict(
            model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"]
        )
        if ckpt.last_load_tier == "durable":
            where = ckpt.path(step)
            complete = os.path.isfile(os.path.join(where, ".metadata"))
        else:
            where = os.path.join(root, "local", f"step_{step}")
            complete = os.path.isfile(os.path.join(where, ".local_commit"))
        report("resumed", step, state_digest(model, optimizer), where, complete)
    for s in range(step + 1, steps + 1):
        _train_step(model, optimizer, s)
        report("step", s, state_digest(model, optimizer))
        response = ckpt.save(
            s, dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
        )
        response.staging_completion.result(60)  # the next step may change the state
        report("saved", s)
    ckpt.wait()
    ckpt.close()
    report("done", state_digest(model, optimizer))


def _checkpointer_local_run(report, root: str, steps: int) -> None:
    _checkpointer_run(report, root, steps, local=True)


def _step_dirs(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    return [os.path.join(path, n) for n in os.listdir(path) if n.startswith("step_")]


@pytest.mark.parametrize("zygote", ["checkpointer"], indirect=True)
@pytest.mark.parametrize("local", [False, True], ids=["durable", "local_tier"])
def test_checkpointer_resumes_from_a_complete_step_after_any_kill(tmp_path, zygote, local):
    def cut_short(root: str) -> bool:
        durable = _step_dirs(os.path.join(root, "durable"))
        local_steps = _step_dirs(os.path.join(root, "local"))
        return any(not os.path.isfile(os.path.join(d, ".metadata")) for d in durable) or any(
            not os.path.isfile(os.path.join(d, ".local_commit")) for d in local_steps
        )

    fn = _checkpointer_local_run if local else _checkpointer_run
    report = crash_trials(
        zygote,
        fn,
        str(tmp_path),
        STEPS,
        trials=TRIALS,
        seed=1,
        cut_short=cut_short,
        max_delay=MAX_DELAY,
    )
    assert report.cut_short > 0, report
    assert report.resumed_at, report
    for chain in range(report.chains):
        root = str(tmp_path / f"chain{chain}")
        assert _leftovers(root) == []
        if local:  # the last run's start swept the local steps its predecessors cut short
            for d in _step_dirs(os.path.join(root, "local")):
                assert os.path.isfile(os.path.join(d, ".local_commit")), d


def _run_crash_trials(zygote, fn, tmp_path, seed: int, cut_short) -> None:
    report = crash_trials(
        zygote,
        fn,
        str(tmp_path),
        STEPS,
        trials=TRIALS,
        seed=seed,
        cut_short=cut_short,
        max_delay=MAX_DELAY,
    )
    assert report.cut_short > 0, report
    assert report.resumed_at, report
    for chain in range(report.chains):
        assert _leftovers(str(tmp_path / f"chain{chain}")) == []


def _incomplete_under(directory: str) -> bool:
    """Whether a step directory under ``directory`` is a DCP save cut short: data files and
    no ``.metadata``."""
    if not os.path.isdir(directory):
        return False
    for name in os.listdir(directory):
        step = os.path.join(directory, name)
        if os.path.isdir(step) and not os.path.isfile(os.path.join(step, ".metadata")):
            if any(f.endswith(".distcp") for f in os.listdir(step)):
                return True
    return False


# -- accelerate --------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


_ACCELERATE_FILES = [
    "custom_checkpoint_0.pkl",
    "model.safetensors",
    "optimizer.bin",
    "random_states_0.pkl",
]
"""What accelerate's ``save_state`` writes for the run below: a checkpoint is complete
when it holds exactly these."""


def _accelerate_run(report, root: str, steps: int) -> None:
    from accelerate.utils import ProjectConfiguration

    from slipstream import CheckpointError
    from slipstream.integrations.accelerate import SlipstreamAccelerator

    accelerator = SlipstreamAccelerator(
        cpu=True,
        background_write=True,  # kills land while training goes on beside the write
        project_config=ProjectConfiguration(
            project_dir=root, automatic_checkpoint_naming=True, total_limit=3
        ),
    )
    model, optimizer = accelerator.prepare(_model(), None)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    checkpoints = os.path.join(root, "checkpoints")
    try:
        accelerator.load_state()  # the newest checkpoint_<i>
    except CheckpointError as error:
        if "no checkpoint in" not in str(error):  # the one way to start from nothing
            raise
        report("resumed", 0, None, None, False)
    else:
        path = os.path.join(checkpoints, f"checkpoint_{counter.step}")
        complete = sorted(os.listdir(path)) == _ACCELERATE_FILES
        report("resumed", counter.step, state_digest(model, optimizer), path, complete)
    for s in range(counter.step + 1, steps + 1):
        _train_step(model, optimizer, s)
        counter.step = s
        report("step", s, state_digest(model, optimizer))
        accelerator.project_configuration.iteration = s
        accelerator.save_state()
        report("saved", s)
    accelerator.end_training()
    report("done", state_digest(model, optimizer))


def _saving_under(directory: str) -> bool:
    """Whether a save was cut short in ``directory``: its hidden ``.<name>.saving-<id>``."""
    return os.path.isdir(directory) and any(".saving-" in n for n in os.listdir(directory))


@pytest.mark.parametrize("zygote", ["accelerate"], indirect=True)
def test_accelerate_load_state_resumes_from_a_complete_checkpoint_after_any_kill(tmp_path, zygote):
    _run_crash_trials(
        zygote,
        _accelerate_run,
        tmp_path,
        2,
        lambda root: _saving_under(os.path.join(root, "checkpoints")),
    )


# -- Lightning ---------------------------------------------------------------------------


def _loads(path: str) -> bool:
    """Whether ``path`` is a whole ``torch.save`` archive."""
    try:
        torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 - any failure to read means not whole
        return False
    return True


def _lightning_run(report, root: str, steps: int) -> None:
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, Dataset

    from slipstream.integrations.lightning import SlipstreamCheckpointIO

    class Batches(Dataset):
        def __len__(self) -> int:
            return steps

        def __getitem__(self, i: int):
            return i

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, _):
            # the step's batch, not the loader's (which restarts its epoch on a resume)
            x, y = _batch(self.global_step + 1)
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Reporting(SlipstreamCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            super().save_checkpoint(checkpoint, path, storage_options)
            report("saved", checkpoint["global_step"])

    class Steps(Callback):
        resumed = False

        def on_train_batch_start(self, trainer, module, *_):
            # the first point after Lightning restored the optimizers too
            self.report_resume(trainer, module)

        def report_resume(self, trainer, module) -> None:
            if self.resumed:
                return
            self.resumed = True
            path = trainer.ckpt_path
            complete = path is not None and _loads(path)
            digest = state_digest(module.net, trainer.optimizers[0]) if path else None
            report("resumed", trainer.global_step, digest, path, complete)

        def on_train_batch_end(self, trainer, module, *_):
            report("step", trainer.global_step, state_digest(module.net, trainer.optimizers[0]))

    checkpoints = os.path.join(root, "checkpoints")
    steps_seen = Steps()
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        plugins=[Reporting(background_write=True)],
        callbacks=[
            steps_seen,
            ModelCheckpoint(
                dirpath=checkpoints,
                every_n_train_steps=1,
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=True,
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module, DataLoader(Batches(), batch_size=None), ckpt_path="last")
    # a run that resumed from the last step's checkpoint trains no batch
    steps_seen.report_resume(trainer, module)
    report("done", state_digest(module.net, trainer.optimizers[0]))


@pytest.mark.parametrize("zygote", ["lightning"], indirect=True)
def test_lightning_ckpt_path_last_resumes_from_a_complete_checkpoint_after_any_kill(
    tmp_path, zygote
):
    _run_crash_trials(
        zygote,
        _lightning_run,
        tmp_path,
        3,
        lambda root: _leftovers(os.path.join(root, "checkpoints")) != [],
    )


# -- Hugging Face Trainer ----------------------------------------------------------------


def _trainer_run(report, root: str, steps: int) -> None:
    from trainer_runs import TRAINER_FILES, cpu_arguments
    from transformers import TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from slipstream.integrations.transformers import SlipstreamTrainer

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()
            self.step = 0

        def forward(self, index, labels=None):
            x, y = _batch(self.step)  # the step's batch, whatever the sampler's order
            return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}

    model = Net()
    last = get_last_checkpoint(root) if os.path.isdir(root) else None

    class Steps(TrainerCallback):
        resumed = False

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            model.step = state.global_step + 1
            self.report_resume(state, optimizer)

        def report_resume(self, state, optimizer) -> None:
            if self.resumed:
                return
            self.resumed = True
            if state.global_step:
                # The Trainer's own files for a model that is no PreTrainedModel.
                complete = set(TRAINER_FILES) - {"config.json"} <= set(os.listdir(last))
                digest = state_digest(model.net, optimizer)
                report("resumed", state.global_step, digest, last, complete)
            else:
                report("resumed", 0, None, None, False)

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            report("step", state.global_step, state_digest(model.net, optimizer))

        def on_save(self, args, state, control, **kwargs):
            report("saved", state.global_step)

    args = cpu_arguments(
        TrainingArguments,
        root,
        per_device_train_batch_size=1,
        save_steps=1,
        max_steps=steps,
        save_total_limit=3,
        seed=0,
    )
    data = [{"index": torch.tensor(i)} for i in range(steps)]
    steps_seen = Steps()
    trainer = SlipstreamTrainer(model=model, args=args, train_dataset=data, callbacks=[steps_seen])
    trainer.train(resume_from_checkpoint=True if last else None)
    # a run that resumed from the last step's checkpoint trains no step
    steps_seen.report_resume(trainer.state, trainer.optimizer)
    report("done", state_digest(model.net, trainer.optimizer))


@pytest.mark.parametrize("zygote", ["transformers"], indirect=True)
def test_trainer_resume_from_checkpoint_true_starts_from_a_complete_checkpoint_after_any_kill(
    tmp_path, zygote
):
    _run_crash_trials(zygote, _trainer_run, tmp_path, 4, lambda root: _leftovers(root) != [])


# -- torchtitan through slipstream.dcp ---------------------------------------------------


def _torchtitan_run(report, root: str, steps: int) -> None:
    import torch.distributed as dist
    import torchtitan.components.checkpointer.dcp as titan
    from dist_utils import free_port
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    import slipstream.dcp

    titan.dcp = slipstream.dcp  # the swap docs/integrations/torchtitan.md gives
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )

    class TrainState:
        step = 0

        def state_dict(self) -> dict:
            return {"step": torch.tensor(self.step)}

        def load_state_dict(self, state: dict) -> None:
            self.step = int(state["step"])

    model = _model()
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}
                )
            ],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=steps
    )
    train_state = TrainState()
    manager = titan.CheckpointManager(
        titan.CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=1,
            async_mode="async",
            keep_latest_k=3,
            last_save_model_only=False,
        ),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=root,
    )
    manager.load()  # the newest step-<n> that holds a .metadata
    if train_state.step:
        path = os.path.join(root, "checkpoint", f"step-{train_state.step}")
        complete = os.path.isfile(os.path.join(path, ".metadata"))
        report("resumed", train_state.step, state_digest(model, optimizers), path, complete)
    else:
        report("resumed", 0, None, None, False)
    try:
        while train_state.step < steps:
            train_state.step += 1
            x, y = _batch(train_state.step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            report("step", train_state.step, state_digest(model, optimizers))
            manager.save(train_state.step, last_step=train_state.step == steps)
            manager.maybe_wait_for_staging()
            report("saved", train_state.step)
        manager.maybe_wait_for_saving()
    finally:
        manager.close()
    report("done", state_digest(model, optimizers))
    dist.destroy_process_group()


@pytest.mark.parametrize("zygote", ["torchtitan"], indirect=True)
def test_torchtitan_resumes_from_a_complete_step_after_any_kill(tmp_path, zygote):
    _run_crash_trials(
        zygote,
        _torchtitan_run,
        tmp_path,
        5,
        lambda root: _incomplete_under(os.path.join(root, "checkpoint")),
    )
