"""A training loop that checkpoints every step with slipstream and resumes where it stopped.

Run it twice: the second run resumes from the latest committed step.

    python examples/checkpoint_loop.py --root /tmp/slipstream-example --steps 20
"""

import argparse

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import slipstream as ss


class TrainState:
    """Model, optimizer and step as one Stateful object (the pattern DCP recommends)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, -1

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.step = sd["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/tmp/slipstream-example")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState(model, optim)

    with ss.Checkpointer(args.root, keep_last=2) as ck:
        if ck.latest() is not None:
            ck.load({"train": state})
            print(f"resumed from step {state.step}")
        pending = None
        for step in range(state.step + 1, args.steps):
            x = torch.randn(64, 256, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            if pending is not None:
                pending.staging_completion.result()  # staging overlapped forward and backward
            optim.step()
            optim.zero_grad()
            state.step = step
            pending = ck.save(step, {"train": state})
        ck.wait()
        print(f"trained to step {state.step}; committed steps: {ck.steps()}")


if __name__ == "__main__":
    main()
