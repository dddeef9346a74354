"""Every name a checkpoint directory gives its files, and which names stay inside it.

Pure functions and constants, no storage access: what the save writes, the load reads, the
tiers list and the storage backends recycle are all named here, so no side imports another
for a file name.

**A checkpoint's files.** DCP's ``.metadata`` commits a checkpoint; each rank writes one data
file (``__{rank}_0.distcp``); slipstream's index (``.slipstream.json``) holds checksums. A
``Checkpointer`` root holds one directory per step (``step_<n>``) and a hidden ``.spare``
directory of retired data files (:mod:`..storage.recycle`).

**Generations: a save over a committed checkpoint writes beside it, never into it.**

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

**Containment: the names a checkpoint's metadata gives its files stay inside it.**
A checkpoint's ``.metadata`` (DCP's ``storage_data``) and slipstream's index name the files
its bytes are read from, relative to the checkpoint's directory or prefix. A load reads only
what those names resolve to, so a name that leaves the checkpoint (``..``, an absolute
path, a URL or another bucket, a drive letter) would make the load read whatever the
process can read, into the caller's tensors. Such a name is never a file the checkpoint
wrote: it is refused, on every backend, before any byte is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CorruptCheckpointError

METADATA_FILE = ".metadata"
"""DCP's metadata file: a checkpoint is committed exactly when it exists."""
DATA_FILE_SUFFIX = ".distcp"
SPARE_DIR = ".spare"
"""Name of the directory under a :class:`~slipstream.Checkpointer` root that holds spares."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


def data_file_name(rank: int) -> str:
    """The data file rank ``rank`` writes (generation 0)."""
    return f"__{rank}_0{DATA_FILE_SUFFIX}"


def step_dir(step: int) -> str:
    """The directory name of ``step`` under a checkpointer's root."""
    return f"step_{int(step)}"


def step_dirs(children: Iterable[str]) -> dict[int, str]:
    """Step -> directory name, for every ``step_<n>`` among ``children`` (a root's listing)."""
    found = {}
    for name in children:
        match = _STEP_DIR.match(name)
        if match:
            found[int(match.group(1))] = name
    return found


_TEMPORARY = re.compile(
    r"^(\.metadata|\.slipstream(\.g\d+)?\.json|\.local_commit|model\.safetensors\.index\.json"
    r"|\.[^/]+\.safetensors)\.tmp$"
)


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a file slipstream writes under a temporary name and then renames
    into place (a ``.metadata``, index or marker put, an exported safetensors file): one
    found while no save is running was left by a process killed mid-write."""
    return bool(_TEMPORARY.match(name))


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


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
"""``s3:``, ``file:``, ``https:``, or a drive letter ``C:``."""


def outside_reason(name: object) -> str | None:
    """Why ``name`` does not name a file inside the checkpoint, or ``None`` if it does."""
    if not isinstance(name, str) or not name:
        return "not a non-empty file name"
    if "\x00" in name:
        return "it holds a NUL character"
    if name.startswith(("/", "\\")):
        return "it is an absolute path"
    if _SCHEME.match(name):
        return "it is a URL or names another volume"
    parts = re.split(r"[/\\]", name)
    if ".." in parts:
        return "it climbs out of the checkpoint with '..'"
    if any(part in ("", ".") for part in parts):
        return "it has an empty or '.' path component"
    return None


def check_inside(name: object, checkpoint: str, source: str) -> str:
    """``name`` if it names a file inside ``checkpoint``; else a
    :class:`CorruptCheckpointError` naming it and where it came from (``source``)."""
    reason = outside_reason(name)
    if reason is not None:
        raise CorruptCheckpointError(
            f"{checkpoint}: {source} names the file {name!r}, which is not inside the "
            f"checkpoint ({reason}); refused: the checkpoint's metadata is corrupt or was "
            "tampered with"
        )
    assert isinstance(name, str)
    return name
