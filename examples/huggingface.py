"""From a training checkpoint to a Hugging Face model directory, and back.

A small Llama (built from a config, nothing is downloaded) trains a few steps and is
checkpointed with its optimizer; ``ss.export_hf`` writes its weights as ``from_pretrained``
reads them; ``ss.load`` reads that directory into a fresh model, as a fine-tuning job
starting from a pretrained model would.

    python examples/huggingface.py --out /tmp/slipstream-hf-example
"""

import argparse
from pathlib import Path

import torch
import transformers

import slipstream as ss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/slipstream-hf-example")
    args = parser.parse_args()
    out = Path(args.out)
    transformers.logging.set_verbosity_error()

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=True,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out / "config")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 128, (4, 16))
    for _ in range(3):
        model(tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad()
    ss.save({"model": model.state_dict(), "optim": optim.state_dict()}, out / "step_3")

    # Export: the model's weights only, checked against the config, in bf16.
    result = ss.export_hf(
        out / "step_3", out / "hf", config=out / "config" / "config.json", dtype="bf16"
    )
    print(f"exported {len(result.weight_map)} tensors under prefix {result.prefix!r}")
    print(f"tied weights written once: {sorted(result.tied)}")

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out / "hf", output_loading_info=True
    )
    print(
        f"from_pretrained: missing {sorted(info['missing_keys'])}, "
        f"unexpected {sorted(info['unexpected_keys'])}"
    )

    # Import: read the directory into a fresh fp32 model (the bf16 weights are cast).
    fresh = transformers.LlamaForCausalLM(config)
    ss.load({"model": fresh}, out / "hf")
    model.eval()
    fresh.eval()
    with torch.no_grad():
        gap = (fresh(tokens).logits - model(tokens).logits).abs().max().item()
    print(f"largest logit difference after the bf16 round trip: {gap:.3f}")


if __name__ == "__main__":
    main()
