"""A local S3 for tests: moto's standalone server in a child process this module owns.

The server runs as ``python -m moto.server`` on 127.0.0.1 and a free port, so neither its
requests nor its state share the test process (its GIL, moto's in-process mocks). It keeps
everything in memory and checks no credentials unless :func:`enforce_auth` turns that on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import BinaryIO

from dist_utils import free_port

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""What the server accepts (any key while auth is off); set with ``AWS_ENDPOINT_URL``."""
UNSET = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_PROFILE")
"""Variables that would send requests elsewhere or sign them differently."""


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(f"{endpoint}/moto-api/data.json", timeout=1).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@contextlib.contextmanager
def moto_server(log: BinaryIO | None = None, spool_dir: str | None = None) -> Iterator[str]:
    """Run a moto server for the block; yield its endpoint URL. Its output (one line per
    request) goes to ``log`` (a temporary file by default); objects it spools to files go
    to ``spool_dir`` when given. The process is terminated (killed if it does not exit in
    :data:`STOP_TIMEOUT_S`) and waited for on exit. The benchmarks use it too."""
    with contextlib.ExitStack() as stack:
        if log is None:
            log = stack.enter_context(tempfile.TemporaryFile())
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if spool_dir is not None:
            env["TMPDIR"] = spool_dir
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _answers(endpoint):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    output = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"moto server on port {port} did not start:\n{output}")
                time.sleep(0.05)
            yield endpoint
        finally:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)


def _set_auth(endpoint: str, free_requests: str) -> None:
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=free_requests.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    urllib.request.urlopen(request, timeout=5).close()


@contextlib.contextmanager
def enforce_auth(endpoint: str) -> Iterator[None]:
    """Make the server check credentials for the block: then only keys created through its
    IAM pass, so every request of the test's fake keys is refused with a 403."""
    _set_auth(endpoint, "0")
    try:
        yield
    finally:
        _set_auth(endpoint, "inf")
