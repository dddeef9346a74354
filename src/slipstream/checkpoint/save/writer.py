"""Writing: a rank's staged image (and its plain values) into its data file or object.

The image is cut into pieces written in parallel through the storage backend's
:class:`~..storage.DataWriter` as soon as staging has passed them (``pwrite`` on the local
disk, multipart parts on an object store); block checksums are taken once staging is
done; the plain values are appended; the writer makes it durable. A failure aborts the
writer, removing what it wrote, only after every piece's write has returned (so none runs
on a closed file).

A save that streams through a ring of parts (:mod:`.part_ring`) is written part by part
instead: each part's pieces go out from its slot, its records' bytes are hashed in file
order (blocks cut by a part's end carried over to the next), and the slot is given back
once both are done.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from ...core import tracing
from ...core.buffers import PAGE_BYTES, byte_view
from ...core.checksum import BlockChecksums, block_checksums, checksum
from ...core.threads import lower_thread_priority
from ...errors import CheckpointError, PeerTimeoutError, SlipstreamError
from ..format.index import ValueEntry
from ..storage import DataWriter
from .job import SaveJob
from .messages import WriteReport
from .options import SaveOptions
from .part_ring import PartRing


class RankWriter:
    """Owns the threads that write one rank's pieces in parallel (``io_threads``)."""

    def __init__(self, options: SaveOptions, priority: tuple[int, bool]) -> None:
        self.options = options
        self._io_pool = ThreadPoolExecutor(
            options.io_threads,
            "slipstream-io",
            initializer=lower_thread_priority,
            initargs=priority,
        )

    def _write_piece(self, job: SaveJob, out: DataWriter, start: int, end: int) -> None:
        job.progress.wait_for(end, job.timeout, f"staging of {out.path}")
        with tracing.span("slipstream.save.write_piece", start=start, end=end):
            out.write(start, end)

    def write(self, job: SaveJob) -> WriteReport:
        """Write the staged image as it fills, then the values; make it durable; return the
        report. A failure aborts the writer, removing what it wrote.

        Checksums are taken once staging is complete, so that they never compete with the
        staging copy (the phase the training loop may be waiting on) for a core.
        """
        where = f"{job.storage.url}/{job.file}"
        job.progress.wait_for(0, job.timeout, f"a staging buffer for {where}")
        if job.ring is not None:
            try:
                return self._write_streamed(job, job.ring, where)
            except BaseException as exc:
                job.ring.fail(exc)  # staging may be waiting for a slot
                raise
        plan = job.plan
        assert job.buffer is not None, "staging sets the buffer before the watermark's 0"
        image = byte_view(job.buffer)
        with job.storage.open_writer(job.file, image) as out:
            try:
                writes = [
                    self._io_pool.submit(self._write_piece, job, out, start, end)
                    for start, end in out.pieces(self.options.write_piece_bytes)
                ]
                try:
                    job.progress.wait_for(len(image), job.timeout, f"staging of {where}")
                    records = {
                        rec.chunk.record_key: block_checksums(
                            image[rec.data_offset : rec.data_offset + rec.nbytes]
                        )
                        for rec in plan.records
                    }
                    values = self._append_values(job, out, len(image))
                finally:
                    _join_writes(writes, job.timeout, where)
                out.finish()
            except BaseException:
                out.abort()
                raise
        return WriteReport(job.fingerprint, records, values)

    def _write_streamed(self, job: SaveJob, ring: PartRing, where: str) -> WriteReport:
        """Write a streamed save part by part as each is staged, hash each part's record
        bytes, give each slot back once written and hashed; then the values, as
        :meth:`write` does (whose caller fails the ring on a failure, so that staging
        stops at once). Hashing here runs alongside staging: a slot cannot wait for
        staging to end before it is given back."""
        image_bytes = job.plan.image_bytes
        sums = {rec.chunk.record_key: BlockChecksums(rec.nbytes) for rec in job.plan.records}
        piece_bytes = _piece_bytes(ring, self.options.io_threads, self.options.write_piece_bytes)
        with job.storage.open_writer(job.file, image_bytes) as out:
            try:
                writes: list[Future[None]] = []
                try:
                    for k, part in enumerate(ring.parts):
                        job.progress.wait_for(part.end, job.timeout, f"staging of {where}")
                        data = byte_view(ring.slot(k))[: part.end - part.start]
                        cuts = range(0, len(data), piece_bytes)
                        written = [
                            self._io_pool.submit(
                                _write_at, out, part.start + at, data[at : at + piece_bytes]
                            )
                            for at in cuts
                        ]
                        writes += written
                        for p in part.pieces:
                            if p.record is not None:
                                sums[p.record.chunk.record_key].update(data[p.at : p.at + p.length])
                        _give_back_when_written(ring, k, written)
                    values = self._append_values(job, out, image_bytes)
                finally:
                    _join_writes(writes, job.timeout, where)
                out.finish()
            except BaseException:
                out.abort()
                raise
        records = {key: s.result() for key, s in sums.items()}
        return WriteReport(job.fingerprint, records, values)

    @staticmethod
    def _append_values(job: SaveJob, out: DataWriter, cursor: int) -> dict[str, ValueEntry]:
        """Write this rank's plain values after its tensor records; return their index."""
        values: dict[str, ValueEntry] = {}
        for fqn in job.plan.my_values():
            data = job.values[fqn]
            out.append(memoryview(data), cursor)
            values[fqn] = ValueEntry(job.file, cursor, len(data), checksum(data))
            cursor += len(data)
        return values

    def close(self) -> None:
        self._io_pool.shutdown(wait=True)


def _piece_bytes(ring: PartRing, io_threads: int, most: int) -> int:
    """The pieces a streamed part is written in: every io thread writes a share of each
    part (a part is the most bytes staged ahead of the writes), at most ``most``, whole
    pages (so ``O_DIRECT`` writes stay aligned)."""
    part = ring.parts[0].end - ring.parts[0].start if ring.parts else most
    share = -(-part // max(io_threads, 1))
    return max(PAGE_BYTES, min(most, -(-share // PAGE_BYTES) * PAGE_BYTES))


def _write_at(out: DataWriter, offset: int, data: memoryview) -> None:
    """``out.write_at``, its failure naming the file and the bytes (the backend's own
    errors, which do, as they are)."""
    try:
        out.write_at(offset, data)
    except SlipstreamError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"writing bytes [{offset}, {offset + len(data)}) of {out.path} failed: {exc!r}"
        ) from exc


def _give_back_when_written(ring: PartRing, k: int, writes: list[Future[None]]) -> None:
    """Give part ``k``'s slot back once all of ``writes`` (its pieces) have succeeded; fail
    the ring as soon as one fails."""
    left = [len(writes)]
    lock = threading.Lock()

    def done(write: Future[None]) -> None:
        error = write.exception()
        if error is not None:
            ring.fail(error)
            return
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            ring.give_back(k)

    if not writes:
        ring.give_back(k)
    for write in writes:
        write.add_done_callback(done)


def _join_writes(writes: list[Future[None]], timeout: float, path: str) -> None:
    """Wait for every write of a file, then raise the first failure.

    Waiting for all of them, failed or not, is what keeps a write from running after its
    file descriptor is closed (and its number possibly reused by another file).
    """
    _, pending = futures_wait(writes, timeout)
    if pending:
        raise PeerTimeoutError(f"writes to {path} did not finish within {timeout} s")
    for w in writes:
        w.result()
