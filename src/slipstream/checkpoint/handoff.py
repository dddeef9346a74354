"""Calls slipstream does not serve, handed to ``torch.distributed.checkpoint`` unchanged.

Invariant: a handed-off call runs DCP's own function with exactly the DCP arguments the
caller gave, so it does what DCP does, return value and errors included; the only thing
slipstream adds is one log line per reason and process, saying why.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch.distributed.checkpoint as torch_dcp

from .dcp_args import HandOff
from .storage import Location

logger = logging.getLogger("slipstream.dcp")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(message: str) -> None:
    """Log ``message`` at INFO, the first time this process sees it."""
    with _logged_lock:
        if message in _logged:
            return
        _logged.add(message)
    logger.info("%s", message)


def dcp_checkpoint_id(
    checkpoint_id: Location | None, storage_options: dict[str, Any] | None, why: HandOff
) -> str | os.PathLike[str] | None:
    """``checkpoint_id`` as DCP takes it; slipstream's own storage arguments cannot go
    to DCP, and are refused naming why the call had to."""
    if storage_options:
        raise ValueError(
            f"storage_options= configures slipstream's storage, but this call goes to "
            f"torch.distributed.checkpoint ({why.reason})"
        )
    if isinstance(checkpoint_id, str) and checkpoint_id.startswith("memory://"):
        raise ValueError(
            f"checkpoint_id={checkpoint_id!r} is slipstream's in-process storage, which "
            f"torch.distributed.checkpoint, which this call goes to, cannot reach ({why.reason})"
        )
    if checkpoint_id is None or isinstance(checkpoint_id, (str, os.PathLike)):
        return checkpoint_id
    raise TypeError(
        f"checkpoint_id: a slipstream {type(checkpoint_id).__name__} cannot be given to "
        f"torch.distributed.checkpoint, which this call goes to ({why.reason})"
    )


def save(why: HandOff, state_dict: dict[str, Any], **dcp_arguments: Any) -> Any:
    """``dcp.save`` (returns its ``Metadata``)."""
    log_once(f"slipstream hands this save to torch.distributed.checkpoint: {why.reason}")
    return torch_dcp.save(state_dict, **dcp_arguments)


def async_save(why: HandOff, state_dict: dict[str, Any], **dcp_arguments: Any) -> Any:
    """``dcp.async_save`` (returns its ``Future`` or ``AsyncSaveResponse``)."""
    log_once(f"slipstream hands this async_save to torch.distributed.checkpoint: {why.reason}")
    return torch_dcp.async_save(state_dict, **dcp_arguments)


def load(why: HandOff, state_dict: dict[str, Any], **dcp_arguments: Any) -> None:
    """``dcp.load``, which unpickles the checkpoint's values with no allow-list."""
    log_once(
        f"slipstream hands this load to torch.distributed.checkpoint: {why.reason} (DCP "
        "unpickles its values without slipstream's allow-list)"
    )
    torch_dcp.load(state_dict, **dcp_arguments)
