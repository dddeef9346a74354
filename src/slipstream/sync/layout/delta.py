"""Sparse deltas of a bucket's wire bytes: the 8-byte words that changed since a base.

A trainer that keeps a host copy of the bytes its rollouts hold (the *base*: the cache in
``cached`` mode, a kept copy in ``direct`` mode) compares each bucket's new bytes with it,
word by word, and sends whichever is smaller: the changed words or the dense bytes.

Encoding. The unit is the 8-byte word of the bucket (the plan's byte stream, where every
tensor starts on a 64-byte boundary): comparing ``int64`` views is dtype-agnostic (bf16,
fp16, fp32 and integers alike, bit-exact, NaNs included) and touches a quarter of the
elements a bf16 comparison would. A delta's payload is the changed words' indices in the
bucket (``int32``, ascending), padded to 8 bytes, then their new values (``int64``): 12
bytes per changed word, so it is smaller while fewer than two thirds of the words changed;
it is sent only while it is at most a quarter of the dense bytes (:data:`MAX_DELTA_FRACTION`),
since finding changed words costs more than sending them.
Measured on this project's 2-core host with torch's CPU kernels: ``ne`` on ``int64`` views
into a reused mask then ``nonzero`` was the cheapest way to find the changed words
(``masked_select`` cost as much, ``repeat_interleave`` and scatter-based compaction more,
``nonzero`` on 2-byte units twice as much); refining words into changed bf16 elements halves
the payload of realistic updates but costs more diff time than the bytes it saves on the
wire (docs/sync-advanced.md, "Sending only what changed").

Diffing runs over chunks of ``CHUNK_WORDS`` words so the mask stays in cache, and stops
early: once a bucket's delta would outgrow its dense bytes, the rest is copied and the
bucket goes dense. Either way the base ends equal to the new bytes.

Identity of a base. Each bucket's bytes, on the trainer and on every rollout, carry a
64-bit *token*: after a dense send of version ``v``, the xxh3 of the plan, the bucket and
``v`` (both sides derive it); after a delta, the xxh3 of the base's token and the delta's
payload (a checksum chained over every delta since the last dense send). A delta names the
version and token of the base it was computed from and the token it leads to; a rollout
applies it only if the token it recorded for that bucket is the named base
(:class:`BaseMismatch` otherwise), so a delta never lands on bytes it was not computed
from. The trainers send deltas only to rounds whose every member says it holds the base
version with its tokens recorded: a rollout that restarted, missed a version or refetched
gets dense bytes.

Invariant: applying a bucket's delta onto its base gives exactly the bytes a dense send of
the same version gives.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
import xxhash

from ...core.buffers import byte_view
from ...core.checksum import checksum
from ...core.copy import copy_in_slices
from ...errors import SyncError
from .plan import Slice

WORD = 8
#: Words compared per step: the mask (one byte per word) stays in the core's cache.
CHUNK_WORDS = 1 << 20
#: Bytes per changed word in a delta's payload: an ``int32`` index and an ``int64`` value.
BYTES_PER_WORD = 12
#: A bucket goes as a delta only while its delta is at most this fraction of its dense
#: bytes (a sixth of the words changed). Finding a changed word costs far more than
#: sending it (torch's ``nonzero`` dominates a diff), so a delta that saves less than this
#: costs more time than it saves on the wire.
MAX_DELTA_FRACTION = 0.25


def words_of(nbytes: int) -> int:
    """Words covering ``nbytes`` bytes (the last one may be partial)."""
    return (nbytes + WORD - 1) // WORD


def payload_bytes(count: int) -> int:
    """Size of a delta payload carrying ``count`` changed words."""
    return _values_offset(count) + WORD * count


def _values_offset(count: int) -> int:
    return (4 * count + WORD - 1) // WORD * WORD


#: The header code (one byte per slice, :func:`.plan.encode_header`) of a bucket whose
#: payload is a delta: :class:`DeltaHeader`, then the changed words.
DELTA = 2


def root_token(plan_id: str, bucket: int, version: int) -> int:
    """The token of bucket ``bucket`` of plan ``plan_id`` after a dense send of ``version``."""
    return checksum(f"{plan_id}/{bucket}/{version}".encode())


def chained_token(base_token: int, payload: torch.Tensor) -> int:
    """The token a delta with ``payload`` leads to from a base with ``base_token``."""
    return int(xxhash.xxh3_64(byte_view(payload), seed=base_token).intdigest())


class BaseMismatch(SyncError):
    """A delta was offered for a base other than the one held: it is refused, never applied."""


@dataclass(frozen=True)
class DeltaHeader:
    """What travels ahead of a bucket's delta: how many words changed, the version and
    token of the base it was computed from, and the token applying it leads to."""

    count: int
    base_version: int
    base_token: int
    token: int

    FORMAT: ClassVar[str] = "<qqQQ"
    NBYTES: ClassVar[int] = struct.calcsize("<qqQQ")

    def pack(self) -> bytes:
        return struct.pack(self.FORMAT, self.count, self.base_version, self.base_token, self.token)

    @classmethod
    def unpack(cls, raw: bytes) -> DeltaHeader:
        return cls(*struct.unpack(cls.FORMAT, raw[: cls.NBYTES]))

    def check_base(self, held_token: int | None, where: str) -> None:
        """Refuse (raise :class:`BaseMismatch`) unless the bytes held are this delta's base."""
        if held_token != self.base_token:
            held = "nothing recorded" if held_token is None else f"token {held_token:016x}"
            raise BaseMismatch(
                f"{where}: a delta from version {self.base_version} (base token "
                f"{self.base_token:016x}) does not apply to the bytes held ({held})"
            )


