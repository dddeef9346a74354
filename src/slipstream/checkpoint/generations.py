"""File names of a save: a save over a committed checkpoint writes beside it, never into it.

A location holds at most one committed checkpoint, the one its ``.metadata`` describes. A
save into a location picks the first *generation* whose data file names that checkpoint
does not use (generation 0 in a fresh location) and writes its data files and index under
those names. The old checkpoint stays committed and loadable, byte for byte, until the new
``.metadata`` replaces the old one in one atomic put; only then are the old files deleted.
A save that fails at any point, or a process killed at any point, leaves the old
checkpoint as it was.

Every rank reads the same committed ``.metadata`` before it writes (the previous save into
the location has committed on every rank by then), so all ranks pick the same generation
without talking to each other.
"""

from __future__ import annotations

import re

from torch.distributed.checkpoint.metadata import Metadata

from .plan import DATA_FILE_SUFFIX

GENERATIONS = 3
"""Enough that one is always free: a committed checkpoint written by slipstream uses one;
one written by ``dcp.save`` uses ``__{rank}_{n}.distcp`` names, the generation-0 names."""
BASE_INDEX_FILE = ".slipstream.json"
_GENERATION = re.compile(r"\.g(\d+)" + re.escape(DATA_FILE_SUFFIX) + "$")


def data_file(plan_file: str, generation: int) -> str:
    """The name generation ``generation`` gives the plan's data file ``plan_file``."""
    if generation == 0:
        return plan_file
    return plan_file.removesuffix(DATA_FILE_SUFFIX) + f".g{generation}{DATA_FILE_SUFFIX}"


def index_file(generation: int) -> str:
    """The name of slipstream's index (checksums) in generation ``generation``."""
    return BASE_INDEX_FILE if generation == 0 else f".slipstream.g{generation}.json"


def files_of(metadata: Metadata) -> set[str]:
    """The data files a committed checkpoint's metadata points to."""
    return {info.relative_path for info in metadata.storage_data.values()}


def generation_of(metadata: Metadata) -> int:
    """The generation a slipstream-written checkpoint was saved in (0 for DCP's)."""
    for name in files_of(metadata):
        match = _GENERATION.search(name)
        if match:
            return int(match.group(1))
    return 0


def free_generation(in_use: set[str], plan_files: list[str]) -> int:
    """The first generation none of whose data files (``plan_files`` renamed) is in use."""
    for generation in range(GENERATIONS):
        if not in_use & {data_file(f, generation) for f in plan_files}:
            return generation
    raise AssertionError(f"every generation of {plan_files} is in use by {sorted(in_use)}")
