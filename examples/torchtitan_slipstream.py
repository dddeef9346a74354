"""A torchtitan 0.3.0 job config whose checkpoints go through slipstream.

torchtitan 0.3.0 configures jobs with Python functions (``--module`` names a module,
``--config`` a function in it returning ``Trainer.Config``). Importing this module, which
torchtitan's ``ConfigManager`` does on every rank before it builds the trainer, points the
``dcp`` name of torchtitan's checkpoint manager at ``slipstream.dcp``; nothing else in
torchtitan changes. Put this file on ``PYTHONPATH`` and launch as usual::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module torchtitan_slipstream --config llama3_debugmodel_slipstream

Command-line overrides work as before (``--checkpoint.interval 100``,
``--checkpoint.async_mode async_with_pinned_mem``...). Run directly, it prints what it
configured (it needs neither a GPU nor a model).
"""

from __future__ import annotations

import torchtitan.components.checkpointer.dcp as titan_checkpointer
from torchtitan.components.checkpointer.dcp import CheckpointManager

import slipstream.dcp

titan_checkpointer.dcp = slipstream.dcp  # the switch: every dcp.* call of the manager


def slipstream_checkpoint(**overrides: object) -> CheckpointManager.Config:
    """torchtitan's checkpoint section, saving asynchronously: ``"async"`` returns once
    slipstream has staged the state; the upload overlaps the next steps."""
    settings: dict[str, object] = dict(
        enable=True,
        folder="checkpoint",
        interval=500,
        async_mode="async",
        keep_latest_k=3,
        last_save_model_only=False,
    )
    settings.update(overrides)
    return CheckpointManager.Config(**settings)  # type: ignore[arg-type]


def llama3_debugmodel_slipstream():  # type: ignore[no-untyped-def]
    """torchtitan's Llama 3 debug model, checkpointing every 10 steps through slipstream."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint = slipstream_checkpoint(interval=10)
    return config


def llama3_8b_slipstream():  # type: ignore[no-untyped-def]
    """torchtitan's Llama 3 8B, checkpointing every 500 steps through slipstream."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    config = llama3_8b()
    config.checkpoint = slipstream_checkpoint(interval=500)
    return config


if __name__ == "__main__":
    checkpoint = slipstream_checkpoint(interval=10)
    print(
        f"torchtitan checkpoints through slipstream.dcp: {titan_checkpointer.dcp is slipstream.dcp}"
    )
    print(
        f"checkpoint: enable={checkpoint.enable} async_mode={checkpoint.async_mode} "
        f"interval={checkpoint.interval} keep_latest_k={checkpoint.keep_latest_k}"
    )
