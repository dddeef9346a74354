"""Loading Hugging Face safetensors directories (written by transformers' save_pretrained)
with ``ss.load``: into plain tensors and into DTensor shards on 1, 2 and 4 ranks.

The reference is the model that was saved (its state dict and logits) and, for shards,
``torch.chunk`` of the full tensor; a storage that counts bytes shows each rank reads only
its own shards' bytes.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch
import transformers
from dist_utils import run_workers
from hf_models import config, logits, trained
from safetensors.torch import load_file

import slipstream as ss
from slipstream.checkpoint.storage.local import LocalStorage

MODELS = ["gpt2", "llama", "llama-tied", "qwen2", "qwen2-tied"]


def _fresh(name: str, vocab_size: int | None = None) -> torch.nn.Module:
    cfg = config(name)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    torch.manual_seed(123)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _zeros(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Zero tensors shaped as ``model``'s state dict; tied weights stay one tensor."""
    made: dict[int, torch.Tensor] = {}
    out = {}
    for key, value in model.state_dict().items():
        ptr = value.data_ptr()
        if ptr not in made:
            made[ptr] = torch.zeros_like(value, dtype=dtype)
        out[key] = made[ptr]
    return out


def _assert_same_state(got: torch.nn.Module, want: torch.nn.Module) -> None:
    want_sd = want.state_dict()
    for key, value in got.state_dict().items():
        assert torch.equal(value, want_sd[key]), key


@pytest.mark.parametrize("name", MODELS)
def test_load_into_a_model_equals_the_saved_one(tmp_path, name):
    model, _ = trained(name)
    model.save_pretrained(tmp_path / "hf")
    fresh = _fresh(name)
    ss.load({"model": fresh}, tmp_path / "hf")
    _assert_same_state(fresh, model)
    assert torch.equal(logits(fresh), logits(model))
    if config(name).tie_word_embeddings:
        assert fresh.lm_head.weight is fresh.get_input_embeddings().weight


def test_sharded_directory_with_and_without_its_index(tmp_path):
    model, _ = trained("llama")
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    fresh = _fresh("llama")
    sd = fresh.state_dict()
    ss.load(sd, tmp_path / "hf")
    _assert_same_state(fresh, model)

    os.remove(tmp_path / "hf" / "model.safetensors.index.json")
    again = _fresh("llama")
    ss.load(again.state_dict(), tmp_path / "hf")
    _assert_same_state(again, model)


def test_prefix_given_and_found(tmp_path):
    model, _ = trained("gpt2")
    model.save_pretrained(tmp_path / "hf")
    wrapped = {"net": _zeros(model)}
    ss.load_hf(wrapped, tmp_path / "hf", prefix="net.")
    for key, value in model.state_dict().items():
        assert torch.equal(wrapped["net"][key], value), key
    found = {"net": _zeros(model)}
    ss.load(found, tmp_path / "hf")
    assert torch.equal(found["net"]["lm_head.weight"], model.lm_head.weight)


def test_a_different_dtype_is_cast_with_a_warning_naming_it(tmp_path):
    model, _ = trained("qwen2")
    model.save_pretrained(tmp_path / "hf")
    sd = _zeros(model, torch.bfloat16)
    with pytest.warns(UserWarning, match=r"casting .* from torch.float32 to torch.bfloat16"):
        ss.load(sd, tmp_path / "hf")
    for key, value in model.state_dict().items():
        assert torch.equal(sd[key], value.to(torch.bfloat16)), key


def test_key_shape_and_value_errors_name_what_is_wrong(tmp_path):
    model, _ = trained("llama")
    model.save_pretrained(tmp_path / "hf")
    hf = tmp_path / "hf"

    def state():
        return {k: torch.zeros_like(v) for k, v in model.state_dict().items()}

    extra = state() | {"model.extra.weight": torch.zeros(2)}
    with pytest.raises(
        ss.CheckpointError, match=r"missing from the safetensors files: 'model.extra"
    ):
        ss.load(extra, hf)
    fewer = state()
    del fewer["lm_head.weight"]
    with pytest.raises(ss.CheckpointError, match=r"unexpected tensors .* 'lm_head.weight'"):
        ss.load(fewer, hf)
    ss.load(fewer, hf, strict=False)
    assert torch.equal(fewer["model.norm.weight"], model.model.norm.weight)
    wrong = state() | {"model.norm.weight": torch.zeros(65)}
    with pytest.raises(
        ss.CheckpointError, match=r"shape mismatch for 'model.norm.weight'.*\[64\].*\[65\]"
    ):
        ss.load(wrong, hf)
    plain = state() | {"step": 3}
    with pytest.raises(ss.CheckpointError, match=r"holds only tensors.*'step'"):
        ss.load(plain, hf)
    untouched = state()
    with pytest.raises(ss.CheckpointError):
        ss.load(untouched | {"model.norm.weight": torch.zeros(65)}, hf)
    assert all(not v.any() for v in untouched.values()), "a failed check wrote into the state"


