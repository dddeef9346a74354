"""The names of a step's directory under a checkpointer's root (``step_<n>``), one place
for the durable tier (:mod:`.checkpointer`) and the local tier (:mod:`.local_tier`)."""

from __future__ import annotations

import re

from .storage import Storage

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(step: int) -> str:
    """The directory name of ``step``."""
    return f"step_{int(step)}"


def step_dirs(storage: Storage) -> dict[int, str]:
    """Step -> directory name, for every ``step_<n>`` child of ``storage``."""
    found = {}
    for name in storage.list_children():
        match = _STEP_DIR.match(name)
        if match:
            found[int(match.group(1))] = name
    return found
