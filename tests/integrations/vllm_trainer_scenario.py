"""A trainer process for :mod:`test_vllm_serve`: it joins a ``vllm serve`` engine through
:class:`~slipstream.integrations.vllm.VLLMWeightSync` and publishes version ``VERSION`` of
:mod:`vllm_model`'s weights, SIGKILLing itself at ``WHERE``:

- ``mid``: once half of the tensors were read (mid-publish);
- ``after-start``: once the engine answered ``start_weight_update``, before ``update_weights``;
- ``after-update``: once the engine answered ``update_weights`` (the version received
  whole and staged), before the swap pauses generation;
- ``after-pause``: once generation is paused for the swap, before ``finish_weight_update``.

Run as ``python vllm_trainer_scenario.py URL API_KEY VERSION WHERE`` (the key is the
workers' token too); prints ``joined`` once the engine is in its sync group.
"""

from __future__ import annotations

import os
import signal
import sys

import vllm_model as vm

from slipstream.integrations.vllm import HTTPEngine, VLLMWeightSync


def _die(*_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(url: str, api_key: str, version: int, where: str) -> None:
    sync = VLLMWeightSync([HTTPEngine(url, api_key, timeout=60.0)], timeout=60.0, token=api_key)
    print("joined", flush=True)
    weights = vm.model(version).state_dict()
    if where == "after-start":
        HTTPEngine.update_weights = _die  # type: ignore[method-assign]
    elif where == "after-update":
        HTTPEngine.pause_generation = _die  # type: ignore[method-assign]
    elif where == "after-pause":
        HTTPEngine.finish_weight_update = _die  # type: ignore[method-assign]
    elif where != "mid":
        raise ValueError(
            f"where must be mid, after-start, after-update or after-pause, got {where!r}"
        )

    def dying():
        for i, item in enumerate(weights.items()):
            if where == "mid" and i == len(weights) // 2:
                _die()
            yield item

    sync.publish(dying(), version)
    raise AssertionError("the trainer outlived its own SIGKILL")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
