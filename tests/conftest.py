import os
import sys
import uuid

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
# Test helpers import by name from any folder below their package's tests: tests/ (dist_utils,
# hf_models, ...), tests/checkpoint/ (fault_storage, checkpoint_states) and tests/sync/
# (sync_procs). Test files carry no __init__.py, so every test file's basename is unique.
for helpers in (TESTS, os.path.join(TESTS, "checkpoint"), os.path.join(TESTS, "sync")):
    sys.path.insert(0, helpers)

from storage_server import CREDENTIALS, UNSET, moto_server  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
    """A local S3 (moto's server, in a child process) for the session; yields its endpoint.

    While it runs, ``AWS_ENDPOINT_URL`` and fake credentials are set in ``os.environ`` (so
    processes the tests spawn inherit them) and variables that would redirect requests are
    unset; all are restored at the end of the session.
    """
    with moto_server() as endpoint, pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", endpoint)
        for name, value in CREDENTIALS.items():
            env.setenv(name, value)
        for name in UNSET:
            env.delenv(name, raising=False)
        yield endpoint


@pytest.fixture
def s3_bucket(s3_server):
    """A new, empty bucket on :func:`s3_server`; ``s3://<name>`` addresses it."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


_SUMMARY_LINES: list[str] = []


@pytest.fixture
def summary_line(request):
    """Adds a line to the end of the run's terminal output, shown whatever ``-q``/``-s``
    (for a result CI logs should show, such as a conformance count). The line travels in
    the test's report, so it reaches the terminal from a pytest-xdist worker too."""
    return lambda line: request.node.user_properties.append(("summary_line", line))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _SUMMARY_LINES.extend(v for k, v in report.user_properties if k == "summary_line")


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY_LINES:
        terminalreporter.write_line(line)