@dataclass
class DeltaStats:
    """What a publish's diffs found and sent, summed over buckets."""

    dense_bytes: int = 0
    """Bytes of the buckets diffed (what a dense send of them moves)."""
    sent_bytes: int = 0
    """Bytes that went out for them: delta payloads, and dense bytes where those were smaller."""
    changed_words: int = 0
    compared_words: int = 0
    delta_buckets: int = 0
    dense_buckets: int = 0
    seconds: float = 0.0
    """Time spent diffing (comparing, gathering changed words, updating the base)."""

    @property
    def changed_fraction(self) -> float:
        """Fraction of the compared 8-byte words that changed."""
        return self.changed_words / self.compared_words if self.compared_words else 0.0

    def add(self, other: DeltaStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class BucketDelta:
    """The changed words of one bucket, gathered chunk by chunk: ``indices`` (bucket word
    indices, ``int64``, ascending across chunks) and ``values`` (``int64``)."""

    indices: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    count: int = 0

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.count)

    def write(self, out: torch.Tensor) -> torch.Tensor:
        """Write the payload into the ``uint8`` buffer ``out``; return the used prefix."""
        n = self.nbytes
        if out.numel() < n:
            raise ValueError(
                f"a delta of {self.count} words needs {n} bytes, the buffer has {out.numel()}"
            )
        payload = out[:n]
        idx = payload[: 4 * self.count].view(torch.int32)
        vals = payload[_values_offset(self.count) :].view(torch.int64)
        at = 0
        for i, v in zip(self.indices, self.values, strict=True):
            k = i.numel()
            idx[at : at + k].copy_(i)
            vals[at : at + k].copy_(v)
            at += k
        pad = payload[4 * self.count : _values_offset(self.count)]
        pad.zero_()
        return payload


