"""A training loop written against torch.distributed.checkpoint, switched to slipstream by
its import line alone; then the whole checkpoint read back without a template.

    python examples/switch_from_dcp.py --root /tmp/run
"""

from __future__ import annotations

import argparse
import os

import torch

import slipstream as ss
import slipstream.dcp as dcp  # was: import torch.distributed.checkpoint as dcp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pending = None
    for step in range(1, args.steps + 1):
        model(torch.randn(4, 8)).square().mean().backward()
        if pending is not None:
            pending.result()  # the previous save is durable before the state changes again
        optimizer.step()
        optimizer.zero_grad()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
        # As with DCP: returns once staged, a Future of the checkpoint's Metadata.
        pending = dcp.async_save(state, checkpoint_id=os.path.join(args.root, f"step_{step}"))
    assert pending is not None
    metadata = pending.result()
    print(f"saved {len(metadata.state_dict_metadata)} entries at step {args.steps}")

    resumed = {"model": torch.nn.Linear(8, 2).state_dict(), "step": 0}
    dcp.load(resumed, checkpoint_id=os.path.join(args.root, f"step_{args.steps}"))
    same = all(torch.equal(resumed["model"][k], v) for k, v in model.state_dict().items())
    print(f"resumed step {resumed['step']}, model equal: {same} (optimizer keys ignored)")

    whole = ss.load_all(os.path.join(args.root, f"step_{args.steps}"))
    print(f"load_all: optimizer state keys {list(whole['optim']['state'])}")
    fresh = torch.optim.AdamW(torch.nn.Linear(8, 2).parameters(), lr=1e-2)
    fresh.load_state_dict(whole["optim"])
    print(f"optimizer restored: step {int(fresh.state_dict()['state'][0]['step'])}")


if __name__ == "__main__":
    main()
