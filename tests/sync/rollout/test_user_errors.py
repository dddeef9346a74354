"""A rollout's own ``load_weights`` error reaches the caller with its traceback: the frame of
the callable that raised is still in the error's chain (a broken round's transport is shut
down by closing its connections, not by dropping the frames that reference it). And the
trainer reports the rollout's refusal, not its death, though the rollout exits at once after
refusing (over the network, and over shared memory, where the trainer's wait looks at the
rollout's process)."""

from __future__ import annotations

import traceback

import torch
from sync_procs import spawn

import slipstream as ss

BUCKET = 64 * 1024


def weights() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((20_000,), float(i)) for i in range(8)}


def _frames(exc: BaseException | None) -> list[str]:
    """The function names of every traceback frame down ``exc``'s cause/context chain."""
    names, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names += [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
        exc = exc.__cause__ or exc.__context__
    return names


def _user_error(rank, port, transport):
    group = ss.sync.init_group("127.0.0.1", port, 2, rank, timeout=30)
    if rank == 0:
        pub = ss.WeightPublisher(group, [0], [1], bucket_bytes=BUCKET, transport=transport)
        try:
            pub.publish(weights()).delivered.result(timeout=30)
        except ss.SyncError as exc:
            out = str(exc)
        else:
            out = "delivered"
        pub.close()
        group.close()
        return out
    sub = ss.WeightSubscriber(group, [0], [1])

    def user_load_weights(batch):
        raise ValueError("the user's own refusal")

    try:
        sub.receive(user_load_weights)
    except Exception as exc:  # whatever the receive raises, the user's frame must be in it
        out = {"frames": _frames(exc), "text": f"{exc!r} {exc.__cause__!r}"}
    else:
        out = {"frames": [], "text": "received"}
    sub.close()
    group.close()
    return out


def test_a_load_weights_error_keeps_the_users_frame_in_its_traceback():
    for transport in ("relay", "broadcast", "shm"):
        out = spawn(_user_error, 2, transport, timeout=90)
        assert "user_load_weights" in out[1]["frames"], (transport, out[1])
        assert "the user's own refusal" in out[0], (transport, out[0])