def encode_delta(
    out: torch.Tensor, delta: BucketDelta, base_version: int, base_token: int
) -> tuple[torch.Tensor, DeltaHeader]:
    """Write a bucket's delta message into the ``uint8`` buffer ``out``: its
    :class:`DeltaHeader` then its payload. Returns the message and its header."""
    body = delta.write(out[DeltaHeader.NBYTES :])
    header = DeltaHeader(delta.count, base_version, base_token, chained_token(base_token, body))
    out[: DeltaHeader.NBYTES].copy_(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
    return out[: DeltaHeader.NBYTES + body.numel()], header


def decode_delta(message: torch.Tensor) -> tuple[DeltaHeader, torch.Tensor]:
    """The header and payload of a delta message written by :func:`encode_delta`."""
    if message.numel() < DeltaHeader.NBYTES:
        raise SyncError(f"a delta message of {message.numel()} bytes has no header")
    header = DeltaHeader.unpack(bytes(message[: DeltaHeader.NBYTES].cpu().tolist()))
    return header, message[DeltaHeader.NBYTES :]


def _pays(count: int, compared_words: int, limit: int, chunk_words: int) -> bool:
    """Whether a delta of ``count`` words, after ``compared_words`` compared, is still worth
    diffing on: smaller than ``limit`` and, once a chunk's worth was compared, than
    :data:`MAX_DELTA_FRACTION` of the dense bytes compared (a few small tensors alone
    decide nothing)."""
    size = payload_bytes(count)
    seen = WORD * compared_words * MAX_DELTA_FRACTION
    return size < limit and (compared_words < chunk_words or size <= seen)


def _aligned_words(data: torch.Tensor) -> torch.Tensor | None:
    """``data`` (uint8, a multiple of 8 bytes) seen as ``int64`` words, or ``None`` when its
    address is not 8-byte aligned."""
    if data.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    if data.data_ptr() % WORD:
        return None
    return data.view(torch.int64)


class Differ:
    """Diffs new bytes against a base and updates the base in place, reusing one mask.

    :meth:`diff_bucket` walks one bucket's slices; every chunk's changed words are gathered
    and copied into the base at once, so the base always ends equal to the new bytes.
    """

    def __init__(self, chunk_words: int = CHUNK_WORDS) -> None:
        self.chunk_words = chunk_words
        self._mask = torch.empty(chunk_words, dtype=torch.bool)
        self._scratch = torch.empty(chunk_words, dtype=torch.int64)

    def diff_bucket(
        self,
        slices: Sequence[Slice],
        read: Callable[[Slice], torch.Tensor],
        base: torch.Tensor,
        limit: int | None = None,
    ) -> tuple[BucketDelta | None, DeltaStats]:
        """Diff every slice of a bucket (``read(s)``: its new bytes, ``uint8``) against
        ``base`` (the bucket's base bytes, ``uint8``, 8-byte aligned, at least
        ``words_of(nbytes) * 8`` long) and bring ``base`` up to date.

        Returns the delta, or ``None`` (dense) once its payload reaches ``limit`` bytes
        (default: :data:`MAX_DELTA_FRACTION` of the bucket's dense bytes) or that fraction
        of the words compared so far, checked after each chunk: the rest is then copied
        without diffing (the stats count the words changed among those compared before
        the cut). Deciding on the words seen so far keeps an all-changed bucket (fp32
        masters, a first step at a large learning rate) from being diffed to the end; a
        bucket whose first chunk changed much more than its rest goes dense though its
        delta as a whole might have been smaller.
        """
        started = time.perf_counter()
        nbytes = max((s.bucket_offset + s.nbytes for s in slices), default=0)
        limit = int(nbytes * MAX_DELTA_FRACTION) if limit is None else limit
        delta = BucketDelta()
        stats = DeltaStats(dense_bytes=nbytes)
        dense = False
        for s in slices:
            new = read(s)
            dst = base[s.bucket_offset : s.bucket_offset + s.nbytes]
            if dense:
                copy_in_slices(dst, new)
                continue
            word0 = s.bucket_offset // WORD
            full = s.nbytes // WORD * WORD
            for start in range(0, full, self.chunk_words * WORD):
                stop = min(full, start + self.chunk_words * WORD)
                self._diff_chunk(new[start:stop], dst[start:stop], word0 + start // WORD, delta)
                stats.compared_words += (stop - start) // WORD
                if not _pays(delta.count, stats.compared_words, limit, self.chunk_words):
                    copy_in_slices(dst[stop:], new[stop:])
                    dense = True
                    break
            if not dense and full < s.nbytes:
                stats.compared_words += 1
                tail = new[full:].cpu()
                if not torch.equal(tail, dst[full:]):
                    dst[full:].copy_(tail)
                    word = base[s.bucket_offset + full : s.bucket_offset + full + WORD]
                    delta.indices.append(torch.tensor([word0 + full // WORD]))
                    delta.values.append(word.clone().view(torch.int64))
                    delta.count += 1
                dense = payload_bytes(delta.count) >= limit
        stats.changed_words = delta.count
        stats.sent_bytes = nbytes if dense else delta.nbytes
        stats.dense_buckets, stats.delta_buckets = (1, 0) if dense else (0, 1)
        stats.seconds = time.perf_counter() - started
        return (None if dense else delta), stats

    def _diff_chunk(
        self, new: torch.Tensor, base: torch.Tensor, word0: int, delta: BucketDelta
    ) -> None:
        words = new.numel() // WORD
        new_words = _aligned_words(new) if new.device.type == "cpu" else None
        if new_words is None:  # device memory, or an odd address: compare a host copy
            new_words = self._scratch[:words]
            new_words.view(torch.uint8).copy_(new)
        base_words = _aligned_words(base)
        if base_words is None:
            raise ValueError("a delta base must be 8-byte aligned")
        mask = self._mask[:words]
        torch.ne(new_words, base_words, out=mask)
        changed = torch.nonzero(mask).view(-1)
        if changed.numel() == 0:
            return
        values = new_words.index_select(0, changed)
        base_words.index_copy_(0, changed, values)
        delta.indices.append(changed.add_(word0))
        delta.values.append(values)
        delta.count += changed.numel()


def apply_delta(
    payload: torch.Tensor,
    count: int,
    slices: Sequence[Slice],
    destinations: Callable[[Slice], Sequence[torch.Tensor]],
) -> None:
    """Write a bucket delta's changed words into each slice's destinations in place.

    ``payload``: the delta's bytes (``uint8``); ``destinations(s)``: the ``uint8`` views of
    slice ``s``'s bytes to update (none: the slice is not applied). A changed word that runs
    past a slice's last byte (into the alignment gap after it) is written only up to it.
    """
    if payload.numel() != payload_bytes(count):
        raise SyncError(
            f"a delta of {count} words has {payload.numel()} bytes, expected {payload_bytes(count)}"
        )
    if count == 0:
        return
    indices = payload[: 4 * count].view(torch.int32).to(torch.int64)
    values = payload[_values_offset(count) :].view(torch.int64)
    bounds = torch.tensor(
        [[s.bucket_offset // WORD, words_of(s.bucket_offset + s.nbytes)] for s in slices],
        dtype=torch.int64,
    )
    cuts = torch.searchsorted(indices, bounds.view(-1)).view(-1, 2).tolist()
    for s, (lo, hi) in zip(slices, cuts, strict=True):
        if lo == hi:
            continue
        dests = destinations(s)
        if not dests:
            continue
        word0 = s.bucket_offset // WORD
        local = indices[lo:hi] - word0
        vals = values[lo:hi]
        full = s.nbytes // WORD
        partial = s.nbytes % WORD and int(local[-1]) == full
        if partial:
            tail = vals[-1:].view(torch.uint8)[: s.nbytes % WORD]
            local, vals = local[:-1], vals[:-1]
        for dest in dests:
            _write_words(dest[: full * WORD], local, vals)
            if partial:
                dest[full * WORD :].copy_(tail)


def _write_words(dest: torch.Tensor, local: torch.Tensor, vals: torch.Tensor) -> None:
    if local.numel() == 0:
        return
    words = _aligned_words(dest)
    if words is not None:
        words.index_copy_(0, local, vals)
    else:  # destination at an odd address: write 8-byte rows
        dest.view(-1, WORD).index_copy_(0, local, vals.view(torch.uint8).view(-1, WORD))
