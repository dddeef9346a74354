"""The environment a test gives a Ray program it runs as a subprocess.

Ray starts its worker processes at nice 15 (``RAY_worker_niceness``). Beside another job
that keeps every core busy at normal priority (``make check-busy``), an actor's start,
which imports torch and verl, then took 150 s (a restart 183 s) instead of 5.8 s. The
tests run Ray's workers at the suite's own priority, as Ray's job manager runs a
submitted job's (it sets the same variable to 0).
"""

from __future__ import annotations

import os


def ray_env() -> dict[str, str]:
    """This process's environment, with Ray's workers at its own priority."""
    return {**os.environ, "RAY_worker_niceness": "0"}
