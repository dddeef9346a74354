"""The demo: train, checkpoint, kill, resume, sync weights to a rollout (python -m slipstream.demo)."""
