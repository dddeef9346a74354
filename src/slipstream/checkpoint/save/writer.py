"""Writing: a rank's staged image (and its plain values) into its data file or object.

The image is cut into pieces written in parallel through the storage backend's
:class:`~..storage.DataWriter` as soon as staging has passed them (``pwrite`` on the local
disk, multipart parts on an object store); block checksums are taken once staging is
done; the plain values are appended; the writer makes it durable. A failure aborts the
writer, removing what it wrote, only after every piece's write has returned (so none runs
on a closed file).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from ...core import tracing
from ...core.buffers import byte_view
from ...core.checksum import block_checksums, checksum
from ...core.threads import lower_thread_priority
from ...errors import PeerTimeoutError
from ..format.index import ValueEntry
from ..storage import DataWriter
from .job import SaveJob
from .messages import WriteReport
from .options import SaveOptions


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
        plan = job.plan
        where = f"{job.storage.url}/{job.file}"
        job.progress.wait_for(0, job.timeout, f"a staging buffer for {where}")
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
