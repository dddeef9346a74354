"""``Accelerator.save_state`` / ``load_state`` through slipstream.

``SlipstreamAccelerator`` is an ``accelerate.Accelerator`` whose ``save_state`` stages
the models, optimizers, schedulers, data loader positions, gradient scaler, step, random
generators and the objects given to ``register_for_checkpointing`` with ``ss.async_save``
and returns once they are written, as accelerate's does, or, with ``background_write``,
once they are staged (the caller may change them at once) while the write goes on in the
background. ``load_state`` restores all of them in place, exactly.

Invariants:

- A directory holds a complete checkpoint once its ``.metadata`` exists: slipstream
  writes it last, after every rank's data is durable.
- ``save_state`` returns once the checkpoint is durable and its rotation done, as
  accelerate's; with ``background_write``, once the state is staged (with
  ``overlap_staging``, the next optimizer step waits for that instead).
- One save is in flight at a time: ``save_state`` and ``load_state`` first wait for the
  previous save; so do ``wait_for_checkpoints()`` and ``end_training()``. With automatic
  checkpoint naming, ``total_limit`` rotation runs only after that wait, so it never
  deletes a checkpoint still being written; a rotated-out directory leaves its name at once
  and is deleted on a thread of its own (:mod:`.removal`), which those waits join.
- A directory accelerate wrote itself (no ``.metadata``) still loads through accelerate.
- A resume never picks an incomplete checkpoint (a save that never committed: no
  ``.metadata``, nothing but a save's own files): ``load_state()`` takes the newest
  checkpoint that is not, and ``load_state(dir)`` of one raises, naming the newest
  complete one. The first ``save_state`` under automatic naming removes what a killed
  run left in ``checkpoints/`` (incomplete ``checkpoint_<i>``, hidden directories of a
  rotation cut short, temporary files) before its rotation counts the checkpoints
  (:func:`.removal.sweep`); the first ``load_state`` removes the last two only.

Why a subclass and not accelerate's save/load pre-hooks: those hooks only see the model
weights; the optimizer, scheduler, RNG and custom objects are written with ``torch.save``
after them whatever a hook does. Replacing the class is one line at construction, and
every existing ``save_state``/``load_state`` call then goes through slipstream.
FSDP, DeepSpeed, Megatron-LM and XLA keep accelerate's own code (logged once); FSDP's
sharded path calls DCP and goes through ``slipstream.dcp`` with the swap in
docs/dcp.md.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

try:
    from accelerate import Accelerator
    from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
    from accelerate.utils import DistributedType
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "slipstream.integrations.accelerate needs the 'accelerate' package: pip install accelerate"
    ) from error

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from .. import AsyncSaveResponse, CheckpointError, async_save, load
from ..core.flatten import flatten
from . import rng
from .removal import Remover, is_being_removed, sweep
from .training_state import (
    has_saved_buffers,
    incomplete_error,
    is_checkpoint,
    is_incomplete,
    optimizer_parameter_names,
    optimizer_state,
    restore_optimizer_state,
    saved_keys,
    saved_subtree,
    torch_optimizer,
)

log = logging.getLogger(__name__)

_OWN_CODE = (
    DistributedType.FSDP,
    DistributedType.DEEPSPEED,
    DistributedType.MEGATRON_LM,
    DistributedType.XLA,
)


PROBE_ENV = "SLIPSTREAM_ACCELERATE_PROBE"
"""A file to which each ``save_state``/``load_state`` that goes through slipstream's own
code (not accelerate's) appends a line: the call and the running pytest test (for the
conformance test, tests/integrations/test_accelerate_conformance.py)."""


def _probe(call: str) -> None:
    path = os.environ.get(PROBE_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        with open(path, "a") as out:
            out.write(f"slipstream:{call}\t{test}\n")


def _seedable_sampler(dataloader: Any) -> SeedableRandomSampler | None:
    """The sampler whose position accelerate saves with a data loader: a
    ``SeedableRandomSampler`` over an ``IterableDatasetShard`` (accelerate's own rule)."""
    if not isinstance(getattr(dataloader, "dataset", None), IterableDatasetShard):
        return None
    sampler = dataloader.get_sampler()
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _checkpoint_folders(root: str) -> list[str]:
    """The checkpoint directories under ``root``, oldest first (none being deleted)."""
    names = [f for f in os.listdir(root) if not is_being_removed(f)]
    return sorted((os.path.join(root, f) for f in names), key=_iteration)


def _is_automatic_name(name: str) -> bool:
    return re.fullmatch(r"checkpoint_\d+", name) is not None


def _iteration(folder: str) -> int:
    found = re.findall(r"(\d+)(?=[^/]*$)", folder)
    if not found:
        raise CheckpointError(f"{folder}: no checkpoint iteration in its name")
    return int(found[0])


class SlipstreamAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state``/``load_state`` go through slipstream.

    Takes accelerate's arguments, plus ``slipstream_timeout``: the bound on every wait on
    another rank or on a previous save (``None``: slipstream's default);
    ``background_write``: ``save_state`` returns once the state is staged and the write
    goes on in the background (off by default: as accelerate's, ``save_state`` returns once
    the checkpoint is complete on disk and nothing of it is still being written or rotated
    out, so the caller may read, copy or delete the directory at once); and
    ``overlap_staging`` (implies ``background_write``): ``save_state`` returns before the
    state is staged, the copy
    overlaps the next forward and backward, and the next ``optimizer.step()`` waits for it.
    Only for loops where nothing but the optimizer step changes the saved state until then
    (it is off, and ``save_state`` waits, where a model saves buffers, which a forward may
    update, a registered object holds tensors, or a stateful data loader is saved).

    What ``save_state`` saves and ``load_state`` restores is what accelerate's do: models
    (what the save hooks leave), optimizers (by parameter name, or by index for one over no
    prepared model), schedulers, stateful data loader and seedable sampler positions, the
    scaler, ``step``, every random generator and the registered objects; the save and load
    pre-hooks run as in accelerate. A save changes nothing it saves.
    """

    def __init__(
        self,
        *args: Any,
        slipstream_timeout: float | None = None,
        background_write: bool = False,
        overlap_staging: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.slipstream_timeout = slipstream_timeout
        self.background_write = background_write or overlap_staging
        self.overlap_staging = overlap_staging
        self._ss_staging: AsyncSaveResponse | None = None
        self._ss_step_hooks: list[Any] = []
        self._ss_pending: AsyncSaveResponse | None = None
        self._ss_pending_dir: str | None = None
        self._ss_fallback_logged = False
        self._ss_remover = Remover()
        self._ss_swept: set[bool] = set()
        """Which sweeps of ``checkpoints/`` this process ran: ``True`` the save's (with
        incomplete checkpoints), ``False`` the load's."""

    # -- waiting -----------------------------------------------------------------------------

    def wait_for_staging(self) -> None:
        """Block until the last ``save_state`` has copied the state (it may change again)."""
        response, self._ss_staging = self._ss_staging, None
        for handle in self._ss_step_hooks:
            handle.remove()
        self._ss_step_hooks = []
        if response is not None:
            response.staging_completion.result(self.slipstream_timeout)

    def wait_for_checkpoints(self) -> None:
        """Block until the last ``save_state`` is durable; raise its error."""
        self.wait_for_staging()
        self._ss_remover.wait(self.slipstream_timeout)
        pending, self._ss_pending = self._ss_pending, None
        if pending is None:
            return
        try:
            pending.result(self.slipstream_timeout)
        except Exception as error:
            raise CheckpointError(
                f"save_state to {self._ss_pending_dir} failed: {error}; its directory holds "
                "no committed checkpoint"
            ) from error

    def end_training(self) -> None:
        self.wait_for_checkpoints()
        super().end_training()

    # -- what a checkpoint holds -------------------------------------------------------------

    def _ss_supported(self) -> bool:
        unsupported = self.distributed_type in _OWN_CODE
        if unsupported and not self._ss_fallback_logged:
            self._ss_fallback_logged = True
            log.warning(
                "slipstream: %s checkpoints use accelerate's own code (for FSDP, see the "
                "slipstream.dcp swap in docs/dcp.md)",
                self.distributed_type,
            )
        return not unsupported

    def _ss_modules(self) -> list[torch.nn.Module]:
        return [self.unwrap_model(m, keep_torch_compile=False) for m in self._models]

    def _ss_parameter_names(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """How the optimizer's state is saved: by the parameter names of the prepared model
        that holds all its parameters, or, where none does (an optimizer over a model not
        passed to ``prepare()``, or over several), by index, as accelerate saves it."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self._ss_modules():
            if params <= {id(p) for p in module.parameters()}:
                return optimizer_parameter_names(optimizer, module)
        return optimizer_parameter_names(optimizer, None)

    def _ss_state(self, models: list[dict[str, Any]]) -> dict[str, Any]:
        """Everything ``save_state`` saves, under stable keys, with ``models`` the model
        state dicts the save hooks left (as accelerate, which saves what its hooks leave in
        ``weights``). Reads only: nothing saved changes (see :func:`optimizer_state`)."""
        state: dict[str, Any] = {f"models.{i}": weights for i, weights in enumerate(models)}
        for i, wrapped in enumerate(self._optimizers):
            optimizer = torch_optimizer(wrapped)
            state[f"optimizers.{i}"] = optimizer_state(
                optimizer, self._ss_parameter_names(optimizer)
            )
        for i, scheduler in enumerate(self._schedulers):
            state[f"schedulers.{i}"] = scheduler.state_dict()
        for i, dataloader in enumerate(self._dataloaders):
            sampler = _seedable_sampler(dataloader)
            if sampler is not None:
                state[f"samplers.{i}"] = {"epoch": sampler.epoch, "seed": sampler.initial_seed}
            if getattr(dataloader, "use_stateful_dataloader", False):
                state[f"dataloaders.{i}"] = dataloader.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        for i, obj in enumerate(self._custom_objects):
            state[f"custom.{i}"] = obj.state_dict()
        state["step"] = self.step
        state["rng"] = {f"rank{self.process_index}": rng.capture()}
        return state

    # -- save and load -----------------------------------------------------------------------

    def _ss_output_dir(self, output_dir: str | None) -> str:
        """Where to save; with automatic naming, accelerate's ``checkpoint_<i>`` after its
        ``total_limit`` rotation (run by the main process once no save is in flight)."""
        if not self.project_configuration.automatic_checkpoint_naming:
            if output_dir is None:
                raise CheckpointError(
                    "save_state needs an output_dir when automatic checkpoint naming is off"
                )
            return str(output_dir)
        root = os.path.join(self.project_dir, "checkpoints")
        os.makedirs(root, exist_ok=True)
        if self.is_main_process:
            self._ss_sweep(root, incomplete=True)
            limit = self.project_configuration.total_limit
            if limit is not None:
                folders = _checkpoint_folders(root)
                for folder in folders[: max(0, len(folders) + 1 - limit)]:
                    self._ss_remover.remove(folder)
        self.wait_for_everyone()
        path = os.path.join(root, f"checkpoint_{self.save_iteration}")
        if os.path.exists(path):
            raise CheckpointError(
                f"checkpoint directory {path} ({self.save_iteration}) already exists; set "
                "project_configuration.iteration to the iteration to start from"
            )
        return path

    def _ss_sweep(self, root: str, incomplete: bool) -> None:
        """The first time: remove what a killed run left in ``root`` (main process only,
        with no save of this run in flight)."""
        if incomplete not in self._ss_swept:
            self._ss_swept.add(incomplete)
            sweep(root, _is_automatic_name if incomplete else None)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Stage the state, start writing it to ``output_dir``, return the directory."""
        if not self._ss_supported():
            return str(super().save_state(output_dir, safe_serialization, **kwargs))
        self.wait_for_checkpoints()
        _probe("save_state")
        path = self._ss_output_dir(output_dir)
        os.makedirs(path, exist_ok=True)
        if kwargs:
            log.warning("save_state: %s apply to DeepSpeed only; ignored", ", ".join(kwargs))
        if self.project_configuration.save_on_each_node and self.num_processes > 1:
            log.warning(
                "save_state: save_on_each_node is not applied; every rank writes its part "
                "of one checkpoint in %s, which needs a filesystem all nodes share",
                path,
            )
        weights = [get_model_state_dict(module) for module in self._ss_modules()]
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, weights, path)
        state = self._ss_state(weights)
        response = async_save(state, path, timeout=self.slipstream_timeout)
        self._ss_pending, self._ss_pending_dir = response, path
        self._ss_staging = response
        if self.overlap_staging and self._ss_only_optimizer_changes(state):
            self._ss_step_hooks = [
                torch_optimizer(wrapped).register_step_pre_hook(self._ss_before_step)
                for wrapped in self._optimizers
            ]
        else:
            self.wait_for_staging()
        if not self.background_write:
            self.wait_for_checkpoints()
        self.project_configuration.iteration += 1
        return path

    def _ss_before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.wait_for_staging()

    def _ss_only_optimizer_changes(self, state: dict[str, Any]) -> bool:
        """No saved buffers, no registered tensors and no data loader state: until the
        next optimizer step, a training loop changes none of the saved state (the next
        batch moves a data loader)."""
        if any(k.startswith("dataloaders.") for k in state):
            return False
        models = [v for k, v in state.items() if k.startswith("models.")]
        if any(has_saved_buffers(m, w) for m in self._ss_modules() for w in models):
            return False
        customs = {k: v for k, v in state.items() if k.startswith("custom.")}
        return not any(isinstance(v, torch.Tensor) for v in flatten(customs)[0].values())

    def _ss_input_dir(self, input_dir: str | None) -> str:
        if input_dir is not None:
            path = os.path.expanduser(str(input_dir))
            if not os.path.isdir(path):
                raise CheckpointError(f"load_state: {path} is not a directory")
            if is_incomplete(path):
                raise incomplete_error(path)
            return path
        if not self.project_configuration.automatic_checkpoint_naming:
            raise CheckpointError(
                "load_state needs an input_dir when automatic checkpoint naming is off"
            )
        root = os.path.join(self.project_dir, "checkpoints")
        if self.is_main_process:
            self._ss_sweep(root, incomplete=False)
        folders = _checkpoint_folders(root) if os.path.isdir(root) else []
        complete = [f for f in folders if not is_incomplete(f)]
        if not complete:
            raise CheckpointError(f"load_state: no complete checkpoint in {root}")
        skipped = [f for f in folders if _iteration(f) > _iteration(complete[-1])]
        if skipped:
            log.warning(
                "load_state: skipped %s (incomplete: no .metadata, the save did not commit); "
                "loading %s",
                ", ".join(skipped),
                complete[-1],
            )
        return complete[-1]

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Restore everything :meth:`save_state` saved, in place.

        ``map_location`` is checked as accelerate checks it; the state goes where the
        live objects are (an optimizer's onto its parameters' devices) either way, as
        accelerate's ``load_state_dict`` calls put it. ``strict`` applies to the models;
        ``load_kwargs`` (``torch.load`` arguments) and other keywords have nothing to
        apply to in a slipstream checkpoint, and are refused."""
        self.wait_for_checkpoints()
        if not self._ss_supported():
            super().load_state(input_dir, load_kwargs, **kwargs)
            return
        path = self._ss_input_dir(input_dir)
        if not is_checkpoint(path):
            super().load_state(path, load_kwargs, **kwargs)
            return
        map_location = kwargs.pop("map_location", None)
        if map_location not in (None, "cpu", "on_device"):
            raise TypeError(
                "Unsupported optimizer map location passed, please choose one of `None`, "
                f"`'cpu'`, or `'on_device'` (got {map_location!r})"
            )
        strict = kwargs.pop("strict", True)
        if kwargs or load_kwargs:
            raise TypeError(
                f"load_state({path}): {', '.join([*kwargs, *(load_kwargs or {})])} cannot "
                "apply to a slipstream checkpoint (no torch.load or DeepSpeed load runs)"
            )
        _probe("load_state")
        keys = saved_keys(path)
        saved = {k.split(".", 1)[0] + "." + k.split(".", 2)[1] for k in keys if "." in k}
        customs = sorted(k for k in saved if k.startswith("custom."))
        if len(customs) != len(self._custom_objects):
            raise CheckpointError(
                f"{path} holds {len(customs)} custom object(s) but {len(self._custom_objects)} "
                "are registered with register_for_checkpointing"
            )
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, path)
        modules = [self.unwrap_model(m, keep_torch_compile=False) for m in models]
        target = self._ss_state([get_model_state_dict(m) for m in modules])
        for key in [k for k in target if k.startswith(("optimizers.", "dataloaders."))]:
            target[key] = saved_subtree(path, key)
        for key in [k for k in target if k.startswith(("samplers.", "dataloaders."))]:
            if key not in saved:  # as accelerate, which loads a sampler file if there is one
                del target[key]
        rank = f"rank{self.process_index}"
        if f"rng.{rank}" not in saved:
            log.info("%s holds no random state for process %d", path, self.process_index)
            del target["rng"]
        elif "cuda" in target["rng"][rank] and f"rng.{rank}.cuda" not in keys:
            del target["rng"][rank]["cuda"]
        load(target, path, strict=False)
        self._ss_apply(target, modules, path, strict)

    def _ss_apply(
        self, loaded: dict[str, Any], modules: list[torch.nn.Module], where: str, strict: bool
    ) -> None:
        options = StateDictOptions(strict=strict)
        for i, module in enumerate(modules):
            set_model_state_dict(module, loaded[f"models.{i}"], options=options)
        for i, wrapped in enumerate(self._optimizers):
            optimizer = torch_optimizer(wrapped)
            names = self._ss_parameter_names(optimizer)
            restore_optimizer_state(optimizer, names, loaded[f"optimizers.{i}"], where)
        for i, scheduler in enumerate(self._schedulers):
            scheduler.load_state_dict(loaded[f"schedulers.{i}"])
        for i, dataloader in enumerate(self._dataloaders):
            sampler = _seedable_sampler(dataloader)
            if sampler is not None and f"samplers.{i}" in loaded:
                sampler.epoch = loaded[f"samplers.{i}"]["epoch"]
                sampler.initial_seed = loaded[f"samplers.{i}"]["seed"]
            if f"dataloaders.{i}" in loaded:
                dataloader.load_state_dict(loaded[f"dataloaders.{i}"])
        if self.scaler is not None:
            self.scaler.load_state_dict(loaded["scaler"])
        for i, obj in enumerate(self._custom_objects):
            obj.load_state_dict(loaded[f"custom.{i}"])
        self.step = loaded["step"]
        if "rng" in loaded:
            rng.restore(loaded["rng"][f"rank{self.process_index}"])
