"""Export of a training checkpoint as a Hugging Face model directory.

The reference is transformers itself: what ``save_pretrained`` writes for the same model
(names, tied weights, shard layout, index) and what ``from_pretrained`` loads back (no
missing or unexpected keys, the same logits as the model that was checkpointed).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from hf_models import config, logits, trained
from safetensors import safe_open

import slipstream as ss
from slipstream.cli import main

MODELS = ["gpt2", "llama", "llama-tied", "qwen2", "qwen2-tied"]


def _file_keys(directory) -> dict[str, torch.dtype]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    return out


def _training_checkpoint(tmp_path, name: str):
    model, optim = trained(name)
    ckpt = tmp_path / "ckpt"
    ss.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}, ckpt)
    config(name).save_pretrained(tmp_path / "cfg")
    return model, ckpt, tmp_path / "cfg" / "config.json"


@pytest.mark.parametrize("name", MODELS)
def test_export_loads_in_from_pretrained_with_every_key_and_equal_logits(tmp_path, name):
    model, ckpt, cfg = _training_checkpoint(tmp_path, name)
    out = tmp_path / "hf"
    result = ss.export_hf(ckpt, out, config=cfg)
    assert result.prefix == "model."
    assert result.files == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert torch.equal(logits(loaded), logits(model))

    model.save_pretrained(tmp_path / "reference")
    assert _file_keys(out).keys() == _file_keys(tmp_path / "reference").keys()
    tied = config(name).tie_word_embeddings
    assert ("lm_head.weight" in _file_keys(out)) is not tied
    embedding = "transformer.wte.weight" if name == "gpt2" else "model.embed_tokens.weight"
    assert result.tied == ({"lm_head.weight": embedding} if tied else {})
    assert not any(k.startswith("optim") or "exp_avg" in k for k in _file_keys(out))


def test_sharded_export_matches_the_index_and_shards_save_pretrained_writes(tmp_path):
    model, ckpt, cfg = _training_checkpoint(tmp_path, "llama")
    result = ss.export_hf(ckpt, tmp_path / "hf", config=cfg, max_shard_size="40KB")
    model.save_pretrained(tmp_path / "reference", max_shard_size="40KB")

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    reference = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
    assert index == reference
    assert (
        len(result.files) > 2
        and result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    )
    shards = sorted(f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors"))
    assert shards == sorted(result.files)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert torch.equal(logits(loaded), logits(model))


def test_reexport_as_one_file_removes_the_shards_of_the_earlier_export(tmp_path):
    _, ckpt, cfg = _training_checkpoint(tmp_path, "gpt2")
    ss.export_hf(ckpt, tmp_path / "hf", config=cfg, max_shard_size="40KB")
    ss.export_hf(ckpt, tmp_path / "hf", config=cfg)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]


def test_export_casts_floating_tensors_to_the_dtype_asked_for(tmp_path):
    model, ckpt, cfg = _training_checkpoint(tmp_path, "qwen2")
    ss.export_hf(ckpt, tmp_path / "hf", config=cfg, dtype="bf16")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        for key, value in model.state_dict().items():
            got = f.get_tensor(key)
            assert got.dtype == torch.bfloat16, key
            assert torch.equal(got, value.to(torch.bfloat16)), key


def test_wrong_config_fails_naming_the_keys_and_writes_nothing(tmp_path):
    _, ckpt, _ = _training_checkpoint(tmp_path, "gpt2")
    deeper = config("gpt2")
    deeper.n_layer = 3
    deeper.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ss.CheckpointError, match=r"missing 12: 'transformer\.h\.2\.ln_1\.weight'"):
        ss.export_hf(ckpt, tmp_path / "hf", config=tmp_path / "deeper" / "config.json")
    assert not (tmp_path / "hf").exists()

    config("llama").save_pretrained(tmp_path / "other")
    with pytest.raises(ss.CheckpointError, match=r"do not match LlamaForCausalLM.*unexpected"):
        ss.export_hf(ckpt, tmp_path / "hf", config=tmp_path / "other" / "config.json")


def test_wrong_shape_in_config_fails_naming_the_tensor(tmp_path):
    _, ckpt, _ = _training_checkpoint(tmp_path, "llama")
    wider = config("llama")
    wider.vocab_size = 100
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(ss.CheckpointError, match=r"shape mismatch.*'lm_head.weight' \(checkpoint"):
        ss.export_hf(ckpt, tmp_path / "hf", config=tmp_path / "wider" / "config.json")


def test_prefix_found_without_a_config_for_a_training_state_and_a_bare_model(tmp_path):
    model, ckpt, _ = _training_checkpoint(tmp_path, "llama")
    result = ss.export_hf(ckpt, tmp_path / "hf")
    assert result.prefix == "model." and result.architecture is None
    assert _file_keys(tmp_path / "hf").keys() == model.state_dict().keys()

    ss.save(model.state_dict(), tmp_path / "bare")
    result = ss.export_hf(tmp_path / "bare", tmp_path / "hf_bare")
    assert result.prefix == ""
    assert _file_keys(tmp_path / "hf_bare").keys() == model.state_dict().keys()


def test_explicit_prefix_and_unknown_prefix(tmp_path):
    model, ckpt, _ = _training_checkpoint(tmp_path, "llama")
    result = ss.export_hf(ckpt, tmp_path / "hf", prefix="model.model.")
    assert set(result.weight_map) == {
        k.removeprefix("model.") for k in model.state_dict() if k.startswith("model.")
    }
    with pytest.raises(
        ss.CheckpointError, match=r"no tensors .* under the prefix 'net\.'.*'optim'"
    ):
        ss.export_hf(ckpt, tmp_path / "hf2", prefix="net.")


def test_bad_sizes_and_dtypes_are_refused(tmp_path):
    _, ckpt, _ = _training_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ss.CheckpointError, match="cannot read the size '5 parsecs'"):
        ss.export_hf(ckpt, tmp_path / "hf", max_shard_size="5 parsecs")
    with pytest.raises(ss.CheckpointError, match="unknown dtype 'int3'"):
        ss.export_hf(ckpt, tmp_path / "hf", dtype="int3")


def test_cli_export_writes_shards_config_and_says_what_it_did(tmp_path, capsys):
    model, ckpt, cfg = _training_checkpoint(tmp_path, "gpt2")
    out = tmp_path / "hf"
    code = main(["export", str(ckpt), str(out), "--config", str(cfg), "--max-shard-size", "100KB"])
    text = capsys.readouterr().out
    assert code == 0
    assert "from the prefix 'model.'" in text and "shards" in text
    assert "tied weights written once: lm_head.weight" in text
    assert "names and shapes match GPT2LMHeadModel" in text
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert torch.equal(logits(loaded), logits(model))


def test_cli_export_errors_are_one_line_with_their_exit_status(tmp_path, capsys):
    _, ckpt, _ = _training_checkpoint(tmp_path, "gpt2")
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--dtype", "int3"]) == 2
    assert "slipstream export: error: unknown dtype 'int3'" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--config", "nope.json"]) == 2
    assert "the config nope.json does not exist" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    deeper = config("gpt2")
    deeper.n_layer = 3
    deeper.save_pretrained(tmp_path / "deeper")
    assert (
        main(
            [
                "export",
                str(ckpt),
                str(tmp_path / "hf"),
                "--config",
                str(tmp_path / "deeper" / "config.json"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing 12: 'transformer.h.2.ln_1.weight'" in err


def test_progress_reports_every_byte(tmp_path):
    _, ckpt, cfg = _training_checkpoint(tmp_path, "gpt2")
    seen = []
    result = ss.export_hf(
        ckpt, tmp_path / "hf", config=cfg, progress=lambda d, t: seen.append((d, t))
    )
    assert seen[-1] == (result.total_size, result.total_size)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


class TrainState:
    """Model, optimizer and step as one Stateful, through DCP's state-dict helpers."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": 3}

    def load_state_dict(self, sd: dict) -> None:
        raise NotImplementedError