def test_broken_files_are_reported_by_name(tmp_path):
    model, _ = trained("gpt2")
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    sd = _zeros(model)
    hf = tmp_path / "hf"
    last = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))[-1]
    data = (hf / last).read_bytes()
    (hf / last).write_bytes(data[:-10])
    with pytest.raises(ss.CorruptCheckpointError, match=rf"{last} is truncated"):
        ss.load(sd, hf)
    (hf / last).write_bytes(struct.pack("<Q", 12) + b"not json!!!!")
    with pytest.raises(ss.CorruptCheckpointError, match=rf"{last}: the safetensors header is not"):
        ss.load(sd, hf)
    os.remove(hf / last)
    with pytest.raises(ss.CorruptCheckpointError, match=rf"names {last}, which does not exist"):
        ss.load(sd, hf)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ss.CheckpointError, match="holds no Hugging Face safetensors"):
        ss.load_hf(sd, tmp_path / "empty")


class CountingStorage(LocalStorage):
    """A local directory that records every read: (file, offset, bytes)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.reads: list[tuple[str, int, int]] = []

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.reads.append((name, offset, len(out)))
        super().read_into(name, offset, out)


def _data_bytes_read(storage: CountingStorage, directory) -> int:
    """Bytes read past each file's header (the tensors' bytes)."""
    total = 0
    for name, offset, n in storage.reads:
        with open(os.path.join(directory, name), "rb") as f:
            start = 8 + struct.unpack("<Q", f.read(8))[0]
        total += max(0, offset + n - max(offset, start))
    return total


def test_only_the_tensors_asked_for_are_read(tmp_path):
    model, _ = trained("llama")
    model.save_pretrained(tmp_path / "hf")
    storage = CountingStorage(tmp_path / "hf")
    one = {"lm_head.weight": torch.zeros_like(model.lm_head.weight)}
    ss.load(one, storage, strict=False)
    assert torch.equal(one["lm_head.weight"], model.lm_head.weight)
    assert _data_bytes_read(storage, tmp_path / "hf") == model.lm_head.weight.nbytes


def _placement(index: int, dims: int):
    from torch.distributed.tensor import Replicate, Shard

    if dims == 2:
        return Shard(index % 2)
    return Replicate() if index % 3 == 0 else Shard(0)


def _bytes_spanned(full: torch.Tensor, local: torch.Tensor, placement, world: int, rank: int):
    """Bytes of the file a rank reads for its shard: the shard itself for ``Shard(0)`` and
    ``Replicate``; for ``Shard(1)`` of a matrix, the one span from its first element to
    its last (a read per row would cost more than the bytes between)."""
    if local.numel() == 0:
        return 0
    if getattr(placement, "dim", 0) == 1:
        rows, cols = full.shape
        return ((rows - 1) * cols + local.shape[1]) * full.dtype.itemsize
    return local.numel() * full.dtype.itemsize


def _load_shards(rank: int, world: int, hf_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, zeros

    mesh = init_device_mesh("cpu", (world,))
    full = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            full.update(load_file(os.path.join(hf_dir, name)))
    sd = {}
    for i, (key, value) in enumerate(sorted(full.items())):
        dtype = torch.bfloat16 if "norm" in key else value.dtype
        sd[key] = zeros(
            value.shape, dtype=dtype, device_mesh=mesh, placements=[_placement(i, value.dim())]
        )
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied, as in the model
    storage = CountingStorage(hf_dir)
    ss.load({"model": sd}, storage)
    expected_bytes = 0
    for i, (key, value) in enumerate(sorted(full.items())):
        placement = _placement(i, value.dim())
        want = value.to(sd[key].dtype)
        if isinstance(placement, Shard):
            pieces = torch.chunk(want, world, dim=placement.dim)
            want = pieces[rank] if rank < len(pieces) else want.narrow(placement.dim, 0, 0)
        local = sd[key].to_local()
        assert torch.equal(local, want), f"rank {rank}: {key}"
        expected_bytes += _bytes_spanned(value, want, placement, world, rank)
    assert torch.equal(sd["lm_head.weight"].full_tensor(), full["model.embed_tokens.weight"])
    assert _data_bytes_read(storage, hf_dir) == expected_bytes, f"rank {rank} read other bytes"


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory):
    """A tied Qwen2 (biases, a vocabulary of 99 rows that splits unevenly) in shards."""
    torch.manual_seed(5)
    model = _fresh("qwen2-tied", vocab_size=99)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    path = tmp_path_factory.mktemp("hf") / "qwen2"
    model.save_pretrained(path, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dtensor_shards_on_each_rank_equal_the_saved_tensors(sharded_hf, world):
    run_workers(_load_shards, world, sharded_hf, timeout=120)


def test_load_from_s3(tmp_path, s3_bucket, s3_server):
    import boto3

    model, _ = trained("gpt2")
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    client = boto3.client("s3", endpoint_url=s3_server)
    for name in os.listdir(tmp_path / "hf"):
        client.upload_file(str(tmp_path / "hf" / name), s3_bucket, f"gpt2/{name}")
    fresh = _fresh("gpt2")
    ss.load({"model": fresh}, f"s3://{s3_bucket}/gpt2")
    _assert_same_state(fresh, model)


def _load_fsdp2(rank: int, world: int, hf_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    model = _fresh("llama-tied")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ss.load({"model": model}, hf_dir)
    saved = load_file(os.path.join(hf_dir, "model.safetensors"))
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(param.full_tensor(), saved[key]), f"rank {rank}: {name}"
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_fsdp2_model_loads_its_shards(tmp_path):
    model, _ = trained("llama-tied")
    model.save_pretrained(tmp_path / "hf")
    run_workers(_load_fsdp2, 2, str(tmp_path / "hf"), timeout=120)
