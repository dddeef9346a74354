"""A trainer process for :mod:`test_vllm_serve`: it joins a ``vllm serve`` engine through
:class:`~slipstream.integrations.vllm.VLLMWeightSync` and publishes version ``VERSION`` of
:mod:`vllm_model`'s weights, SIGKILLing itself once half of the tensors were read (mid-publish).

Run as ``python vllm_trainer_scenario.py URL API_KEY VERSION`` (the key is the workers'
token too); prints ``joined`` once the
engine is in its sync group.
"""

from __future__ import annotations

import os
import signal
import sys

import vllm_model as vm

from slipstream.integrations.vllm import HTTPEngine, VLLMWeightSync


def main(url: str, api_key: str, version: int) -> None:
    sync = VLLMWeightSync([HTTPEngine(url, api_key, timeout=60.0)], timeout=60.0, token=api_key)
    print("joined", flush=True)
    weights = vm.model(version).state_dict()

    def dying():
        for i, item in enumerate(weights.items()):
            if i == len(weights) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield item

    sync.publish(dying(), version)
    raise AssertionError("the trainer outlived its own SIGKILL")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