def test_prefix_found_under_a_stateful_and_beside_other_training_state(tmp_path):
    model, optim = trained("gpt2")
    ss.save({"train": TrainState(model, optim)}, tmp_path / "nested")
    result = ss.export_hf(tmp_path / "nested", tmp_path / "hf")
    assert result.prefix == "train.model."
    assert set(result.weight_map) == set(model.state_dict())
    assert any(k.startswith("train.optim.state.") for k in result.skipped)

    rng = torch.get_rng_state()
    ss.save(
        {"model": model.state_dict(), "optim": optim.state_dict(), "rng": rng}, tmp_path / "rng"
    )
    result = ss.export_hf(tmp_path / "rng", tmp_path / "hf_rng")
    assert result.prefix == "model." and "rng" in result.skipped
    assert set(result.weight_map) == set(model.state_dict())


def test_export_of_a_checkpoint_written_by_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, optim = trained("qwen2")
    dcp.save(
        {"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=tmp_path / "d"
    )
    config("qwen2").save_pretrained(tmp_path / "cfg")
    ss.export_hf(tmp_path / "d", tmp_path / "hf", config=tmp_path / "cfg" / "config.json")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert torch.equal(logits(loaded), logits(model))


def _save_fsdp2(rank: int, world: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model, _ = trained("llama-tied")  # the same weights on every rank (seeded)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optim)
    ss.save({"model": model_sd, "optim": optim_sd, "step": 1}, path)


def test_export_of_a_checkpoint_saved_by_fsdp2_ranks(tmp_path):
    from dist_utils import run_workers

    run_workers(_save_fsdp2, 2, str(tmp_path / "ckpt"), timeout=120)
    config("llama-tied").save_pretrained(tmp_path / "cfg")
    result = ss.export_hf(
        tmp_path / "ckpt", tmp_path / "hf", config=tmp_path / "cfg" / "config.json"
    )
    assert result.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    reference, _ = trained("llama-tied")
    assert torch.equal(logits(loaded), logits(reference))


def test_a_config_that_builds_no_model_is_refused_by_name(tmp_path):
    _, ckpt, _ = _training_checkpoint(tmp_path, "gpt2")
    (tmp_path / "odd.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ss.CheckpointError, match=r"cannot build the model .*odd.json"):
        ss.export_hf(ckpt, tmp_path / "hf", config=tmp_path / "odd.json")
    (tmp_path / "bare.json").write_text("{}")
    with pytest.raises(ss.CheckpointError, match=r"bare.json has no model_type"):
        ss.export_hf(ckpt, tmp_path / "hf", config=tmp_path / "bare.json")
    with pytest.raises(ss.CheckpointError, match=r"cannot read the model config .*absent.json"):
        ss.export_hf(ckpt, tmp_path / "hf", config=tmp_path / "absent.json")


def test_export_from_the_snapshot_a_checkpoint_was_saved_from_never_reads_its_data(tmp_path):
    """With ``staged`` (the snapshot the checkpoint was written from), the weights come from
    memory: the export is byte for byte the one read back from the checkpoint, and it still
    succeeds once the checkpoint's data file is gone; only keys the snapshot lacks are read."""
    model, optim = trained("llama")
    snapshot = ss.stage({"model": model.state_dict(), "optim": optim.state_dict()})
    ckpt = tmp_path / "ckpt"
    ss.save(snapshot, ckpt)
    ss.export_hf(ckpt, tmp_path / "read_back", prefix="model.")
    staged = {f"model.{k}": v for k, v in snapshot["model"].items()}
    for name in os.listdir(ckpt):
        if name.endswith(".distcp"):
            os.remove(ckpt / name)
    ss.export_hf(ckpt, tmp_path / "from_memory", prefix="model.", staged=staged)
    with open(tmp_path / "read_back" / "model.safetensors", "rb") as a:
        with open(tmp_path / "from_memory" / "model.safetensors", "rb") as b:
            assert a.read() == b.read()
    del staged["model.lm_head.weight"]
    with pytest.raises(ss.CheckpointError):  # that one key is read, from a missing file
        ss.export_hf(ckpt, tmp_path / "partly", prefix="model.", staged=staged)


def test_a_staged_tensor_unlike_the_checkpoints_is_refused_by_name(tmp_path):
    model, ckpt, _ = _training_checkpoint(tmp_path, "llama")
    staged = {"model.lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(ss.CheckpointError, match="model.lm_head.weight"):
        ss.export_hf(ckpt, tmp_path / "hf", prefix="model.", staged=staged)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
