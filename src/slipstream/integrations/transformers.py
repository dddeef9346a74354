"""Hugging Face ``Trainer`` checkpoints written in the background, file for file the Trainer's.

Put :class:`SlipstreamTrainerMixin` first among a Trainer class's bases (or use
:class:`SlipstreamTrainer`). Every checkpoint holds exactly the files the Trainer's own
``_save_checkpoint`` writes, in its formats::

    checkpoint-N/
      model.safetensors (or its shards and index), config.json, generation_config.json
                          save_pretrained's files (a model that is no PreTrainedModel:
                          model.safetensors alone, as Trainer._save writes it)
      optimizer.pt, scheduler.pt, scaler.pt (with one), rng_state.pth (rng_state_<i>.pth
      for each process of a multi-process run)
      trainer_state.json, training_args.bin, the tokenizer or processor, a subclass's files

so a plain ``Trainer`` resumes from it and it from a plain Trainer's, and
``from_pretrained`` loads it, with slipstream not installed. Resuming runs the Trainer's own
loading code, unchanged (the model's own ``load_state_dict`` restores it).

What changes is when and how the files are written: the save copies the state (the model's
state dict, the optimizer's, scheduler's and scaler's, the random generators', taken on the
training thread at the save as the Trainer takes them) into host memory that is reused from
save to save, and writes the small files into a hidden directory; a thread of its own
writes the rest there, and the directory is renamed to ``checkpoint-N`` once every file in
it is durable (fsynced). The training loop goes on as soon as the copy is done.

Invariants:

- ``checkpoint-N`` appears under ``output_dir`` only complete: ``get_last_checkpoint`` and
  a resume never find a partial one, and a save of a step that already has one (after a
  resume) replaces it whole. After each save nothing of slipstream's is left in
  ``output_dir``; ``train()`` first removes what a killed run left (hidden ``.saving-`` and
  ``.removing-`` entries) on the process that saves.
- Rotation (``save_total_limit``, keeping the newest and the best checkpoint as the
  Trainer does) runs after the rename, so it never deletes a checkpoint still being
  written; it renames each checkpoint it drops to a hidden name before deleting it.
- One save is in flight at a time: a save first waits for the one before.
  ``train()`` returns (or raises) only after every save it started has finished, and
  raises a save's failure.
- A callback's ``on_save`` finds ``checkpoint-N`` complete, as with the Trainer's own save
  (``WandbCallback`` and ``MLflowCallback`` upload it from there): while any callback has
  an ``on_save`` of its own, each save waits until its checkpoint is in place (logged once).
- A save changes nothing it saves: it reads the state as the Trainer's save reads it.

Subclasses keep working: the mixin changes where the Trainer's own ``_save_checkpoint``
writes and what its ``_save`` / ``_save_optimizer_and_scheduler`` / ``_save_scaler`` /
``_save_rng_state`` steps do, so what a subclass writes around them (TRL's extra state
files) lands in the same checkpoint directory.

DeepSpeed, FSDP, XLA, SageMaker model parallelism and models sharded at load
(tensor-parallel) keep the Trainer's own checkpointing (logged once); FSDP's goes through
``slipstream.dcp`` with the swap in docs/dcp.md. PEFT adapters, quantized and offloaded
models have their model files written by the Trainer's own ``_save`` on the training thread
(an adapter is small; the other two are read from the live model by ``save_pretrained``).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    import transformers
    from transformers.trainer import (
        OPTIMIZER_NAME,
        SCALER_NAME,
        SCHEDULER_NAME,
        TRAINER_STATE_NAME,
        TRAINING_ARGS_NAME,
    )
    from transformers.trainer_utils import (
        PREFIX_CHECKPOINT_DIR,
        HubStrategy,
        SaveStrategy,
        _is_peft_model,
        sort_checkpoints,
    )
    from transformers.training_args import ParallelMode
    from transformers.utils import (
        is_sagemaker_mp_enabled,
        is_torch_hpu_available,
        is_torch_mlu_available,
        is_torch_musa_available,
        is_torch_npu_available,
        is_torch_xla_available,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "slipstream.integrations.transformers needs the 'transformers' package: "
        "pip install transformers"
    ) from error

import numpy as np
import torch

from ..checkpoint.files import BackgroundWrites, HostCopy
from ..checkpoint.files.atomic import saving_name
from ..checkpoint.save.options import SaveOptions
from ._trainer_checkpoint import StagedCheckpoint, write_checkpoint_files
from .removal import delete_now, sweep

log = logging.getLogger(__name__)


@dataclass
class SlipstreamTrainerOptions:
    """How :class:`SlipstreamTrainerMixin` saves."""

    timeout: float = SaveOptions.timeout
    """Bounds each wait for a save to finish (the next save's, ``train()``'s), in seconds;
    one that does not finish in time raises, naming the checkpoint."""


@dataclass
class _Capture:
    """What one ``_save_checkpoint`` hands its steps to fill in, on the training thread."""

    written: str | None
    """The hidden run directory the Trainer writes its small files into (under
    ``checkpoint-N``); ``None`` on a process that does not save."""
    model_state: dict[str, torch.Tensor] | None = None
    pretrained: transformers.PreTrainedModel | None = None
    torch_files: dict[str, Any] = field(default_factory=dict)


_DEVICE_GENERATORS = (
    ("npu", is_torch_npu_available, ("npu", "random")),
    ("hpu", is_torch_hpu_available, ("hpu", "random")),
    ("mlu", is_torch_mlu_available, ("mlu", "random")),
    ("musa", is_torch_musa_available, ("musa",)),
)
"""The device generators ``Trainer._save_rng_state`` saves beside CUDA's: key, probe, module."""


