"""Run a command while a bounded CPU burner keeps every usable core busy.

``python tests/busy_machine.py [--cores N] [--limit SECONDS] -- COMMAND...`` starts N
spinning processes (default: every core this process may use) at the command's own
priority, runs COMMAND, then stops and joins the burners and exits with COMMAND's status.
It is how ``make check-busy`` checks that the suite holds on a loaded machine, the way a
user's laptop or a shared CI runner is loaded.

The burners are bounded whatever happens to the parent: each stops by itself after
``--limit`` seconds, and as soon as its parent is gone (it checks between spins), so a
killed run never leaves a core spinning.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

_SPIN_SECONDS = 0.05


def _burn(parent: int, deadline: float) -> None:
    x = 0
    while time.monotonic() < deadline and os.getppid() == parent:
        spin_until = time.monotonic() + _SPIN_SECONDS
        while time.monotonic() < spin_until:
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=usable_cores(), help="burners to start")
    parser.add_argument(
        "--limit", type=float, default=4 * 3600, help="seconds after which burners stop"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (busy_machine.py [options] -- COMMAND...)")
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + args.limit
    burners = [
        ctx.Process(target=_burn, args=(os.getpid(), deadline), daemon=True)
        for _ in range(args.cores)
    ]
    for burner in burners:
        burner.start()
    print(f"busy_machine: {args.cores} burner(s) for at most {args.limit:.0f} s", flush=True)
    try:
        return subprocess.call(command)
    finally:
        for burner in burners:
            burner.terminate()
        for burner in burners:
            burner.join(timeout=10)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
