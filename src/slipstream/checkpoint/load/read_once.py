"""Who reads which saved bytes when several ranks of one load need the same ones.

Each rank's plan is a list of :class:`Want`: a byte range of a file it reads into one
destination. :func:`assign` cuts every file at every range's ends into segments, finds the
ranks that want each, and gives each segment one reader: the rank that alone wants it, or,
for bytes several ranks want, one of them, the bytes of each such set of ranks split into
about equal contiguous parts, one per rank, cut on checksum block boundaries where the
record has blocks (so a part is verified from its own blocks alone). Every rank computes
the same :class:`Piece` list from the same wants (the function is pure and deterministic),
so no rank has to be told what the others read or send; :func:`share_of` derives one rank's
reads, sends, receives and local copies from it, each transfer numbered alike everywhere.

Invariant: every byte a rank wants is in exactly one piece, read once, by a rank that wants
it; each other rank that wants it is sent it by that reader.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Want:
    """Bytes ``[lo, hi)`` of ``file`` that one read of a rank fills; ``origin`` and
    ``block`` place the checksum blocks of the record they are in (``block`` 0: none)."""

    file: str
    lo: int
    hi: int
    origin: int
    block: int


Taker = tuple[int, int]
"""A rank, and the index of its :class:`Want` that a piece falls in."""


@dataclass(frozen=True)
class Piece:
    """Bytes ``[lo, hi)`` of ``file``, read by ``reader`` and wanted by ``takers``."""

    file: str
    lo: int
    hi: int
    reader: int
    takers: tuple[Taker, ...]


@dataclass(frozen=True)
class Transfer:
    """Bytes ``[lo, hi)`` of ``file``, from the destination of want ``source`` (on the
    rank that read them) to want ``dest`` of ``peer``; ``tag`` is the same on both ranks."""

    tag: int
    peer: int
    file: str
    lo: int
    hi: int
    source: int
    dest: int


@dataclass(frozen=True)
class OwnRead:
    """Bytes ``[lo, hi)`` this rank reads from storage into its want ``want``."""

    want: int
    lo: int
    hi: int


@dataclass
class RankShare:
    """One rank's part of a shared load (see :func:`share_of`)."""

    reads: list[OwnRead] = field(default_factory=list)
    sends: list[Transfer] = field(default_factory=list)
    receives: list[Transfer] = field(default_factory=list)
    copies: list[Transfer] = field(default_factory=list)
    """Bytes wanted twice by this rank itself: copied from one want to the other."""


def digest(wants: Sequence[Want]) -> str:
    """A name for a plan: equal on two ranks exactly when their wants are."""
    text = "\n".join(f"{w.file}\0{w.lo}\0{w.hi}\0{w.origin}\0{w.block}" for w in wants)
    return hashlib.sha256(text.encode()).hexdigest()


def hulls(wants: Sequence[Want]) -> dict[str, tuple[int, int]]:
    """Per file, the smallest range holding every want of it."""
    out: dict[str, tuple[int, int]] = {}
    for w in wants:
        lo, hi = out.get(w.file, (w.lo, w.hi))
        out[w.file] = (min(lo, w.lo), max(hi, w.hi))
    return out


def hulls_overlap(per_rank: Sequence[dict[str, tuple[int, int]]]) -> bool:
    """Whether two ranks' hulls share a byte of some file (then their wants may)."""
    seen: dict[str, list[tuple[int, int]]] = {}
    for own in per_rank:
        for file, (lo, hi) in own.items():
            if any(lo < end and start < hi for start, end in seen.get(file, [])):
                return True
        for file, span in own.items():
            seen.setdefault(file, []).append(span)
    return False


@dataclass
class _Segment:
    file: str
    lo: int
    hi: int
    takers: tuple[Taker, ...]
    origin: int
    block: int