if TYPE_CHECKING:
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class SlipstreamTrainerMixin(_TrainerBase):
    """Makes a ``transformers.Trainer`` (sub)class write its checkpoints in the background.

    ``class MyTrainer(SlipstreamTrainerMixin, SFTTrainer): ...``: first among the bases.
    ``slipstream_options=`` (a :class:`SlipstreamTrainerOptions`) may be passed to the
    constructor; everything else is the Trainer's own arguments.
    """

    def __init__(
        self, *args: Any, slipstream_options: SlipstreamTrainerOptions | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        strategy = HubStrategy(self.args.hub_strategy)
        if self.args.push_to_hub and strategy != HubStrategy.END:
            raise ValueError(
                f"SlipstreamTrainer: push_to_hub with hub_strategy={strategy.value!r} "
                "pushes from each checkpoint directory while it is still being written; "
                "use hub_strategy='end' (the final save_model is pushed as usual)"
            )
        self.slipstream_options = slipstream_options or SlipstreamTrainerOptions()
        self._ss_capture: _Capture | None = None
        self._ss_host = HostCopy(self.slipstream_options.timeout)
        self._ss_writes = BackgroundWrites(nice=SaveOptions.thread_nice)
        self._ss_logged: set[str] = set()

    # -- waiting ----------------------------------------------------------------------------

    def wait_for_checkpoints(self) -> None:
        """Block until every save started is complete and in place; raise its failure."""
        self._ss_writes.wait(self.slipstream_options.timeout)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output_dir = self.args.output_dir
        if output_dir is not None and self.args.should_save and self._slipstream_supported():
            self.wait_for_checkpoints()
            sweep(output_dir)  # no save of this trainer is in flight: a killed run's leftovers
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            try:
                self.wait_for_checkpoints()
            except Exception as error:  # noqa: BLE001 - the training's error is raised
                log.error("a checkpoint failed while training failed too: %s", error)
            raise
        self.wait_for_checkpoints()
        return result

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        # The best-model reload and the last rotation read finished checkpoints only.
        self.wait_for_checkpoints()
        if self._slipstream_supported():
            if self.args.world_size > 1:
                self.accelerator.wait_for_everyone()
            self._keep_only_best(super()._get_output_dir(trial))
        return super()._finalize_training(trial, *args, **kwargs)

    def _keep_only_best(self, run_dir: str) -> None:
        """What the Trainer deletes when training ends with ``save_total_limit=1`` (every
        checkpoint but the best), deleted through hidden names as rotation does."""
        best = self.state.best_model_checkpoint
        if not self.args.should_save or best is None or self.args.save_total_limit != 1:
            return
        for checkpoint in sort_checkpoints(run_dir):
            if not os.path.samefile(checkpoint, best):
                delete_now(checkpoint)

    # -- saving ------------------------------------------------------------------------------

    def _log_once(self, key: str, message: str, *args: Any, level: int = logging.INFO) -> None:
        if key not in self._ss_logged:
            self._ss_logged.add(key)
            log.log(level, message, *args)

    def _slipstream_supported(self) -> bool:
        unsupported = (
            self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or self.is_distributed_loading_by_transformers
            or is_torch_xla_available()
            or is_sagemaker_mp_enabled()
        )
        if unsupported:
            self._log_once(
                "fallback",
                "slipstream: DeepSpeed, FSDP, tensor-parallel, XLA and SageMaker checkpoints "
                "use the Trainer's own code (for FSDP, see the slipstream.dcp swap in docs/dcp.md)",
                level=logging.WARNING,
            )
        return not unsupported

    def _get_output_dir(self, trial: Any) -> str:
        capture = self._ss_capture
        if capture is not None and capture.written is not None:
            return capture.written
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        if not self._slipstream_supported():
            super()._save_checkpoint(model, trial)
            return
        self.wait_for_checkpoints()
        if self.args.world_size > 1:
            # Every process sees the checkpoints saved so far (the best one's, below).
            self.accelerator.wait_for_everyone()
        run_dir = super()._get_output_dir(trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        capture = _Capture(saving_name(final) if self.args.should_save else None)
        best_before = self.state.best_model_checkpoint
        self._ss_capture = capture
        try:
            super()._save_checkpoint(model, trial)
        except BaseException:
            if capture.written is not None:
                shutil.rmtree(capture.written, ignore_errors=True)
            raise
        finally:
            self._ss_capture = None
        recorded = self.state.best_model_checkpoint
        self._point_best_at(run_dir, best_before)
        if capture.written is not None:
            if self.state.best_model_checkpoint != recorded:  # as the Trainer would record it
                staged_dir = os.path.join(capture.written, os.path.basename(final))
                self.state.save_to_json(os.path.join(staged_dir, TRAINER_STATE_NAME))
            self._start_write(capture, final)
        readers = self._on_save_callbacks()
        if readers:
            # The plain Trainer has written checkpoint-N when on_save runs, and callbacks
            # read it there (WandbCallback, MLflowCallback upload it): so must this one.
            self._log_once(
                "on_save",
                "slipstream: %s handle on_save, which runs once the checkpoint is in place: "
                "each save waits until its checkpoint is complete (its write no longer "
                "overlaps training)",
                ", ".join(readers),
            )
            self.wait_for_checkpoints()

    def _start_write(self, capture: _Capture, final: str) -> None:
        assert capture.written is not None
        staged = self._ss_host.copy({"model": capture.model_state, "files": capture.torch_files})
        checkpoint = StagedCheckpoint(
            final=final,
            written=capture.written,
            model_state=staged["model"],
            pretrained=capture.pretrained,
            torch_files=staged["files"],
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
        )
        self._ss_host.hold()

        def write() -> None:
            try:
                write_checkpoint_files(checkpoint)
            finally:
                self._ss_host.release()

        try:
            self._ss_writes.start([final], write, self.slipstream_options.timeout)
        except BaseException:
            self._ss_host.release()
            shutil.rmtree(capture.written, ignore_errors=True)
            raise

    def _on_save_callbacks(self) -> list[str]:
        """The callbacks with an ``on_save`` of their own."""
        return [
            type(c).__name__
            for c in self.callback_handler.callbacks
            if type(c).on_save is not transformers.TrainerCallback.on_save
        ]

    def _point_best_at(self, run_dir: str, best_before: str | None) -> None:
        """The Trainer looked for the best checkpoint where this save writes: look again
        among the finished ones (and the one being saved), as it would have."""
        best_step = self.state.best_global_step
        if not best_step or self.args.save_strategy not in (
            SaveStrategy.STEPS,
            SaveStrategy.EPOCH,
            SaveStrategy.BEST,
        ):
            return
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        found = best_step == self.state.global_step or os.path.exists(best)
        self.state.best_model_checkpoint = best if found else best_before

    def _model_saved_by_the_trainer(self) -> bool:
        """Whether ``save_pretrained`` reads more than a state dict (quantized, offloaded),
        or the model's files are an adapter's (small): the Trainer's ``_save`` writes them."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        devices = getattr(model, "hf_device_map", None) or {}
        return (
            _is_peft_model(model)
            or getattr(model, "_hf_peft_config_loaded", False)
            or getattr(model, "hf_quantizer", None) is not None
            or "cpu" in devices.values()
            or "disk" in devices.values()
        )

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        capture = self._ss_capture
        if capture is None or not self.args.should_save or self._model_saved_by_the_trainer():
            super()._save(output_dir, state_dict)
            return
        assert output_dir is not None and self.model is not None
        os.makedirs(output_dir, exist_ok=True)
        # What Trainer._save hands save_pretrained (or safetensors), read here, written later.
        capture.model_state = self.model.state_dict() if state_dict is None else state_dict
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(unwrapped, transformers.PreTrainedModel):
            capture.pretrained = unwrapped
        # The rest of Trainer._save, small, on this thread (a tokenizer is not thread-safe).
        collator_tokenizer = getattr(self.data_collator, "tokenizer", None)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif collator_tokenizer is not None:
            collator_tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        capture = self._ss_capture
        if capture is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        if self.args.should_save:
            assert self.optimizer is not None and self.lr_scheduler is not None
            capture.torch_files[OPTIMIZER_NAME] = self.optimizer.state_dict()
            capture.torch_files[SCHEDULER_NAME] = self.lr_scheduler.state_dict()

    def _save_scaler(self, output_dir: str) -> None:
        capture = self._ss_capture
        if capture is None:
            super()._save_scaler(output_dir)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and self.args.should_save:
            capture.torch_files[SCALER_NAME] = scaler.state_dict()

    def _save_rng_state(self, output_dir: str) -> None:
        capture = self._ss_capture
        if capture is None:
            super()._save_rng_state(output_dir)
            return
        states = self._rng_states()
        if self.args.world_size <= 1:
            capture.torch_files["rng_state.pth"] = states
            return
        # Each process's generators, taken now, are written by the process that saves them.
        args = self.args
        writer = args.process_index - args.local_process_index if args.save_on_each_node else 0
        gathered: list[Any] = [None] * args.world_size
        torch.distributed.all_gather_object(gathered, (args.process_index, writer, states))
        for index, writes_it, state in gathered:
            if args.should_save and writes_it == args.process_index:
                capture.torch_files[f"rng_state_{index}.pth"] = state

    def _rng_states(self) -> dict[str, Any]:
        """The random generators' states, as ``Trainer._save_rng_state`` takes them."""
        distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
        states: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available():
            cuda = torch.cuda.random
            states["cuda"] = cuda.get_rng_state_all() if distributed else cuda.get_rng_state()
        for name, available, path in _DEVICE_GENERATORS:
            if available():
                device: Any = functools.reduce(getattr, path, torch)
                states[name] = device.get_rng_state_all() if distributed else device.get_rng_state()
        return states


class SlipstreamTrainer(SlipstreamTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with its checkpoints written in the background."""
