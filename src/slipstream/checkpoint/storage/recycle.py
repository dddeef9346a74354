"""Data files of retired checkpoints, kept for the next save to write over.

Checkpointing often, the costly part of retention is not the deleting itself but what it
sets off: the filesystem frees the old files' blocks (on a disk mounted with ``discard``,
the device is told to drop them too) and the next save allocates as many again. Writing
the next save's bytes over the retired files' blocks instead skips both (measured in
docs/benchmark-history.md, "Checkpoint: what a save costs the training loop").

Invariants:

* A file in the spare directory belongs to no checkpoint: its step was uncommitted (its
  ``.metadata`` removed) before the file was moved there.
* A retired file is kept only if nothing else has it open: Linux grants a write lease on a
  file only when no other open file (in any process) refers to it, mappings included. A
  reader that opened the file before it was retired therefore never sees it overwritten;
  the file is deleted instead, as without recycling, and the reader keeps its bytes.
* Nothing opens a file in the spare directory but the save that claims it: the directory
  is hidden and never listed as a step, and the old path is gone once a file is moved.
  A save (or a replica being received, on the local tier's replication thread) may claim a spare the
  moment it lands there, while retirement still checks it: a spare that is gone by then is
  the claimer's, and retirement goes on with the step's other files.
* Where leases are not available (other systems, some network filesystems), retired files
  are deleted.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from ..format.names import DATA_FILE_SUFFIX


def retire(step_dir: Path, spare_dir: Path) -> None:
    """Move the data files of the uncommitted ``step_dir`` into ``spare_dir`` where their
    names are free there and nothing else has them open; delete the rest and the directory.
    """
    spare_dir.mkdir(exist_ok=True)
    for entry in os.scandir(step_dir):
        if not (entry.name.endswith(DATA_FILE_SUFFIX) and entry.is_file(follow_symlinks=False)):
            continue
        spare = spare_dir / entry.name
        if spare.exists():
            continue
        os.rename(entry.path, spare)
        if not _open_nowhere_else(spare):
            spare.unlink(missing_ok=True)  # gone: a save claimed it in between, it is its own
    shutil.rmtree(step_dir)


def claim(spare_dir: Path, name: str, dest: str) -> None:
    """Move the spare ``name`` to ``dest`` for a save to write over, unless ``dest`` already
    exists (it is then written over itself). Without such a spare, or where it cannot be
    moved, the save writes a new file as it would without recycling."""
    if os.path.exists(dest):
        return
    try:
        os.rename(spare_dir / name, dest)
    except OSError:
        pass


def discard_spares(spare_dir: Path) -> None:
    """Delete every spare (a run that ends keeps only its checkpoints on disk)."""
    shutil.rmtree(spare_dir, ignore_errors=True)


def _open_nowhere_else(path: Path) -> bool:
    """Whether no open file other than the one opened here refers to ``path``: a write
    lease is granted only then. Released at once; ``False`` wherever leases are refused."""
    set_lease = getattr(fcntl, "F_SETLEASE", None)
    if set_lease is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, set_lease, fcntl.F_WRLCK)
        fcntl.fcntl(fd, set_lease, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
