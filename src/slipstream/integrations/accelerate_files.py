"""The files ``Accelerator.save_state`` writes on this process, and writing them.

:func:`state_files` reads the state accelerate's ``save_accelerator_state`` and
``save_custom_state`` save, under the names they give it, limited to the files they write
on this process: the models (``model.safetensors`` or ``pytorch_model.bin``, ``_<i>`` from
the second on), optimizers, schedulers, seedable samplers and registered objects on the
process accelerate's ``save`` writes on (the main one, or each node's with
``save_on_each_node``); the stateful data loaders' states, the gradient scaler's and this
process's ``random_states_<i>.pkl`` on every process. It only reads: the values are the
live ones (copy them before the state moves on), except the random generators' states,
which are taken at the call. :func:`write_files` writes them as accelerate does
(safetensors with ``{"format": "pt"}`` metadata and aliases removed, ``torch.save``
otherwise), each file under a hidden name fsynced and renamed into place, so processes
writing the same name (accelerate has each write ``scaler.pt``) never mix their bytes.
"""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_NAME,
    SAMPLER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_NAME,
    is_cuda_available,
    is_hpu_available,
    is_mlu_available,
    is_musa_available,
    is_neuron_available,
    is_sdaa_available,
    is_torch_xla_available,
    is_xpu_available,
)
from accelerate.utils.other import clean_state_dict_for_safetensors
from safetensors.torch import save_file

from ..checkpoint.files import torch_save
from ..checkpoint.files.atomic import saving_name
from ..checkpoint.storage.files import fsync_file


def _numbered(name: str, i: int) -> str:
    """accelerate's name of the ``i``-th file of a kind: ``optimizer.bin``, ``optimizer_1.bin``."""
    stem, dot, ext = name.partition(".")
    return name if i == 0 else f"{stem}_{i}{dot}{ext}"


def state_files(
    accelerator: Any, weights: list[dict[str, Any]], safe_serialization: bool
) -> dict[str, Any]:
    """File name -> what accelerate's ``save_state`` writes in it on this process, with
    ``weights`` the model state dicts its save hooks left (see the module's docstring)."""
    state = accelerator.state
    config = accelerator.project_configuration
    writes_shared = (
        state.is_local_main_process if config.save_on_each_node else state.is_main_process
    )
    files: dict[str, Any] = {}
    if writes_shared:
        model_name = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
        for i, model_state in enumerate(weights):
            files[_numbered(model_name, i)] = model_state
        for i, optimizer in enumerate(accelerator._optimizers):
            files[_numbered(f"{OPTIMIZER_NAME}.bin", i)] = optimizer.state_dict()
        for i, scheduler in enumerate(accelerator._schedulers):
            files[_numbered(f"{SCHEDULER_NAME}.bin", i)] = scheduler.state_dict()
    for i, dataloader in enumerate(accelerator._dataloaders):
        if writes_shared and isinstance(dataloader.dataset, IterableDatasetShard):
            sampler = dataloader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                files[_numbered(f"{SAMPLER_NAME}.bin", i)] = sampler
        if getattr(dataloader, "use_stateful_dataloader", False):
            files[_numbered("dl_state_dict.bin", i)] = dataloader.state_dict()
    if accelerator.scaler is not None:
        files[SCALER_NAME] = accelerator.scaler.state_dict()
    rng_name = f"{RNG_STATE_NAME}_{state.process_index}.pkl"
    files[rng_name] = random_states(accelerator.step)
    if writes_shared:
        for i, obj in enumerate(accelerator._custom_objects):
            files[f"custom_checkpoint_{i}.pkl"] = obj.state_dict()
    return files


def random_states(step: int) -> dict[str, Any]:
    """What accelerate writes to ``random_states_<i>.pkl``: ``step`` and every generator's
    state now (fresh copies, which the generators moving on leave as they are)."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if is_xpu_available():
        states["torch_xpu_manual_seed"] = torch.xpu.get_rng_state_all()
    if is_mlu_available():
        states["torch_mlu_manual_seed"] = torch.mlu.get_rng_state_all()  # type: ignore[attr-defined]
    elif is_sdaa_available():
        states["torch_sdaa_manual_seed"] = torch.sdaa.get_rng_state_all()  # type: ignore[attr-defined]
    elif is_musa_available():
        states["torch_musa_manual_seed"] = torch.musa.get_rng_state_all()  # type: ignore[attr-defined]
    if is_hpu_available():
        states["torch_hpu_manual_seed"] = torch.hpu.get_rng_state_all()  # type: ignore[attr-defined]
    if is_neuron_available():
        states["torch_neuron_manual_seed"] = torch.neuron.get_rng_state_all()  # type: ignore[attr-defined]
    if is_cuda_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    if is_torch_xla_available():
        import torch_xla.core.xla_model as xm  # type: ignore[import-not-found]

        states["xm_seed"] = xm.get_rng_state()
    return states


def write_files(files: dict[str, Any], directory: str) -> None:
    """Write each of ``files`` (a :func:`state_files`, or a copy of one) into ``directory``."""
    for name, value in files.items():
        path = os.path.join(directory, name)
        if name.endswith(".safetensors"):
            _save_safetensors(value, path)
        else:
            torch_save(value, path)


def _save_safetensors(state: dict[str, Any], path: str) -> None:
    """accelerate's ``save(state, path, safe_serialization=True)``, through a hidden name."""
    if isinstance(state, OrderedDict):
        state = clean_state_dict_for_safetensors(state)
    hidden = saving_name(path)
    try:
        save_file(state, hidden, metadata={"format": "pt"})
        fsync_file(hidden)
        os.replace(hidden, path)
    except BaseException:
        if os.path.exists(hidden):
            os.remove(hidden)
        raise
