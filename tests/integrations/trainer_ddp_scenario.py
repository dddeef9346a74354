"""The Hugging Face Trainer under DDP (2 CPU processes, gloo), run by ``torch.distributed.run``.

Every process runs, in order: the plain ``Trainer`` uninterrupted with no saves (the
reference); ``SlipstreamTrainer`` stopped after step 5 (it saved step 3);
``SlipstreamTrainer`` resumed from the last checkpoint to the end. Rank 0 writes
what the test compares with ``torch.save``: both runs' final training state, and the
checkpoint directories as rank 0 saw them after each run.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from test_transformers import arguments, dataset, tiny_model  # noqa: E402
from trainer_runs import StopAt, training_state  # noqa: E402
from transformers import Trainer  # noqa: E402

from slipstream.integrations.transformers import SlipstreamTrainer  # noqa: E402


def listing(out: str) -> list[str]:
    return sorted(os.listdir(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ddp = {"ddp_backend": "gloo"}
    ref = Trainer(
        model=tiny_model(),
        args=arguments(os.path.join(args.root, "ref"), save_strategy="no", **ddp),
        train_dataset=dataset(),
    )
    ref.train()
    assert dist.is_initialized() and dist.get_world_size() == 2, "not a 2-process DDP run"
    out = os.path.join(args.root, "run")
    first = SlipstreamTrainer(
        model=tiny_model(),
        args=arguments(out, **ddp),
        train_dataset=dataset(),
        callbacks=[StopAt(5)],
    )
    first.train()
    dist.barrier()
    after_first = listing(out)
    resumed = SlipstreamTrainer(
        model=tiny_model(), args=arguments(out, **ddp), train_dataset=dataset()
    )
    resumed.train(resume_from_checkpoint=True)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(
            {
                "world_size": dist.get_world_size(),
                "reference": training_state(ref),
                "resumed": training_state(resumed),
                "stopped_at": first.state.global_step,
                "after_first": after_first,
                "after_resume": listing(out),
            },
            args.out,
        )


if __name__ == "__main__":
    main()