def _segments(wants: Sequence[Sequence[Want]]) -> list[_Segment]:
    """Every file cut at every want's ends; each cut with the wants covering it."""
    by_file: dict[str, list[tuple[int, int, Want]]] = {}
    for rank, own in enumerate(wants):
        for i, w in enumerate(own):
            if w.hi > w.lo:
                by_file.setdefault(w.file, []).append((rank, i, w))
    segments: list[_Segment] = []
    for file in sorted(by_file):
        entries = by_file[file]
        starts: dict[int, list[tuple[int, int, Want]]] = {}
        ends: dict[int, list[Taker]] = {}
        for rank, i, w in entries:
            starts.setdefault(w.lo, []).append((rank, i, w))
            ends.setdefault(w.hi, []).append((rank, i))
        active: dict[Taker, Want] = {}
        bounds = sorted(set(starts) | set(ends))
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            for taker in ends.get(lo, []):
                del active[taker]
            for rank, i, w in starts.get(lo, []):
                active[(rank, i)] = w
            if active:
                first = active[min(active)]
                takers = tuple(sorted(active))
                segments.append(_Segment(file, lo, hi, takers, first.origin, first.block))
    return segments


def _snap(pos: int, seg: _Segment, lo: int) -> int:
    """``pos`` moved to the nearest checksum block boundary, kept within ``[lo, seg.hi]``."""
    if seg.block:
        pos = seg.origin + (pos - seg.origin + seg.block // 2) // seg.block * seg.block
    return min(max(pos, lo), seg.hi)


def _split(segments: list[_Segment], ranks: tuple[int, ...]) -> list[Piece]:
    """``segments`` (wanted by ``ranks``, in file order) cut into one contiguous part per
    rank of about the same bytes."""
    total = sum(s.hi - s.lo for s in segments)
    parts = len(ranks)
    pieces: list[Piece] = []
    before = 0  # bytes of the segments before this one
    j = 0
    for seg in segments:
        lo = seg.lo
        while lo < seg.hi:
            share_end = (j + 1) * total // parts if j < parts - 1 else None
            if share_end is None or share_end >= before + seg.hi - seg.lo:
                pieces.append(Piece(seg.file, lo, seg.hi, ranks[j], seg.takers))
                break
            cut = _snap(seg.lo + share_end - before, seg, lo)
            if cut > lo:
                pieces.append(Piece(seg.file, lo, cut, ranks[j], seg.takers))
            lo = cut
            j += 1
        before += seg.hi - seg.lo
    return pieces


def assign(wants: Sequence[Sequence[Want]]) -> list[Piece]:
    """The pieces of every rank's wants (``wants[rank]``) and who reads each; see the
    module docstring."""
    alone: list[Piece] = []
    shared: dict[tuple[int, ...], list[_Segment]] = {}
    for seg in _segments(wants):
        ranks = tuple(sorted({rank for rank, _ in seg.takers}))
        if len(ranks) == 1:
            alone.append(Piece(seg.file, seg.lo, seg.hi, ranks[0], seg.takers))
        else:
            shared.setdefault(ranks, []).append(seg)
    pieces = alone
    for ranks in sorted(shared):
        pieces.extend(_split(shared[ranks], ranks))
    pieces.sort(key=lambda p: (p.file, p.lo))
    return pieces


def share_of(pieces: Sequence[Piece], rank: int) -> RankShare:
    """What ``rank`` reads, sends, receives and copies for ``pieces``; transfers are
    numbered in piece order, so both ends of one carry the same tag."""
    share = RankShare()
    tag = 0
    for piece in pieces:
        source = next(i for r, i in piece.takers if r == piece.reader)
        for r, i in piece.takers:
            if r == piece.reader:
                if r == rank:
                    if i == source:
                        share.reads.append(OwnRead(i, piece.lo, piece.hi))
                    else:
                        share.copies.append(
                            Transfer(-1, r, piece.file, piece.lo, piece.hi, source, i)
                        )
                continue
            move = Transfer(tag, r, piece.file, piece.lo, piece.hi, source, i)
            if piece.reader == rank:
                share.sends.append(move)
            elif r == rank:
                share.receives.append(
                    Transfer(tag, piece.reader, piece.file, piece.lo, piece.hi, source, i)
                )
            tag += 1
    return share
