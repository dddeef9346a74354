"""Hugging Face ``Trainer`` checkpoints through slipstream, asynchronously.

Put :class:`SlipstreamTrainerMixin` first among a Trainer class's bases (or use
:class:`SlipstreamTrainer`): every checkpoint the Trainer decides to save is staged by
slipstream and written in the background; the training loop waits for the staging only,
at its next optimizer step at the latest. A checkpoint directory is laid out as::

    checkpoint-N/
      slipstream/         the whole training state, one DCP-format checkpoint
      model.safetensors   the model weights, exported from it (``from_pretrained`` reads them)
      config.json, tokenizer files, training_args.bin, trainer_state.json

Invariants:

- ``checkpoint-N`` appears under ``output_dir`` only once it is complete: it is assembled
  in ``output_dir/.slipstream-staging/`` (which no resume or rotation looks at) and renamed
  into place after slipstream's checkpoint is durable, the weights are exported and
  ``trainer_state.json`` is written. ``get_last_checkpoint`` never finds a partial one.
- Rotation (``save_total_limit``) runs after that rename, so it never sees, and never
  deletes, a checkpoint still being written; it renames each checkpoint it drops to a
  hidden name before deleting it, so none is ever seen (or left by a kill) half deleted.
  One save is in flight at a time: the next save waits for the previous one to finish.
- ``train()`` returns (or raises) only after every save it started has finished.
- A callback's ``on_save`` finds ``checkpoint-N`` complete, as with the Trainer's own save
  (``WandbCallback`` and ``MLflowCallback`` upload it from there): while any callback has
  an ``on_save`` of its own, each save waits until its checkpoint is in place (logged once).
- A resume never picks an incomplete checkpoint: ``get_last_checkpoint`` sees complete
  ones only (above), a save of a step that already has a directory (after a resume)
  replaces it through a hidden name (:func:`.removal.delete_now`), and naming a
  checkpoint whose ``slipstream/`` never committed raises, naming the newest complete one.
  ``train()`` first removes what a killed run left (``.slipstream-staging/``, hidden
  directories of a deletion cut short, temporary files) on the process that saves.
- Resuming (``resume_from_checkpoint``) restores the model, optimizer, scheduler, scaler and
  random generators (Python's, numpy's, torch's CPU and CUDA ones; a save on an NPU, HPU,
  MLU or MUSA device logs once that its generator is not saved) from ``slipstream/``; the
  Trainer itself restores its state, global step, callbacks' state and the position in
  the data from ``trainer_state.json``. Directories the Trainer wrote itself still load
  through the Trainer's own code.
- A save changes nothing it saves: the optimizer's state is read as it is (never
  materialized by a step), so a run saved before its first optimizer step and after every
  step ends bit for bit as the run that never saved.

Subclasses keep working: the mixin changes where the Trainer's own ``_save_checkpoint``
writes and what its ``save_model`` / ``_save_optimizer_and_scheduler`` / ``_save_scaler`` /
``_save_rng_state`` steps do, so what a subclass adds around them (TRL's model cards and
extra state files) still runs and lands in the same checkpoint directory.

DeepSpeed, FSDP, XLA and SageMaker model parallelism keep the Trainer's own checkpointing
(logged once); FSDP's goes through ``slipstream.dcp`` with the swap in docs/dcp.md.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    import transformers
    from transformers.trainer_utils import (
        PREFIX_CHECKPOINT_DIR,
        HubStrategy,
        SaveStrategy,
        sort_checkpoints,
    )
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

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from .. import (
    AsyncSaveResponse,
    CheckpointError,
    SaveOptions,
    StagedState,
    async_save,
    export_hf,
    load,
    stage,
)
from ..core.flatten import flatten
from ..core.threads import lower_thread_priority
from . import rng
from .removal import delete_now, sweep
from .training_state import (
    has_saved_buffers,
    incomplete_error,
    is_checkpoint,
    optimizer_parameter_names,
    optimizer_state,
    restore_optimizer_state,
    saved_keys,
    saved_subtree,
    torch_optimizer,
)

STATE_DIR = "slipstream"
"""The subdirectory of ``checkpoint-N`` holding slipstream's checkpoint."""
STAGING_DIR = ".slipstream-staging"
"""Where checkpoints are assembled, under the run's output directory, until complete."""
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.bin"

