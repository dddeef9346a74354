from concurrent.futures import Future

import pytest
import torch

from slipstream.core.buffers import (
    StagingBudgetError,
    StagingPool,
    byte_view,
    reallocate_storage,
    release_storage,
)
from slipstream.core.checksum import block_checksums, checksum
from slipstream.core.flatten import flatten, unflatten
from slipstream.core.handles import fail_unfinished


def test_staging_pool_reuses_buffers_by_key():
    pool = StagingPool()
    a = pool.acquire("layout", 1024)
    pool.release("layout")
    b = pool.acquire("layout", 1024)
    assert a.data_ptr() == b.data_ptr()
    assert pool.allocations == 1


def test_staging_pool_refuses_double_acquire_and_budget():
    pool = StagingPool(budget_bytes=1000)
    pool.acquire("a", 600)
    with pytest.raises(Exception, match="already in use"):
        pool.acquire("a", 600)
    with pytest.raises(StagingBudgetError, match="budget of 1000"):
        pool.acquire("b", 600)


def test_byte_view_aliases_tensor_memory():
    t = torch.zeros(4, dtype=torch.float32)
    view = byte_view(t)
    view[0:4] = bytes(torch.tensor([1.5]).view(torch.uint8).tolist())
    assert t[0].item() == 1.5


def test_release_and_reallocate_keep_views_valid():
    t = torch.arange(8, dtype=torch.float32)
    view = t[2:4]
    release_storage(t)
    assert t.untyped_storage().size() == 0
    reallocate_storage(t, 32)
    t.copy_(torch.arange(8, dtype=torch.float32) * 2)
    assert view.tolist() == [4.0, 6.0]


def test_block_checksums_change_with_one_byte():
    data = bytearray(3 * 1024)
    before = block_checksums(memoryview(data), block_bytes=1024)
    data[2000] = 7
    after = block_checksums(memoryview(data), block_bytes=1024)
    assert len(before) == 3
    assert before[0] == after[0] and before[2] == after[2] and before[1] != after[1]


@pytest.mark.parametrize("nbytes", [0, 1, 240, 1024 * 1024 + 3])
def test_checksum_is_xxh3_64(nbytes):
    import xxhash

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    got = checksum(byte_view(data))
    # both of xxhash's entry points, whichever one checksum() uses for this size
    assert got == xxhash.xxh3_64_intdigest(raw)
    assert got == xxhash.xxh3_64(raw).intdigest()


def test_flatten_matches_dcp_rules():
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    sd = {
        "model": {"w": torch.ones(2), "b": torch.zeros(1)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "lst": [torch.ones(1), torch.zeros(1)],
        "tup": (1, 2),
        "step": 5,
    }
    flat, paths = flatten(sd)
    ref_flat, ref_paths = flatten_state_dict(sd)
    assert list(flat) == list(ref_flat)
    assert paths == ref_paths
    back = unflatten(flat, paths)
    assert back["optim"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(back["lst"][1], torch.zeros(1))


def test_a_failure_fails_both_phases_but_keeps_a_finished_one():
    staged, done = Future(), Future()
    fail_unfinished(ValueError("boom"), staged, done)
    with pytest.raises(ValueError):
        staged.result(0)
    with pytest.raises(ValueError):
        done.result(0)
    staged, done = Future(), Future()
    staged.set_result(None)
    fail_unfinished(ValueError("boom"), staged, done)
    assert staged.result(0) is None
    with pytest.raises(ValueError):
        done.result(0)


def test_watermark_wakes_waiter_at_its_mark_and_on_failure():
    import threading

    from slipstream.core.handles import Watermark
    from slipstream.errors import PeerTimeoutError

    mark = Watermark()
    mark.advance(50)
    with pytest.raises(PeerTimeoutError, match="the head"):
        mark.wait_for(100, 0.05, "the head")
    outcome: list[object] = []

    def wait(level: int) -> None:
        try:
            mark.wait_for(level, 10.0, f"level {level}")
            outcome.append(level)
        except RuntimeError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, args=(100,))
    waiter.start()
    mark.advance(99)
    mark.advance(100)  # exactly the mark
    waiter.join(10.0)
    assert outcome == [100]
    failing = threading.Thread(target=wait, args=(1000,))
    failing.start()
    mark.advance(500)
    boom = RuntimeError("staging failed")
    mark.fail(boom)
    failing.join(10.0)
    assert outcome == [100, boom]


def test_copy_to_address_copies_plain_tensors_only():
    from slipstream.core.copy import copy_to_address

    dest = torch.zeros(64, dtype=torch.uint8)
    src = torch.arange(6, dtype=torch.float32)
    assert copy_to_address(dest.data_ptr() + 8, src)
    assert torch.equal(dest[8:32].view(torch.float32), src)
    assert dest[:8].eq(0).all() and dest[32:].eq(0).all()
    strided = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    assert not copy_to_address(dest.data_ptr(), strided)
    lazy = torch.ones(2, dtype=torch.complex64).conj()
    assert not copy_to_address(dest.data_ptr(), lazy)
    assert dest[:8].eq(0).all()
