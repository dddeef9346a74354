"""accelerate's FSDP sharded checkpoint path through ``slipstream.dcp``, exact against DCP.

On 2 gloo ranks an FSDP2 model's sharded state dict is saved and loaded back with the calls
accelerate's ``save_fsdp_model`` / ``load_fsdp_model`` make (``dist_cp.save(state_dict=
{"model": ...}, storage_writer=dist_cp.FileSystemWriter(d), planner=DefaultSavePlanner())``
and the matching load), once with ``dist_cp`` being DCP and once ``slipstream.dcp``; then
accelerate's own ``merge_fsdp_weights`` merges each directory. Both give the same tensors,
equal to the model's.
"""

from __future__ import annotations

import os

import torch
from dist_utils import run_workers
from safetensors.torch import load_file

FSDP_MODEL_NAME = "pytorch_model_fsdp"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))


def _save_and_load(rank: int, world_size: int, root: str, which: str) -> None:
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import slipstream.dcp

    dist_cp = slipstream.dcp if which == "slipstream" else torch_dcp
    mesh = init_device_mesh("cpu", (world_size,))
    model = fully_shard(_model(0), mesh=mesh)
    state_dict = get_model_state_dict(model)
    ckpt_dir = os.path.join(root, which, f"{FSDP_MODEL_NAME}_0")
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_cp.save(
        state_dict={"model": state_dict},
        storage_writer=dist_cp.FileSystemWriter(ckpt_dir),
        planner=DefaultSavePlanner(),
    )
    other = fully_shard(_model(1), mesh=mesh)
    state_dict = {"model": get_model_state_dict(other)}
    dist_cp.load(
        state_dict=state_dict,
        storage_reader=dist_cp.FileSystemReader(ckpt_dir),
        planner=DefaultLoadPlanner(),
    )
    set_model_state_dict(other, state_dict["model"])
    for (name, got), want in zip(
        other.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(got.full_tensor(), want.full_tensor()), name


def test_sharded_save_load_and_merge_match_dcp(tmp_path):
    from accelerate.utils import merge_fsdp_weights

    for which in ("torch", "slipstream"):
        run_workers(_save_and_load, 2, str(tmp_path), which, timeout=120)
    slipstream_dir = tmp_path / "slipstream" / f"{FSDP_MODEL_NAME}_0"
    assert (slipstream_dir / ".slipstream.json").exists(), "slipstream wrote the checkpoint"
    merged = {}
    for which in ("torch", "slipstream"):
        merge_fsdp_weights(
            str(tmp_path / which / f"{FSDP_MODEL_NAME}_0"), str(tmp_path / f"merged_{which}")
        )
        merged[which] = load_file(tmp_path / f"merged_{which}" / "model.safetensors")
    want = _model(0).state_dict()
    assert merged["slipstream"].keys() == merged["torch"].keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(merged["slipstream"][name], merged["torch"][name]), name
        assert torch.equal(merged["slipstream"][name], value), name