log = logging.getLogger(__name__)


@dataclass
class SlipstreamTrainerOptions:
    """How :class:`SlipstreamTrainerMixin` saves."""

    export_hf: bool = True
    """Write ``model.safetensors`` (``ss.export_hf``) beside the state, off the training
    thread, so ``from_pretrained("checkpoint-N")`` works as with the Trainer's own save."""
    export_dtype: str | torch.dtype | None = None
    """Cast the exported weights (``"bf16"``...); ``None`` keeps the trained dtype."""
    timeout: float | None = None
    """Bounds every wait on another rank and on a previous save; ``None``: slipstream's
    default (``SaveOptions.timeout``)."""


def state_dir(checkpoint: str | os.PathLike[str]) -> str | None:
    """The slipstream checkpoint inside a Trainer checkpoint directory, or ``None``."""
    path = os.path.join(checkpoint, STATE_DIR)
    return path if is_checkpoint(path) else None


class _PendingCheckpoint:
    """The rest of one save, on a thread the mixin owns and joins: wait until slipstream's
    part is durable, export the weights, write ``trainer_state.json``, rename the staged
    directory into place, rotate. Only the rank that writes (``should_save``) does more than
    wait; a failure leaves the staged directory where nothing reads it.

    ``source`` is either a save already started on the training thread (its response:
    several processes, whose save must start there, beside the job's collectives, or state
    on an accelerator, which the saver stages on a stream of its own), and the export then
    reads the weights back from the checkpoint; or, for one process whose state is all in
    host memory, the captured state itself: this thread copies it into a snapshot
    (``ss.stage``), saves the snapshot as it is and exports the weights straight from it,
    so they are never read back. ``staged`` resolves once the state is copied either way.
    """

    def __init__(
        self,
        source: AsyncSaveResponse | dict[str, Any],
        staged: str,
        final: str,
        state: transformers.TrainerState,
        args: transformers.TrainingArguments,
        options: SlipstreamTrainerOptions,
    ) -> None:
        self.source = source
        self.staged_dir = staged
        self.final = final
        self.state = state
        self.args = args
        self.options = options
        self.staged: Future[Any] = (
            source.staging_completion if isinstance(source, AsyncSaveResponse) else Future()
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"slipstream-{os.path.basename(final)}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        # The copy and the export read and write the weights: like slipstream's own
        # writers, this thread gives way to the training thread.
        lower_thread_priority(SaveOptions.thread_nice)
        snapshot: StagedState | None = None
        hold: int | None = None
        try:
            if isinstance(self.source, AsyncSaveResponse):
                response = self.source
            else:
                snapshot = self._stage(self.source)
                hold = snapshot.hold(f"weights export of {self.final}")
                response = async_save(
                    snapshot,
                    os.path.join(self.staged_dir, STATE_DIR),
                    no_dist=True,
                    timeout=self.options.timeout,
                )
            response.result()
            if self.args.should_save:
                self._publish(snapshot)
        except BaseException as error:  # noqa: BLE001 - re-raised by join on the owner's thread
            self.error = error
        finally:
            if snapshot is not None and hold is not None:
                snapshot.release(hold)

    def _stage(self, state: dict[str, Any]) -> StagedState:
        timeout = SaveOptions.timeout if self.options.timeout is None else self.options.timeout
        try:
            snapshot = stage(state, timeout=timeout)
        except BaseException as error:
            self.staged.set_exception(error)
            raise
        self.staged.set_result(None)
        return snapshot

    def _publish(self, snapshot: StagedState | None) -> None:
        if self.options.export_hf:
            config = os.path.join(self.staged_dir, "config.json")
            export_hf(
                os.path.join(self.staged_dir, STATE_DIR),
                self.staged_dir,
                prefix="model.",
                dtype=self.options.export_dtype,
                config=config if os.path.isfile(config) else None,
                staged=_model_tensors(snapshot) if snapshot is not None else None,
            )
        self.state.save_to_json(os.path.join(self.staged_dir, TRAINER_STATE_NAME))
        if os.path.exists(self.final):  # a save of the same step, after a resume
            delete_now(self.final)
        os.replace(self.staged_dir, self.final)
        _rotate(os.path.dirname(self.final), self.args.save_total_limit, self.state)

    def join(self, timeout: float | None) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise CheckpointError(
                f"checkpoint {self.final} was not durable after {timeout} s; it is still "
                f"being written to {self.staged_dir}"
            )
        if self.error is not None:
            raise CheckpointError(
                f"checkpoint {self.final} failed ({self.error}); nothing was renamed into "
                f"place, the partial files are in {self.staged_dir}"
            ) from self.error


if TYPE_CHECKING:
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class SlipstreamTrainerMixin(_TrainerBase):
    """Makes a ``transformers.Trainer`` (sub)class checkpoint through slipstream.

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
        self._ss_capture: dict[str, Any] | None = None
        self._ss_staging: Future[Any] | None = None
        self._ss_wait_before_forward = False
        self._ss_pending: _PendingCheckpoint | None = None
        self._ss_fallback_logged = False
        self._ss_rng_warned = False
        self._ss_on_save_logged = False
        self.add_callback(_WaitForStaging(self))

    # -- what the training loop waits for --------------------------------------------------

    def wait_for_staging(self) -> None:
        """Block until the last save has copied the state (safe to change it again)."""
        staged, self._ss_staging = self._ss_staging, None
        if staged is not None:
            staged.result(self.slipstream_options.timeout)

    def wait_for_checkpoints(self) -> None:
        """Block until every save started is complete and in place; raise its error."""
        self.wait_for_staging()
        pending, self._ss_pending = self._ss_pending, None
        if pending is not None:
            pending.join(self.slipstream_options.timeout)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output_dir = self.args.output_dir
        if output_dir is not None and self.args.should_save and self._slipstream_supported():
            # No save of this run is in flight yet: what is there was left by a killed one.
            staging = os.path.join(output_dir, STAGING_DIR)
            if os.path.isdir(staging) and os.listdir(staging):
                log.warning("removing %s: saves an earlier run did not finish", staging)
                shutil.rmtree(staging, ignore_errors=True)
            sweep(output_dir)
        try:
            result = super().train(*args, **kwargs)
        except BaseException:
            try:
                self.wait_for_checkpoints()
            except CheckpointError as error:
                log.error("a checkpoint failed while training failed too: %s", error)
            raise
        self.wait_for_checkpoints()
        return result

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        # The best-model reload and the last rotation read finished checkpoints only.
        self.wait_for_checkpoints()
        if self._slipstream_supported():
            self._keep_only_best(self._get_output_dir(trial))
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

    def _ss_model(self) -> torch.nn.Module:
        if self.model is None:
            raise CheckpointError("the Trainer has no model to checkpoint")
        return self.model

    def _ss_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise CheckpointError("the Trainer has no optimizer yet (create_optimizer was not run)")
        return torch_optimizer(self.optimizer)

    def _slipstream_supported(self) -> bool:
        unsupported = (
            self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or is_torch_xla_available()
            or is_sagemaker_mp_enabled()
        )
        if unsupported and not self._ss_fallback_logged:
            self._ss_fallback_logged = True
            log.warning(
                "slipstream: DeepSpeed, FSDP, XLA and SageMaker checkpoints use the Trainer's "
                "own code (for FSDP, see the slipstream.dcp swap in docs/dcp.md)"
            )
        return not unsupported

    def _get_output_dir(self, trial: Any) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING_DIR) if self._ss_capture is not None else run_dir

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        if not self._slipstream_supported():
            super()._save_checkpoint(model, trial)
            return
        self.wait_for_checkpoints()
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staged = os.path.join(run_dir, STAGING_DIR, name)
        if self.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)  # left by a run that died mid-save
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()
        best_before = self.state.best_model_checkpoint
        self._ss_capture = {}
        try:
            super()._save_checkpoint(model, trial)
            captured = self._ss_capture
        finally:
            self._ss_capture = None
        self._point_best_at(run_dir, best_before)
        source: AsyncSaveResponse | dict[str, Any] = captured
        if self.args.world_size > 1 or not _all_in_host_memory(captured):
            source = async_save(
                captured, os.path.join(staged, STATE_DIR), timeout=self.slipstream_options.timeout
            )
        self._ss_wait_before_forward = has_saved_buffers(
            self._ss_model(), captured.get("model", {})
        )
        self._ss_pending = _PendingCheckpoint(
            source,
            staged,
            os.path.join(run_dir, name),
            copy.deepcopy(self.state),
            self.args,
            self.slipstream_options,
        )
        self._ss_staging = self._ss_pending.staged
        readers = self._ss_on_save_callbacks()
        if readers:
            # The plain Trainer has written checkpoint-N when on_save runs, and callbacks
            # read it there (WandbCallback, MLflowCallback upload it): so must this one.
            if not self._ss_on_save_logged:
                self._ss_on_save_logged = True
                log.info(
                    "slipstream: %s handle on_save, which runs once the checkpoint is in "
                    "place: each save waits until its checkpoint is complete (its write "
                    "no longer overlaps training)",
                    ", ".join(readers),
                )
            self.wait_for_checkpoints()

    def _ss_on_save_callbacks(self) -> list[str]:
        """The callbacks with an ``on_save`` of their own."""
        return [
            type(c).__name__
            for c in self.callback_handler.callbacks
            if type(c).on_save is not transformers.TrainerCallback.on_save
        ]

    def _point_best_at(self, run_dir: str, best_before: str | None) -> None:
        """The Trainer looked for the best checkpoint in the staging directory: look again
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

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._ss_capture is None or not _internal_call:
            super().save_model(output_dir, _internal_call)
            return
        assert output_dir is not None
        self._ss_capture["model"] = get_model_state_dict(self._ss_model())
        if self.args.should_save:
            self._save_model_files(output_dir)

    def _save_model_files(self, output_dir: str) -> None:
        """What ``save_pretrained`` writes beside the weights: config, generation config,
        tokenizer or processor, and the training arguments."""
        os.makedirs(output_dir, exist_ok=True)
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(unwrapped, transformers.PreTrainedModel):
            unwrapped.config.architectures = [type(unwrapped).__name__]  # as save_pretrained
            unwrapped.config.save_pretrained(output_dir)
            generation = getattr(unwrapped, "generation_config", None)
            if generation is not None and unwrapped.can_generate():
                generation.save_pretrained(output_dir)
        processor = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._ss_capture is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        optimizer = self._ss_optimizer()
        names = optimizer_parameter_names(optimizer, self._ss_model())
        self._ss_capture["optimizer"] = optimizer_state(optimizer, names)
        if self.lr_scheduler is not None:
            self._ss_capture["scheduler"] = self.lr_scheduler.state_dict()

    def _save_scaler(self, output_dir: str) -> None:
        if self._ss_capture is None:
            super()._save_scaler(output_dir)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            self._ss_capture["scaler"] = scaler.state_dict()

    def _save_rng_state(self, output_dir: str) -> None:
        if self._ss_capture is None:
            super()._save_rng_state(output_dir)
            return
        self._ss_capture["rng"] = {f"rank{self.args.process_index}": rng.capture()}
        unsaved = _generators_not_saved()
        if unsaved and not self._ss_rng_warned:
            self._ss_rng_warned = True
            log.warning(
                "slipstream saves the Python, numpy, CPU and CUDA random generators, not the "
                "%s generator the Trainer's own checkpoint saves: a resume on this device "
                "draws other random numbers (dropout...) than an uninterrupted run",
                ", ".join(unsaved),
            )

    # -- resuming ----------------------------------------------------------------------------

    def _slipstream_state(self, checkpoint: str | None) -> str | None:
        if checkpoint is None or not self._slipstream_supported():
            return None
        path = state_dir(checkpoint)
        if path is None and os.path.isdir(os.path.join(checkpoint, STATE_DIR)):
            raise incomplete_error(str(checkpoint), inside=STATE_DIR)
        return path

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        path = self._slipstream_state(resume_from_checkpoint)
        if path is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        module = self._ss_model() if model is None else model
        target = {"model": get_model_state_dict(module)}
        load(target, path, strict=False)
        set_model_state_dict(module, target["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = self._slipstream_state(checkpoint)
        if path is not None:
            keys = saved_keys(path)
            target: dict[str, Any] = {}
            model, optimizer, scheduler = self._ss_model(), self._ss_optimizer(), self.lr_scheduler
            if any(k.startswith("optimizer.") for k in keys):
                target["optimizer"] = saved_subtree(path, "optimizer")
            if scheduler is not None and any(k.startswith("scheduler.") for k in keys):
                target["scheduler"] = scheduler.state_dict()
            load(target, path, strict=False)
            if "optimizer" in target:
                names = optimizer_parameter_names(optimizer, model)
                restore_optimizer_state(optimizer, names, target["optimizer"], path)
            if scheduler is not None and "scheduler" in target:
                scheduler.load_state_dict(target["scheduler"])
        # A subclass's additions still load; the Trainer's own code finds none of its files.
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        path = self._slipstream_state(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if path is not None and scaler is not None and "scaler" in _top_keys(path):
            target = {"scaler": scaler.state_dict()}
            load(target, path, strict=False)
            scaler.load_state_dict(target["scaler"])
        super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        path = self._slipstream_state(checkpoint)
        if path is None:
            super()._load_rng_state(checkpoint)
            return
        rank = f"rank{self.args.process_index}"
        keys = saved_keys(path)
        if f"rng.{rank}.cpu" not in keys:
            log.info(
                "%s holds no random generator state for process %d; resuming on another "
                "number of processes is not reproducible",
                path,
                self.args.process_index,
            )
            return
        state = rng.capture()
        if f"rng.{rank}.cuda" not in keys:
            state.pop("cuda", None)
        target = {"rng": {rank: state}}
        load(target, path, strict=False)
        rng.restore(target["rng"][rank])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        path = self._slipstream_state(best)
        if path is None:
            super()._load_best_model()
            return
        self._load_from_checkpoint(str(best), self.model)


def _generators_not_saved() -> list[str]:
    """The devices whose random generators the Trainer's own ``_save_rng_state`` saves and
    :func:`.rng.capture` does not (XLA keeps the Trainer's own checkpointing)."""
    probes = {
        "npu": is_torch_npu_available,
        "hpu": is_torch_hpu_available,
        "mlu": is_torch_mlu_available,
        "musa": is_torch_musa_available,
    }
    return [name for name, available in probes.items() if available()]


def _all_in_host_memory(state: dict[str, Any]) -> bool:
    """Whether every tensor the save stages is in host memory."""
    leaves = flatten(state)[0].values()
    return all(t.device.type == "cpu" for t in leaves if isinstance(t, torch.Tensor))


def _model_tensors(snapshot: StagedState) -> dict[str, torch.Tensor]:
    """The snapshot's model weights by checkpoint key (``model.<name>``)."""
    return {f"model.{k}": v for k, v in snapshot["model"].items() if isinstance(v, torch.Tensor)}


def _rotate(run_dir: str, limit: int | None, state: transformers.TrainerState) -> None:
    """Keep the Trainer's ``save_total_limit`` as its own rotation does (the newest and the
    best checkpoint are never deleted, the oldest go first, by modification time), but
    delete each through a hidden name: no ``checkpoint-N`` is ever seen half deleted."""
    if limit is None or limit <= 0:
        return
    checkpoints = sort_checkpoints(run_dir, use_mtime=True)
    protected = {checkpoints[-1]} if checkpoints else set()
    if state.best_model_checkpoint is not None:
        protected.add(str(Path(state.best_model_checkpoint)))
    excess = len(checkpoints) - max(limit, len(protected))
    for checkpoint in [c for c in checkpoints if c not in protected][: max(excess, 0)]:
        delete_now(checkpoint)


def _top_keys(path: str) -> set[str]:
    return {k.split(".", 1)[0] for k in saved_keys(path)}


class _WaitForStaging(transformers.TrainerCallback):
    """Holds the training loop until the last save's staging is done, at the first point
    where the saved state may change: the next optimizer step, or the next forward pass
    where the model saves buffers a forward may update."""

    def __init__(self, trainer: SlipstreamTrainerMixin) -> None:
        self._trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer._ss_wait_before_forward:
            self._trainer.wait_for_staging()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer.wait_for_staging()


class SlipstreamTrainer(SlipstreamTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with its checkpoints through slipstream."""
