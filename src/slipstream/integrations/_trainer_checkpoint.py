"""One Hugging Face Trainer checkpoint's files, written off the training thread.

:class:`StagedCheckpoint` is what ``Trainer._save_checkpoint`` saves at one step, its tensors
already copied into host memory; :func:`write_checkpoint_files` writes it as the Trainer's
own code does: the model through ``save_pretrained`` (``model.safetensors``, or its shards
and index, ``config.json``, ``generation_config.json``), or with
``safetensors.torch.save_file`` for a model that is no ``PreTrainedModel`` (``Trainer._save``
does the same); every other file (``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
``rng_state*.pth``) with ``torch.save``. The small files the training thread wrote itself
(``trainer_state.json``, ``training_args.bin``, the tokenizer, a subclass's own files) are
moved in beside them, and the directory is renamed to ``checkpoint-N`` once every file is
durable. Then older checkpoints are rotated out as the Trainer's ``rotate_checkpoints`` does.

Invariants: ``checkpoint-N`` appears complete or not at all (it is assembled under a hidden
sibling, :func:`~slipstream.checkpoint.files.atomic_directory`); after the call, success or
failure, nothing hidden is left beside it; a checkpoint rotation drops is renamed to a
hidden name before it is deleted, so none is ever seen half deleted.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from transformers import PreTrainedModel
from transformers.trainer_utils import sort_checkpoints
from transformers.utils import SAFE_WEIGHTS_NAME

from ..checkpoint.files import atomic_directory
from .removal import delete_now


@dataclass
class StagedCheckpoint:
    """What one save writes, its tensors in host memory the next save reuses."""

    final: str
    """``output_dir/checkpoint-N``."""
    written: str
    """The hidden directory whose ``checkpoint-N`` the training thread wrote its files into."""
    model_state: dict[str, torch.Tensor] | None = None
    """The model's state dict as ``Trainer._save`` saves it; ``None``: the Trainer's own
    ``_save`` already wrote the model's files into ``written``."""
    pretrained: PreTrainedModel | None = None
    """The model whose ``save_pretrained`` writes ``model_state``; ``None``: plain safetensors."""
    torch_files: dict[str, Any] = field(default_factory=dict)
    """File name -> the object ``torch.save`` writes there."""
    save_total_limit: int | None = None
    best_model_checkpoint: str | None = None


def write_checkpoint_files(checkpoint: StagedCheckpoint) -> None:
    """Write ``checkpoint``, rename it into place, rotate; see the module's docstring."""
    try:
        with atomic_directory(checkpoint.final) as directory:
            _write_model(checkpoint, directory)
            for name, obj in checkpoint.torch_files.items():
                torch.save(obj, os.path.join(directory, name))
            # After the model's files, as in the Trainer: a file of the same name wins.
            _move_entries(
                os.path.join(checkpoint.written, os.path.basename(checkpoint.final)), directory
            )
    finally:
        shutil.rmtree(checkpoint.written, ignore_errors=True)
    rotate(
        os.path.dirname(checkpoint.final),
        checkpoint.save_total_limit,
        checkpoint.best_model_checkpoint,
    )


def _write_model(checkpoint: StagedCheckpoint, directory: str) -> None:
    if checkpoint.model_state is None:
        return
    if checkpoint.pretrained is not None:
        checkpoint.pretrained.save_pretrained(directory, state_dict=checkpoint.model_state)
    else:
        safetensors.torch.save_file(
            checkpoint.model_state,
            os.path.join(directory, SAFE_WEIGHTS_NAME),
            metadata={"format": "pt"},
        )


def _move_entries(source: str, target: str) -> None:
    try:
        names = os.listdir(source)
    except FileNotFoundError:
        return
    for name in names:
        os.replace(os.path.join(source, name), os.path.join(target, name))


def rotate(run_dir: str, limit: int | None, best: str | None) -> None:
    """The Trainer's ``rotate_checkpoints(use_mtime=True)``: keep ``limit`` checkpoints, the
    newest and the best always, delete the oldest others; each through a hidden name."""
    if limit is None or limit <= 0:
        return
    checkpoints = sort_checkpoints(run_dir, use_mtime=True)
    if len(checkpoints) <= limit:
        return
    protected = {checkpoints[-1]}
    if best is not None:
        protected.add(str(Path(best)))
    keep = max(limit, len(protected))
    remaining = len(checkpoints)
    for checkpoint in checkpoints:
        if remaining <= keep:
            break
        if checkpoint not in protected:
            delete_now(checkpoint)
            remaining -= 1
