"""The machinery shared by checkpointing, weight sync and FSDP.

- :mod:`.streams`: device-agnostic streams and events (no-ops on CPU).
- :mod:`.buffers`: flat, reusable, pre-touched (pinned on CUDA) staging buffers.
- :mod:`.handles`: two-phase futures (staged -> done) and a watermark, on ``concurrent.futures``.
- :mod:`.flatten`: flattening of nested state dicts, with DCP's rules.
- :mod:`.checksum`: fast block checksums.
- :mod:`.waits`: waiting with a timeout and an error that names who did not answer.
"""
