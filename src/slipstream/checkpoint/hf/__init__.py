"""Hugging Face checkpoints in and out: safetensors directories loaded as checkpoints, and a
checkpoint's model exported as a `save_pretrained` directory."""
