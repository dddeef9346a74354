"""The delta codec on its own: diff a bucket's new bytes against a base, apply on a copy.

Every test checks the copy ends bit-identical to the trainer's tensors (the reference: a
dense copy of the same bytes), and that the base ends equal to the new bytes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from slipstream.core.buffers import as_bytes
from slipstream.sync.layout.delta import (
    WORD,
    BaseMismatch,
    BucketDelta,
    DeltaHeader,
    DeltaStats,
    Differ,
    apply_delta,
    chained_token,
    decode_delta,
    encode_delta,
    payload_bytes,
    root_token,
    words_of,
)
from slipstream.sync.layout.plan import BucketPlan, TensorSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from realistic_updates import AdamW, RealisticUpdates  # noqa: E402


class Pair:
    """Trainer tensors, the trainer's base (one buffer, bucket by bucket) and a rollout copy."""

    def __init__(self, tensors: list[torch.Tensor], bucket_bytes: int, chunk_words: int = 64):
        self.tensors = tensors
        specs = [
            TensorSpec(f"t{i}", tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for i, t in enumerate(tensors)
        ]
        self.plan = BucketPlan.build(specs, bucket_bytes, [0])
        self.rollout = [t.clone() for t in tensors]
        self.base = torch.zeros(len(self.plan.buckets) * bucket_bytes + WORD, dtype=torch.uint8)
        self.differ = Differ(chunk_words)
        self.publish()  # the first version: dense into the base and the rollout
        self.copy_dense()

    def bucket_base(self, g: int) -> torch.Tensor:
        start = g * self.plan.bucket_bytes
        return self.base[start : start + words_of(self.plan.buckets[g].nbytes) * WORD]

    def read(self, s):
        return as_bytes(self.tensors[s.tensor])[s.tensor_offset : s.tensor_offset + s.nbytes]

    def dest(self, s):
        return [as_bytes(self.rollout[s.tensor])[s.tensor_offset : s.tensor_offset + s.nbytes]]

    def publish(self) -> tuple[list, DeltaStats]:
        """Diff every bucket and apply the deltas to the rollout; dense buckets are copied
        from the base. Returns each bucket's delta (or None) and the summed stats."""
        total = DeltaStats()
        deltas = []
        for b in self.plan.buckets:
            slices = self.plan.bucket_slices(b.index)
            delta, stats = self.differ.diff_bucket(slices, self.read, self.bucket_base(b.index))
            total.add(stats)
            deltas.append(delta)
            if delta is None:
                self.copy_bucket(b.index)
                continue
            payload = delta.write(torch.empty(delta.nbytes + 64, dtype=torch.uint8))
            assert payload.numel() == payload_bytes(delta.count)
            apply_delta(payload, delta.count, slices, self.dest)
        return deltas, total

    def copy_bucket(self, g: int) -> None:
        base = self.bucket_base(g)
        for s in self.plan.bucket_slices(g):
            self.dest(s)[0].copy_(base[s.bucket_offset : s.bucket_offset + s.nbytes])

    def copy_dense(self) -> None:
        for b in self.plan.buckets:
            self.copy_bucket(b.index)

    def assert_exact(self) -> None:
        for i, (a, b) in enumerate(zip(self.tensors, self.rollout, strict=True)):
            assert torch.equal(as_bytes(a), as_bytes(b)), f"tensor {i} differs"
        for b in self.plan.buckets:
            base = self.bucket_base(b.index)
            for s in self.plan.bucket_slices(b.index):
                want = self.read(s)
                assert torch.equal(base[s.bucket_offset : s.bucket_offset + s.nbytes], want)


def mixed_tensors(gen: torch.Generator) -> list[torch.Tensor]:
    """bf16, fp16 and fp32 tensors, some of a byte size that is not a multiple of 8 and one
    larger than the 4 KiB buckets the tests use."""
    return [
        torch.randn(3000, generator=gen).to(torch.bfloat16),  # 6000 B: > one bucket
        torch.randn(7, generator=gen).to(torch.float16),  # 14 B: a partial last word
        torch.randn(33, 5, generator=gen),  # fp32
        torch.randn(301, generator=gen).to(torch.bfloat16),  # 602 B
        torch.randint(-100, 100, (5,), generator=gen, dtype=torch.int16),
    ]


def perturb(tensors: list[torch.Tensor], fraction: float, gen: torch.Generator) -> None:
    """Change about ``fraction`` of the elements of every tensor (by one unit in the last
    place, as a small update of a float does)."""
    for t in tensors:
        flat = t.view(-1)
        ints = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])
        hit = torch.rand(flat.numel(), generator=gen) < fraction
        ints[hit] += 1


def test_random_sparse_updates_over_many_versions_stay_exact():
    gen = torch.Generator().manual_seed(1)
    pair = Pair(mixed_tensors(gen), bucket_bytes=4096)
    assert any(s.tensor == 0 and s.nbytes < 6000 for s in pair.plan.slices)  # cut in two
    for _ in range(12):
        perturb(pair.tensors, 0.01, gen)
        deltas, stats = pair.publish()
        pair.assert_exact()
        assert stats.delta_buckets == len(deltas) and stats.dense_buckets == 0
        assert 0 < stats.changed_fraction < 0.2
        assert stats.sent_bytes < stats.dense_bytes / 2
        assert stats.sent_bytes == sum(payload_bytes(d.count) for d in deltas)


