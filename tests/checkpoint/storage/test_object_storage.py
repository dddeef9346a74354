"""The object-store backends on their own: ObjectStorage (obstore) against moto's S3 server
over HTTP (``s3_bucket``, configured only through the AWS_* environment the fixture sets),
and MemoryStorage (``memory://``) where the behaviour is shared. Objects are a few MiB:
parts are the 5 MiB S3 minimum, so 12 MiB is 3 parts.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from storage_server import enforce_auth

from slipstream.checkpoint.storage import MemoryStorage, Storage, resolve_storage
from slipstream.checkpoint.storage.object_store import MIN_PART_BYTES, ObjectStorage
from slipstream.errors import CheckpointError, CorruptCheckpointError

MiB = 1 << 20
PART = MIN_PART_BYTES
FAST_S = 3.0  # a refused or unreachable store must fail within this


def _image(nbytes: int, seed: int = 0) -> bytearray:
    return bytearray(random.Random(seed).randbytes(nbytes))


def _write_all(writer, pieces: list[tuple[int, int]], threads: int = 4) -> None:
    """Write every piece, shuffled, from several threads at once."""
    pieces = list(pieces)
    random.Random(1).shuffle(pieces)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: writer.write(*p), pieces))


@pytest.fixture
def s3(s3_server):
    return boto3.client("s3", endpoint_url=s3_server)


@pytest.fixture(params=["s3", "memory"])
def storage(request) -> Storage:
    if request.param == "s3":
        return ObjectStorage(f"s3://{request.getfixturevalue('s3_bucket')}/run", part_bytes=PART)
    return MemoryStorage(f"memory://test-{uuid.uuid4().hex[:8]}/run")


# -- the data writer ----------------------------------------------------------------------


def test_writer_round_trip_out_of_order_with_tail(storage):
    image = _image(12 * MiB + 123)
    with storage.open_writer("data/0", memoryview(image)) as writer:
        _write_all(writer, writer.pieces(MiB))
        writer.append(memoryview(b"values-1"), len(image))
        writer.append(memoryview(bytearray(b"values-2")), len(image) + 8)
        writer.finish()
    want = bytes(image) + b"values-1values-2"
    assert storage.get("data/0") == want
    assert storage.size("data/0") == len(want)


def test_an_image_given_by_size_arrives_through_write_at_from_reused_buffers(storage):
    """A streamed save's parts (``write_at`` from several threads, queued in file order as
    the saver's writer queues them) come from two slots, each reused as soon as its call
    returns: the object holds every part as it was written."""
    image = _image(12 * MiB + 4096 * 3 + 5)
    part = 3 * MiB
    starts = list(range(0, len(image), part))
    slots = [bytearray(part) for _ in range(2)]

    def write(i: int) -> None:
        start = starts[i]
        slot = slots[i % 2]
        with locks[i % 2]:
            data = memoryview(slot)[: min(part, len(image) - start)]
            data[:] = image[start : start + len(data)]
            writer.write_at(start, data)
            data[:] = bytes(len(data))  # the slot is reused at once

    locks = [threading.Lock(), threading.Lock()]
    with storage.open_writer("data/0", len(image)) as writer:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(write, range(len(starts))))
        writer.append(memoryview(b"tail"), len(image))
        writer.finish()
    assert storage.get("data/0") == bytes(image) + b"tail"


def test_upload_streams_parts_while_later_pieces_are_unwritten(s3_bucket, s3):
    """The first parts reach S3 while the upload waits for the rest (no deadlock), and the
    object is one multipart upload of 5 MiB parts."""
    storage = ObjectStorage(f"s3://{s3_bucket}/run", part_bytes=PART)
    image = _image(12 * MiB, seed=2)
    with storage.open_writer("d", memoryview(image)) as writer:
        writer.write(0, 11 * MiB)
        deadline = time.monotonic() + 5
        parts = []
        while len(parts) < 2 and time.monotonic() < deadline:
            uploads = s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
            if uploads:
                up = uploads[0]
                listing = s3.list_parts(Bucket=s3_bucket, Key=up["Key"], UploadId=up["UploadId"])
                parts = listing.get("Parts", [])
            time.sleep(0.02)
        assert [p["Size"] for p in parts] == [PART, PART]
        writer.write(11 * MiB, 12 * MiB)
        writer.finish()
    assert s3.head_object(Bucket=s3_bucket, Key="run/d")["ETag"].endswith('-3"')
    assert storage.get("d") == bytes(image)


def test_empty_writer_makes_an_empty_object(storage):
    with storage.open_writer("empty", memoryview(b"")) as writer:
        assert writer.pieces(MiB) == []
        writer.finish()
    assert storage.get("empty") == b""


def test_pieces_cover_the_image_in_order(storage):
    with storage.open_writer("p", memoryview(bytearray(10))) as writer:
        assert writer.pieces(4) == [(0, 4), (4, 8), (8, 10)]
        assert writer.pieces(100) == [(0, 10)]
        writer.abort()


def test_abort_leaves_no_object_and_no_upload(s3_bucket, s3):
    storage = ObjectStorage(f"s3://{s3_bucket}/run", part_bytes=PART)
    image = _image(12 * MiB)
    with storage.open_writer("d", memoryview(image)) as writer:
        writer.write(0, 6 * MiB)
        writer.abort()
    assert not storage.exists("d")
    assert s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_abort_after_finish_deletes_the_object(storage):
    with storage.open_writer("d", memoryview(b"abc")) as writer:
        writer.write(0, 3)
        writer.finish()
        assert storage.exists("d")
        writer.abort()
    assert not storage.exists("d")


def test_close_without_finish_aborts(storage):
    with storage.open_writer("d", memoryview(b"abc")) as writer:
        writer.write(0, 3)
    assert not storage.exists("d")


def test_unwritten_piece_fails_finish_naming_the_offset(storage):
    with storage.open_writer("d", memoryview(bytearray(100))) as writer:
        writer.write(0, 40)
        writer.write(60, 100)
        with pytest.raises(CheckpointError, match=r"run/d: .*offset 40 never written"):
            writer.finish()
    assert not storage.exists("d")


def test_append_must_continue_the_object(storage):
    with storage.open_writer("d", memoryview(bytearray(10))) as writer:
        with pytest.raises(CheckpointError, match="append at offset 12.*ends at 10"):
            writer.append(memoryview(b"x"), 12)


def test_memory_objects_do_not_alias_the_callers_buffers():
    storage = MemoryStorage(f"memory://alias-{uuid.uuid4().hex[:8]}/run")
    image = bytearray(b"a" * 100)
    with storage.open_writer("d", memoryview(image)) as writer:
        writer.write(0, 100)
        writer.finish()
    small = bytearray(b"b" * 10)
    storage.put_atomic("s", small)
    image[:] = b"z" * 100
    small[:] = b"z" * 10
    assert storage.get("d") == b"a" * 100
    assert storage.get("s") == b"b" * 10


# -- reads --------------------------------------------------------------------------------


def test_read_into_ranges(storage):
    data = bytes(_image(3000, seed=3))
    storage.put_atomic("obj", data)
    for offset, n in [(0, 3000), (0, 1), (1234, 500), (2999, 1)]:
        out = bytearray(n)
        storage.read_into("obj", offset, memoryview(out))
        assert out == data[offset : offset + n]
    window = bytearray(20)
    storage.read_into("obj", 10, memoryview(window)[5:15])
    assert window[5:15] == data[10:20] and window[:5] == bytes(5)


@pytest.mark.parametrize("offset", [2990, 3000, 4000])
def test_read_past_the_end_is_corrupt_naming_object_and_offset(storage, offset):
    storage.put_atomic("obj", bytes(3000))
    with pytest.raises(CorruptCheckpointError, match=rf"run/obj is truncated.*{offset + 20}"):
        storage.read_into("obj", offset, memoryview(bytearray(20)))


def test_read_of_a_missing_object_is_corrupt(storage):
    with pytest.raises(CorruptCheckpointError, match="run/nope is missing"):
        storage.read_into("nope", 0, memoryview(bytearray(4)))
    with pytest.raises(CorruptCheckpointError, match="run/nope does not exist"):
        storage.size("nope")


# -- small objects, listing, deleting -----------------------------------------------------


def test_put_get_exists_delete(storage):
    assert storage.get("meta") is None and not storage.exists("meta")
    storage.put_atomic("meta", b"one")
    storage.put_atomic("meta", b"two")
    assert storage.get("meta") == b"two" and storage.exists("meta")
    assert storage.size("meta") == 3
    storage.delete("meta")
    storage.delete("meta")  # a missing object is fine
    assert storage.get("meta") is None


def test_list_children_and_delete_all_stay_inside_the_prefix(storage):
    root = storage.url.rsplit("/", 1)[0]
    sibling = resolve_storage(f"{root}/run-2")  # "run" is a string prefix of it
    sibling.put_atomic("k", b"s")
    for name in ["step-1/a", "step-1/sub/b", "step-2/c", "loose"]:
        storage.put_atomic(name, b"x")
    assert storage.list_children() == ["step-1", "step-2"]
    assert storage.child("step-1").list_children() == ["sub"]
    storage.child("step-1").delete_all()
    assert storage.list_children() == ["step-2"] and storage.exists("loose")
    storage.delete_all()
    assert storage.list_children() == [] and not storage.exists("loose")
    assert sibling.get("k") == b"s"
    storage.delete_all()  # a missing location is fine


def test_delete_all_refuses_a_whole_bucket(storage):
    root = resolve_storage(storage.url.rsplit("/", 1)[0])
    with pytest.raises(CheckpointError, match="refusing to delete everything"):
        root.delete_all()


def test_children_and_equal_urls_share_one_store(s3_bucket):
    storage = ObjectStorage(f"s3://{s3_bucket}/run", part_bytes=PART)
    child = storage.child("step-3")
    assert child.url == f"{storage.url}/step-3"
    assert child.client is storage.client
    assert ObjectStorage(storage.url).client is storage.client


def test_memory_stores_are_shared_by_name_only():
    name = f"shared-{uuid.uuid4().hex[:8]}"
    MemoryStorage(f"memory://{name}/a").put_atomic("k", b"v")
    assert MemoryStorage(f"memory://{name}/a").get("k") == b"v"
    assert MemoryStorage(f"memory://{name}-other/a").get("k") is None


def test_cleanup_incomplete_aborts_only_uploads_under_the_prefix(s3_bucket, s3):
    inside = s3.create_multipart_upload(Bucket=s3_bucket, Key="run/step-1/data")
    outside = s3.create_multipart_upload(Bucket=s3_bucket, Key="other/data")
    ObjectStorage(f"s3://{s3_bucket}/run").cleanup_incomplete()
    left = s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [outside["UploadId"]]
    assert inside["UploadId"] != outside["UploadId"]


# -- configuration and failures -----------------------------------------------------------


def test_storage_options_override_the_environment(s3_bucket, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    storage = ObjectStorage(f"s3://{s3_bucket}/run", {"endpoint": s3_server})
    storage.prepare()
    storage.put_atomic("k", b"v")
    assert storage.get("k") == b"v"


def test_an_endpoint_obstore_would_ignore_is_refused(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(CheckpointError, match="endpoint 'http://other:1' would be ignored"):
        ObjectStorage("s3://some-bucket/run", {"endpoint": "http://other:1"})


def test_missing_bucket_fails_at_once_naming_it(s3_server):
    storage = ObjectStorage("s3://no-such-bucket-here/run", part_bytes=PART)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="bucket 'no-such-bucket-here' does not exist"):
        storage.prepare()
    with pytest.raises(CheckpointError, match="s3://no-such-bucket-here/run/d: .*does not exist"):
        storage.put_atomic("d", b"x")
    with storage.open_writer("d", memoryview(b"abc")) as writer:
        with pytest.raises(CheckpointError, match="uploading s3://no-such-bucket-here/run/d"):
            writer.write(0, 3)
            writer.finish()
    assert time.monotonic() - start < FAST_S


def test_wrong_credentials_fail_at_once_naming_the_bucket(s3_bucket, s3_server):
    wrong = {"access_key_id": "AKIAWRONG", "secret_access_key": "wrong"}
    storage = ObjectStorage(f"s3://{s3_bucket}/run", wrong, part_bytes=PART)
    start = time.monotonic()
    with enforce_auth(s3_server):
        with pytest.raises(CheckpointError, match=f"access to bucket '{s3_bucket}' was refused"):
            storage.prepare()
        with storage.open_writer("d", memoryview(b"abc")) as writer:
            writer.write(0, 3)
            with pytest.raises(CheckpointError, match=f"run/d: access to bucket '{s3_bucket}'"):
                writer.finish()
    assert time.monotonic() - start < FAST_S


def test_unreachable_endpoint_fails_within_seconds(s3_bucket):
    storage = ObjectStorage(f"s3://{s3_bucket}/run", {"endpoint": "http://127.0.0.1:9"})
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=f"could not reach the store of bucket '{s3_bucket}'"):
        storage.prepare()
    assert time.monotonic() - start < FAST_S


def test_unknown_option_is_a_configuration_error():
    with pytest.raises(CheckpointError, match="bad storage configuration.*'key'"):
        ObjectStorage("s3://some-bucket/run", {"key": "s3fs-style"})


def test_small_parts_are_refused_for_s3():
    with pytest.raises(CheckpointError, match="part_bytes must be at least"):
        ObjectStorage("s3://some-bucket/run", part_bytes=MiB)


def test_without_obstore_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(
        CheckpointError, match=r'gs:// checkpoints need obstore: pip install "slipstream\[s3\]"'
    ):
        ObjectStorage("gs://some-bucket/run")


def test_writes_from_many_threads_do_not_block_each_other(storage):
    """Pieces queue without waiting for the upload: 64 writes from 8 threads."""
    image = _image(64 * 4096, seed=5)
    with storage.open_writer("many", memoryview(image)) as writer:
        start = threading.Event()

        def write(piece: tuple[int, int]) -> None:
            start.wait()
            writer.write(*piece)

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(write, p) for p in writer.pieces(4096)]
            start.set()
            for f in futures:
                f.result(timeout=5)
        writer.finish()
    assert storage.get("many") == bytes(image)
