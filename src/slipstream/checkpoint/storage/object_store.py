"""Checkpoints in an object store (S3, GCS, Azure Blob) via obstore.

``ObjectStorage("s3://bucket/prefix")`` is one prefix of a bucket.

Configuration comes from where the cloud's own tools look for it. For S3 that is
``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` and ``AWS_REGION`` (else
``AWS_DEFAULT_REGION``), read by obstore itself; an ``http://`` endpoint needs no extra
flag. ``storage_options`` overrides the environment with obstore's config keys
(``endpoint``, ``access_key_id``, ``secret_access_key``, ``region``, ...) plus
``client_options`` and ``retry_config`` dicts, which are merged over this module's
defaults: few retries, so that an unreachable endpoint fails in seconds, not minutes.
A wrong credential or a missing bucket fails at once (a 4xx is never retried).

Invariants:

* One obstore store (one HTTP client) per scheme, bucket, options and environment in the
  process: :meth:`ObjectStorage.child` locations and repeated saves reuse it.
* A data object is one multipart upload read straight from the staging image: obstore
  borrows the image's memory (no copy) until the upload ends, and the writer's
  ``finish``/``abort`` return only once it has ended, so the image is free again then.
* Every error names the object or location (and bucket) it concerns and is a
  :class:`~slipstream.CheckpointError`; short or missing data read back is a
  :class:`~slipstream.CorruptCheckpointError`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

from ...core.copy import copy_bytes
from ...errors import CheckpointError, CorruptCheckpointError
from .base import DataWriter, Storage

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

logger = logging.getLogger(__name__)

SCHEMES = frozenset({"s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl"})
"""URL schemes :class:`ObjectStorage` serves."""

PART_BYTES = 16 * 1024 * 1024
"""Default multipart part size; raised for huge objects to stay under the part limit."""
MIN_PART_BYTES = 5 * 1024 * 1024
"""S3 and GCS refuse smaller parts (except the last)."""
MAX_PARTS = 9_000
"""Parts an image may take: S3 allows 10,000 per upload; the rest is room for the tail."""
UPLOAD_CONCURRENCY = 16
"""Parts of one object in flight at once."""
PIECE_TIMEOUT_S = 600.0
"""How long an upload waits for the next byte range to be written before it gives up."""
FINISH_TIMEOUT_S = 3600.0
"""How long ``finish`` waits for the upload to complete."""
ABORT_TIMEOUT_S = 60.0
"""How long ``abort`` waits for the upload to stop (it cancels parts in flight)."""
DELETE_BATCH = 1000
"""Objects per bulk delete (the S3 limit)."""

DEFAULT_RETRY_CONFIG: dict[str, Any] = {
    "max_retries": 3,
    "retry_timeout": timedelta(seconds=15),
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)},
}
DEFAULT_CLIENT_OPTIONS: dict[str, Any] = {"connect_timeout": "5s"}

_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
_ENDPOINT_KEYS = ("endpoint", "aws_endpoint", "endpoint_url", "aws_endpoint_url")
_BOTO3_KEYS = {
    "access_key_id": "aws_access_key_id",
    "aws_access_key_id": "aws_access_key_id",
    "secret_access_key": "aws_secret_access_key",
    "aws_secret_access_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "aws_session_token": "aws_session_token",
    "token": "aws_session_token",
    "aws_token": "aws_session_token",
    "region": "region_name",
    "aws_region": "region_name",
    "default_region": "region_name",
    "aws_default_region": "region_name",
}

_lock = threading.Lock()
_stores: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], Any] = {}
"""Shared obstore stores: (scheme, bucket, options, environment) -> store."""


class ObjectStorage(Storage):
    """A prefix in an object store; see the module docstring for configuration."""

    small_reads_are_cheap = False

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        part_bytes: int = PART_BYTES,
        upload_concurrency: int = UPLOAD_CONCURRENCY,
    ) -> None:
        scheme, sep, rest = url.partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in SCHEMES:
            raise CheckpointError(f"{url}: not an object store URL ({', '.join(sorted(SCHEMES))})")
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{url}: the URL names no bucket")
        if part_bytes < MIN_PART_BYTES:
            raise CheckpointError(f"{url}: part_bytes must be at least {MIN_PART_BYTES}")
        self.scheme = scheme
        self.bucket = bucket
        self.prefix = "/".join(p for p in prefix.split("/") if p)
        self.url = f"{scheme}://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.storage_options = dict(storage_options or {})
        self.part_bytes = part_bytes
        self.upload_concurrency = upload_concurrency
        self._obs = _import_obstore(scheme)
        self._store = _shared_store(scheme, bucket, self.storage_options, url)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    @property
    def client(self) -> Any:
        """The obstore client this location uses: one per bucket and options, shared by its
        children and by every location with the same URL, so connections are reused."""
        return self._store

    # -- naming ---------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _error(self, exc: Exception, what: str) -> CheckpointError:
        return _checkpoint_error(exc, what, self.bucket)

    def child(self, name: str) -> ObjectStorage:
        return ObjectStorage(
            self._where(name.strip("/")),
            self.storage_options,
            part_bytes=self.part_bytes,
            upload_concurrency=self.upload_concurrency,
        )

    # -- writing --------------------------------------------------------------------------

    def prepare(self) -> None:
        """Check the bucket is reachable with these credentials (one list request)."""
        try:
            self._obs.list_with_delimiter(self._store, prefix=self.prefix or None)
        except Exception as exc:
            raise self._error(exc, f"cannot use {self.url}") from exc

    def open_writer(self, name: str, image: memoryview | int) -> DataWriter:
        return _UploadWriter(self, name, image)

    def part_size(self, nbytes: int) -> int:
        """The part size for an object of about ``nbytes``: at least ``part_bytes``, and
        large enough that the object takes at most :data:`MAX_PARTS` parts."""
        return max(self.part_bytes, -(-nbytes // MAX_PARTS))

    def put_atomic(self, name: str, data: bytes) -> None:
        """One PUT (never multipart), so the object appears whole or not at all."""
        try:
            self._obs.put(self._store, self._key(name), bytes(data), use_multipart=False)
        except Exception as exc:
            raise self._error(exc, f"writing {self._where(name)}") from exc

    # -- reading --------------------------------------------------------------------------

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        if len(out):
            copy_bytes(out, self.read(name, offset, len(out)))

    def read(self, name: str, offset: int, length: int) -> memoryview:
        """One ranged GET; the response's bytes, without a copy."""
        if not length:
            return memoryview(b"")
        end = offset + length
        where = self._where(name)
        try:
            data = self._obs.get_range(self._store, self._key(name), start=offset, length=length)
        except Exception as exc:
            if _is_not_found(exc):
                raise CorruptCheckpointError(
                    f"{where} is missing (reading bytes {offset}..{end})"
                ) from exc
            try:  # a range past the end is refused, not answered short
                size = self._head(name)
            except CheckpointError:
                size = None
            if size is not None and size < end:
                raise _truncated(where, end, size) from exc
            raise self._error(exc, f"reading {where} at offset {offset}") from exc
        if len(data) < length:
            raise _truncated(where, end, offset + len(data))
        return memoryview(data)

    def _head(self, name: str) -> int | None:
        """The size of object ``name``, or ``None`` where it does not exist."""
        try:
            size: int = self._obs.head(self._store, self._key(name))["size"]
            return size
        except Exception as exc:
            if _is_not_found(exc):
                return None
            raise self._error(exc, f"looking up {self._where(name)}") from exc

    def size(self, name: str) -> int:
        size = self._head(name)
        if size is None:
            raise CorruptCheckpointError(f"{self._where(name)} does not exist")
        return size

    def get(self, name: str) -> bytes | None:
        try:
            return bytes(self._obs.get(self._store, self._key(name)).bytes())
        except Exception as exc:
            if _is_not_found(exc):
                return None
            raise self._error(exc, f"reading {self._where(name)}") from exc

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def list_children(self) -> list[str]:
        prefix = f"{self.prefix}/" if self.prefix else None
        try:
            listing = self._obs.list_with_delimiter(self._store, prefix=prefix)
        except Exception as exc:
            raise self._error(exc, f"listing {self.url}") from exc
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"])

    # -- removing -------------------------------------------------------------------------

    def delete(self, name: str) -> None:
        try:
            self._obs.delete(self._store, self._key(name))
        except Exception as exc:
            if not _is_not_found(exc):
                raise self._error(exc, f"deleting {self._where(name)}") from exc

    def delete_all(self) -> None:
        """Delete every object under this prefix, listed first, then in bulk batches.

        Refuses a location without a prefix: that would empty the whole bucket."""
        if not self.prefix:
            raise CheckpointError(f"refusing to delete everything in {self.url}: no prefix")
        try:
            keys = [
                meta["path"]
                for batch in self._obs.list(self._store, prefix=self.prefix)
                for meta in batch
            ]
            for i in range(0, len(keys), DELETE_BATCH):
                self._obs.delete(self._store, keys[i : i + DELETE_BATCH])
        except Exception as exc:
            raise self._error(exc, f"deleting {self.url}") from exc

    def cleanup_incomplete(self, keep: str | None = None) -> None:
        """Abort unfinished multipart uploads under this prefix (left by killed writers),
        except those under the child location ``keep``.

        Call it only when no writer of this prefix is running outside ``keep``: it aborts
        theirs too.
        obstore cannot list multipart uploads, so on S3 this uses boto3, configured from the
        same environment and ``storage_options``; without boto3 it logs and does nothing.
        Elsewhere it does nothing: Azure drops uncommitted blocks after 7 days, and GCS
        needs a lifecycle rule.
        """
        if self.scheme not in ("s3", "s3a"):
            return
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            logger.warning("boto3 is not installed: not cleaning up uploads in %s", self.url)
            return
        client = boto3.client(
            "s3",
            config=Config(connect_timeout=5, retries={"max_attempts": 3}),
            **self._boto3_options(),
        )
        prefix = f"{self.prefix}/" if self.prefix else ""
        kept = f"{prefix}{keep.strip('/')}/" if keep else None
        try:
            pages = client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if kept is not None and upload["Key"].startswith(kept):
                        continue
                    client.abort_multipart_upload(
                        Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
        except Exception as exc:
            raise CheckpointError(
                f"cleaning up unfinished uploads in {self.url} (bucket {self.bucket!r}): {exc}"
            ) from exc

    def _boto3_options(self) -> dict[str, str]:
        options = {
            _BOTO3_KEYS[key.lower()]: value
            for key, value in self.storage_options.items()
            if key.lower() in _BOTO3_KEYS
        }
        endpoint = _endpoint(self.scheme, self.storage_options, self.url)
        if endpoint is not None:
            options["endpoint_url"] = endpoint
        return options


class _UploadWriter(DataWriter):
    """A data object uploaded, as it is written, by one ``obstore.put`` on its own thread.

    ``put`` pulls the object's bytes from :meth:`_chunks`, a generator that hands over the
    byte range starting at the upload's position once :meth:`write` (image pieces, any
    order, any thread) or :meth:`append` (the tail, in order) has queued it; it blocks
    (without the GIL) until then, while obstore uploads earlier parts concurrently.
    ``finish`` ends the input and joins; ``abort`` makes the generator raise, so obstore
    aborts the multipart upload. Either way the thread is joined before they return.

    An image given by its size alone arrives through :meth:`write_at`, whose part is copied
    once the upload has reached it, so at most one such copy waits to be uploaded.
    """

    def __init__(self, storage: ObjectStorage, name: str, image: memoryview | int) -> None:
        self.path = storage._where(name)
        self._storage = storage
        self._name = name
        self._image = memoryview(b"" if isinstance(image, int) else image).cast("B")
        self._size = image if isinstance(image, int) else len(self._image)
        self._cond = threading.Condition()
        self._queued: dict[int, memoryview] = {}  # offset -> bytes there, not yet uploaded
        self._next = 0  # the offset the upload takes next: every byte before it is handed over
        self._end = self._size  # where the next append must start
        self._input_done = False  # finish() called: nothing more will be queued
        self._cancelled = False  # abort() called: the upload must fail
        self._error: BaseException | None = None
        self._uploaded = False
        self._thread = threading.Thread(
            target=self._upload, name=f"slipstream-upload:{name}", daemon=True
        )
        self._thread.start()

    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        n = self._size
        step = max(1, piece_bytes)
        return [(start, min(start + step, n)) for start in range(0, n, step)]

    def write(self, start: int, end: int) -> None:
        if not 0 <= start < end <= len(self._image):
            raise CheckpointError(
                f"{self.path}: write of [{start}, {end}) is outside the image "
                f"of {len(self._image)} bytes"
            )
        self._raise_if_failed()
        with self._cond:
            self._queued[start] = self._image[start:end]
            self._cond.notify_all()

    def write_at(self, offset: int, data: memoryview) -> None:
        data = memoryview(data).cast("B")
        end = offset + len(data)
        if not 0 <= offset < end <= self._size:
            raise CheckpointError(
                f"{self.path}: write of [{offset}, {end}) is outside the image "
                f"of {self._size} bytes"
            )
        with self._cond:
            reached = self._cond.wait_for(
                lambda: self._cancelled or self._error is not None or self._next >= offset,
                timeout=PIECE_TIMEOUT_S,
            )
        self._raise_if_failed()
        if self._cancelled:
            raise CheckpointError(f"upload of {self.path} aborted")
        if not reached:
            raise CheckpointError(
                f"{self.path}: the upload did not reach offset {offset} "
                f"within {PIECE_TIMEOUT_S:.0f} s"
            )
        copy = memoryview(bytes(data))
        with self._cond:
            self._queued[offset] = copy
            self._cond.notify_all()

    def append(self, data: memoryview, offset: int) -> None:
        data = memoryview(data).cast("B")
        self._raise_if_failed()
        with self._cond:
            if offset != self._end:
                raise CheckpointError(
                    f"{self.path}: append at offset {offset}, but the object ends at "
                    f"{self._end}; an object store writes the tail contiguously"
                )
            if not len(data):
                return
            # Immutable bytes may be uploaded as they are; anything else may change later.
            self._queued[offset] = data if isinstance(data.obj, bytes) else memoryview(bytes(data))
            self._end += len(data)
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._input_done = True
            self._cond.notify_all()
        self._join(FINISH_TIMEOUT_S)
        self._raise_if_failed()

    def abort(self) -> None:
        """Cancel the upload (obstore aborts the multipart upload) and wait for it to stop;
        if it had already completed, delete the object (best effort, logged)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        self._join(ABORT_TIMEOUT_S)
        if self._uploaded:
            try:
                self._storage.delete(self._name)
            except CheckpointError as exc:
                logger.warning("could not remove aborted %s: %s", self.path, exc)
            self._uploaded = False

    def close(self) -> None:
        if self._thread.is_alive():
            self.abort()

    # -- the upload thread ----------------------------------------------------------------

    def _upload(self) -> None:
        storage = self._storage
        part = storage.part_size(self._size)
        try:
            storage._obs.put(
                storage._store,
                storage._key(self._name),
                self._chunks(part),
                chunk_size=part,
                max_concurrency=storage.upload_concurrency,
            )
            self._uploaded = True
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _chunks(self, part: int) -> Iterator[memoryview]:
        """The object's bytes in order, each range once queued, in slices of at most
        ``part`` bytes (obstore's concurrency limit is checked once per slice)."""

        def ready() -> bool:
            return self._cancelled or self._next in self._queued or self._input_done

        while True:
            with self._cond:
                arrived = self._cond.wait_for(ready, timeout=PIECE_TIMEOUT_S)
                pos = self._next
                if self._cancelled:
                    raise CheckpointError(f"upload of {self.path} aborted")
                if not arrived:
                    raise CheckpointError(
                        f"{self.path}: no bytes for offset {pos} were written "
                        f"within {PIECE_TIMEOUT_S:.0f} s"
                    )
                view = self._queued.pop(pos, None)
                if view is None:  # input done, nothing at pos: complete, or a hole
                    if pos != self._end or self._queued:
                        raise CheckpointError(
                            f"{self.path}: finished with the bytes at offset {pos} never written"
                        )
                    return
            for i in range(0, len(view), part):
                yield view[i : i + part]
            with self._cond:
                self._next = pos + len(view)
                self._cond.notify_all()

    def _join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(
                f"the upload of {self.path} did not stop within {timeout:.0f} s; "
                "its staging buffer may still be read"
            )

    def _raise_if_failed(self) -> None:
        """Raise the upload's error, if it failed (a write fails early this way); a new
        exception each time, as several threads may raise it."""
        error = self._error
        if isinstance(error, CheckpointError):
            raise CheckpointError(str(error)) from error
        if error is not None:
            raise _checkpoint_error(
                error, f"uploading {self.path}", self._storage.bucket
            ) from error


# -- configuration ------------------------------------------------------------------------


def _import_obstore(scheme: str) -> ModuleType:
    try:
        import obstore
    except ImportError as exc:
        raise CheckpointError(
            f'{scheme}:// checkpoints need obstore: pip install "slipstream[s3]"'
        ) from exc
    return obstore


def _shared_store(scheme: str, bucket: str, options: dict[str, Any], url: str) -> Any:
    """The process's store for this bucket and configuration, made on first use."""
    environment = tuple(sorted(kv for kv in os.environ.items() if kv[0].startswith(_ENV_PREFIXES)))
    key = (scheme, bucket, json.dumps(options, sort_keys=True, default=repr), environment)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = _make_store(scheme, bucket, options, url)
        return store


def _make_store(scheme: str, bucket: str, options: dict[str, Any], url: str) -> Any:
    from obstore.store import from_url

    config = {k: v for k, v in options.items() if k not in ("client_options", "retry_config")}
    client_options = {**DEFAULT_CLIENT_OPTIONS, **options.get("client_options", {})}
    endpoint = _endpoint(scheme, options, url)
    if endpoint is not None and endpoint.startswith("http://"):
        client_options.setdefault("allow_http", True)
    retry_config = {**DEFAULT_RETRY_CONFIG, **options.get("retry_config", {})}
    try:
        return from_url(
            f"{scheme}://{bucket}",
            # the user's options, checked by obstore when it parses them
            client_options=cast("ClientConfig", client_options),
            retry_config=cast("RetryConfig", retry_config),
            **config,
        )
    except Exception as exc:
        raise CheckpointError(f"{url}: bad storage configuration: {_first_line(exc)}") from exc


def _endpoint(scheme: str, options: dict[str, Any], url: str) -> str | None:
    """The endpoint the store will use, as far as it is configured, in obstore's order:
    ``storage_options``, then (S3) ``AWS_ENDPOINT_URL`` or ``AWS_ENDPOINT``, except that
    obstore prefers ``AWS_ENDPOINT_URL_S3`` even to ``storage_options``: a conflict raises."""
    lowered = {k.lower(): v for k, v in options.items()}
    given = next((str(lowered[k]) for k in _ENDPOINT_KEYS if lowered.get(k)), None)
    if scheme not in ("s3", "s3a"):
        return given
    s3_env = os.environ.get("AWS_ENDPOINT_URL_S3")
    if s3_env and given and given != s3_env:
        raise CheckpointError(
            f"{url}: storage_options endpoint {given!r} would be ignored for "
            f"AWS_ENDPOINT_URL_S3={s3_env!r}, which obstore prefers; unset one of them"
        )
    return s3_env or given or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")


# -- errors -------------------------------------------------------------------------------

_S3_CODE = re.compile(r"<Code>(\w+)</Code>")
_STATUS = re.compile(r"status code: (\d{3})")


def _is_not_found(exc: BaseException) -> bool:
    """obstore raises ``FileNotFoundError`` (and declares ``NotFoundError``) for a 404."""
    from obstore.exceptions import NotFoundError

    return isinstance(exc, (FileNotFoundError, NotFoundError)) and "NoSuchBucket" not in str(exc)


def _first_line(exc: BaseException) -> str:
    line = str(exc).strip().split("\n", 1)[0].split(" <?xml", 1)[0]  # drop S3's XML body
    return line if len(line) <= 400 else line[:400] + "..."


def _checkpoint_error(exc: BaseException, what: str, bucket: str) -> CheckpointError:
    """A :class:`CheckpointError` saying ``what`` failed, why in a few words (a missing
    bucket, refused credentials, an unreachable store), and obstore's first line."""
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    text = str(exc)
    code = m.group(1) if (m := _S3_CODE.search(text)) else None
    status = m.group(1) if (m := _STATUS.search(text)) else None
    if code == "NoSuchBucket":
        reason = f"bucket {bucket!r} does not exist"
    elif isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or status in ("401", "403"):
        reason = f"access to bucket {bucket!r} was refused; check the credentials"
    elif "error sending request" in text or "timed out" in text:
        reason = f"could not reach the store of bucket {bucket!r}"
    elif _is_not_found(exc):
        reason = "not found"
    else:
        reason = f"the store of bucket {bucket!r} failed"
    detail = f" ({code})" if code else ""
    return CheckpointError(f"{what}: {reason}{detail}: {_first_line(exc)}")


def _truncated(where: str, end: int, size: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} is truncated: needed bytes up to offset {end}, object ends at {size}"
    )