def test_every_element_of_a_partial_last_word_is_applied():
    gen = torch.Generator().manual_seed(2)
    pair = Pair(mixed_tensors(gen), bucket_bytes=4096)
    pair.tensors[1][-1] += 1  # the last of 14 bytes: in the partial word only
    deltas, stats = pair.publish()
    assert stats.changed_words == 1
    pair.assert_exact()


def test_nothing_changed_sends_an_empty_delta():
    gen = torch.Generator().manual_seed(3)
    pair = Pair(mixed_tensors(gen), bucket_bytes=4096)
    deltas, stats = pair.publish()
    assert all(d is not None and d.count == 0 for d in deltas)
    assert stats.sent_bytes == 0 and stats.changed_words == 0
    assert stats.compared_words == sum(words_of(s.nbytes) for s in pair.plan.slices)
    pair.assert_exact()


def test_all_changed_goes_dense_and_the_base_still_ends_new():
    gen = torch.Generator().manual_seed(4)
    pair = Pair(mixed_tensors(gen), bucket_bytes=4096)
    perturb(pair.tensors, 1.0, gen)
    deltas, stats = pair.publish()
    assert all(d is None for d in deltas)
    assert stats.dense_buckets == len(deltas)
    assert stats.sent_bytes == stats.dense_bytes
    pair.assert_exact()
    perturb(pair.tensors, 0.01, gen)  # and deltas resume from that base
    deltas, _ = pair.publish()
    assert all(d is not None for d in deltas)
    pair.assert_exact()


def test_a_delta_that_would_outgrow_the_dense_bytes_stops_early():
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(64 * 1024, generator=gen).to(torch.bfloat16)  # 2048 chunks of 64 words
    pair = Pair([big], bucket_bytes=256 * 1024)
    perturb(pair.tensors, 1.0, gen)
    _, stats = pair.publish()
    assert stats.dense_buckets == 1
    # every word of the first chunk changed: its delta outgrew its bytes, the rest is copied
    assert stats.compared_words == 64 and stats.changed_words == 64


def test_a_few_changed_words_at_the_head_of_a_bucket_decide_nothing():
    gen = torch.Generator().manual_seed(8)
    tensors = [torch.randn(3, generator=gen), torch.randn(64 * 1024, generator=gen)]
    pair = Pair(tensors, bucket_bytes=512 * 1024)
    tensors[0].add_(1)  # every word of the small tensor, nothing of the big one
    deltas, stats = pair.publish()
    assert deltas[0] is not None and deltas[0].count == 2
    pair.assert_exact()
    pair.assert_exact()


def test_an_unaligned_source_tensor_is_diffed_exactly():
    gen = torch.Generator().manual_seed(6)
    storage = torch.randn(1001, generator=gen).to(torch.bfloat16)
    odd = storage[1:]  # starts 2 bytes into the storage: not 8-byte aligned
    assert odd.data_ptr() % WORD
    pair = Pair([odd], bucket_bytes=1024)
    for _ in range(3):
        perturb([storage], 0.05, gen)
        pair.publish()
        pair.assert_exact()


def test_an_unaligned_destination_is_written_exactly():
    gen = torch.Generator().manual_seed(7)
    pair = Pair([torch.randn(1000, generator=gen).to(torch.bfloat16)], bucket_bytes=1024)
    storage = torch.zeros(1001, dtype=torch.bfloat16)
    storage[1:] = pair.rollout[0]
    pair.rollout[0] = storage[1:]
    assert pair.rollout[0].data_ptr() % WORD
    perturb(pair.tensors, 0.05, gen)
    pair.publish()
    pair.assert_exact()


def test_realistic_adamw_updates_are_exact_and_small():
    updates = RealisticUpdates([(256, 256), (512, 128), (256,)], seed=3)
    pair = Pair(updates.weights, bucket_bytes=64 * 1024, chunk_words=4096)
    for _ in range(4):
        element_fraction = updates.step(AdamW(lr=1e-6))
        _, stats = pair.publish()
        pair.assert_exact()
        assert 0 < element_fraction < stats.changed_fraction < 0.5
        assert stats.sent_bytes < 0.5 * stats.dense_bytes


def test_header_round_trips_and_refuses_another_base():
    base = root_token("plan", 3, 7)
    assert base != root_token("plan", 3, 8) and base != root_token("plan", 4, 7)
    delta = BucketDelta([torch.tensor([1, 5])], [torch.tensor([-1, 2**40])], count=2)
    message, header = encode_delta(torch.empty(100, dtype=torch.uint8), delta, 7, base)
    decoded, payload = decode_delta(message)
    assert decoded == header == DeltaHeader(2, 7, base, chained_token(base, payload))
    assert payload.numel() == payload_bytes(2)
    assert payload[:8].view(torch.int32).tolist() == [1, 5]
    assert payload[8:].view(torch.int64).tolist() == [-1, 2**40]
    header.check_base(base, "rollout rank 1, bucket 0")
    with pytest.raises(BaseMismatch, match="rollout rank 1, bucket 0.*version 7"):
        header.check_base(base ^ 1, "rollout rank 1, bucket 0")
    with pytest.raises(BaseMismatch, match="nothing recorded"):
        header.check_base(None, "rollout rank 1, bucket 0")
    assert chained_token(base, payload) != chained_token(base ^ 1, payload)
    assert chained_token(base, payload) != chained_token(base, payload[1:])


def test_a_payload_of_the_wrong_size_is_refused():
    plan = BucketPlan.build([TensorSpec("w", (16,), "float32")], 1024, [0])
    with pytest.raises(Exception, match="2 words has 20 bytes, expected 24"):
        apply_delta(torch.zeros(20, dtype=torch.uint8), 2, plan.bucket_slices(0), lambda s: [])
