"""The demo: train, checkpoint, kill, resume, sync to a rollout (``python -m slipstream.demo``)."""
