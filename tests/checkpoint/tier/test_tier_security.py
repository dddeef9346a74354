"""What only the job may write into the local tier, and recovery that falls back: 4 gloo
ranks as 2 nodes of 2 (the setup and the reference run of ``test_two_tier``).

- The tier opens no listening socket of its own: its replicas and recoveries move over
  one gloo group, whose listeners are those any gloo group of the job's has (so a stranger
  on the network can do to the tier what it can do to the job's own process groups).
- A forged step written straight into both nodes' directories (a real step's files with
  one value changed, its block checksums recomputed so that the ordinary reader takes it,
  its own ``.local_commit``) is never loaded: the job resumes from the newest genuine step.
- A bogus replica under a genuine name, on the only node left holding that file: the job
  resumes from the previous committed step, every rank the same, bit for bit; where every
  local step has one, from the durable tier; where the durable step is bogus too, every
  rank raises, listing each attempt and saying the state dict may hold part of one.
- A data file's manifest digest (from the index's block checksums) binds exactly that
  file's index entries, and a load refuses an index that does not give it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import struct

import pytest
import torch.distributed as dist
import xxhash
from dist_utils import run_workers
from test_two_tier import (
    RANKS_PER_NODE,
    TIMEOUT,
    WORLD,
    Warnings,
    assert_same,
    checkpointer,
    initial_state,
    node_dir,
    reference,
    save_steps,
    train_step,
)

from slipstream.checkpoint.format.index import CheckpointIndex, IndexRecord, ValueEntry
from slipstream.checkpoint.load.contents import read_all
from slipstream.checkpoint.tier.sealing import blocks_digests, check_blocks
from slipstream.errors import CheckpointError, CorruptCheckpointError


def listening_sockets() -> set[tuple[int, int]]:
    """This process's listening TCP sockets, as (inode, port), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # LISTEN
                    found.add((int(fields[9]), int(fields[1].rsplit(":", 1)[1], 16)))
    return found


def _sockets_of_the_job(rank: int, world: int, base: str) -> None:
    listens: list[object] = []
    original = socket.socket.listen

    def recorded(self, *args):
        listens.append(self.getsockname())
        return original(self, *args)

    socket.socket.listen = recorded  # every listening socket made from Python
    try:
        before = listening_sockets()
        control = dist.new_group(backend="gloo")  # what one gloo group of the job's adds
        one_group = listening_sockets() - before
        state = initial_state(rank)
        with checkpointer(base, rank) as ck:
            opened = listening_sockets() - before - one_group
            for step in (1, 2):
                train_step(state, rank, step)
                ck.save(step, state).result(TIMEOUT)
            loaded = initial_state(rank)
            assert ck.load(loaded, strict=False) == 2 and ck.last_load_tier == "local"
            assert_same(loaded, reference(rank, 2))
            after = listening_sockets() - before - one_group
        dist.destroy_process_group(control)
    finally:
        socket.socket.listen = original
    assert listens == [], f"rank {rank}: slipstream listened on {listens}"
    # the tier's only listeners are those of the one gloo group it makes, as many as any
    # gloo group of the job's opens, and replication and recovery open none
    assert len(opened) == len(one_group), (rank, opened, one_group)
    assert after == opened, (rank, after, opened)


def test_the_local_tier_listens_on_no_socket_of_its_own(tmp_path):
    run_workers(_sockets_of_the_job, WORLD, str(tmp_path), timeout=120)


def snapshot(base: str) -> dict[str, bytes]:
    """Every file of both nodes' local tiers and its contents."""
    found = {}
    for node in (0, 1):
        root = os.path.join(base, f"node{node}")
        for where, _, files in os.walk(root):
            for f in files:
                path = os.path.join(where, f)
                with open(path, "rb") as src:
                    found[os.path.relpath(path, base)] = src.read()
    return found


# -- a forged step --------------------------------------------------------------------------


def _resume_and_check(rank: int, world: int, base: str, want_step: int) -> None:
    warnings = Warnings()
    logging.getLogger("slipstream").addHandler(warnings)
    with checkpointer(base, rank) as ck:
        state = initial_state(rank)
        assert ck.load(state, strict=False) == want_step
        assert_same(state, reference(rank, want_step))
        assert ck.local_tier is not None
        with open(os.path.join(base, f"loaded{rank}.json"), "w") as f:
            json.dump(
                {
                    "step": want_step,
                    "tier": ck.last_load_tier,
                    "warnings": warnings.messages,
                },
                f,
            )


def loaded(base: str, rank: int) -> dict:
    with open(os.path.join(base, f"loaded{rank}.json")) as f:
        return json.load(f)


def forge(source: str, target: str, step: int) -> None:
    """``source``'s files as step ``step`` at ``target``, rank 0's ``w[0, 0]`` set to
    1234.5, its block checksum recomputed, and a ``.local_commit`` of the forger's own."""
    shutil.copytree(source, target)
    index_path = os.path.join(target, ".slipstream.json")
    with open(index_path) as f:
        index = json.load(f)
    record = index["records"]["__0_0.distcp"]["rank0.w@0,0"]
    data_path = os.path.join(target, "__0_0.distcp")
    with open(data_path, "r+b") as f:
        f.seek(record["data_offset"])
        f.write(struct.pack("<f", 1234.5))
        f.seek(record["data_offset"])
        block = f.read(min(record["nbytes"], index["block_bytes"]))
    record["blocks"][0] = xxhash.xxh3_64(block).intdigest()
    with open(index_path, "w") as f:
        json.dump(index, f)
    files = {
        n: os.path.getsize(os.path.join(target, n))
        for n in os.listdir(target)
        if n != ".local_commit"
    }
    # the manifest's digests as the job computes them (the forger knows the format; it
    # lacks only the key)
    with open(index_path, "rb") as f:
        digests = blocks_digests(CheckpointIndex.from_json(f.read(), index_path), list(files))
    for n in (".metadata", ".slipstream.json"):
        digests[n] = (
            "sha256:" + hashlib.sha256(open(os.path.join(target, n), "rb").read()).hexdigest()
        )
    marker = {"step": step, "world_size": WORLD, "files": files, "digests": digests}
    marker["mac"] = hashlib.sha256(os.urandom(32)).hexdigest()  # no key: a guess
    with open(os.path.join(target, ".local_commit"), "w") as f:
        json.dump(marker, f)


def test_a_forged_step_in_the_nodes_directories_is_never_loaded(tmp_path):
    base = str(tmp_path)
    run_workers(save_steps, WORLD, base, 4, timeout=90)
    for node in (0, 1):
        root = os.path.join(base, f"node{node}")
        forge(os.path.join(root, "step_4"), os.path.join(root, "step_1006"), 1006)
    # the forgery is good enough for the ordinary reader: its checksums hold
    flat = read_all(os.path.join(base, "node0", "step_1006"))
    assert float(flat["rank0.w"][0, 0]) == 1234.5
    run_workers(_resume_and_check, WORLD, base, 4, timeout=90)
    for rank in range(WORLD):
        got = loaded(base, rank)
        assert (got["step"], got["tier"]) == (4, "local")
        refused = [w for w in got["warnings"] if "step_1006/.local_commit" in w]
        assert refused and "MAC does not verify" in refused[0], got["warnings"]
    for node in (0, 1):  # the abandoned run's steps past 4 are gone, the forgery with them
        assert not os.path.exists(os.path.join(base, f"node{node}", "step_1006"))


# -- a bogus replica ---------------------------------------------------------------------


def test_a_bogus_replica_falls_back_to_the_previous_step_bit_for_bit(tmp_path):
    base = str(tmp_path)
    run_workers(save_steps, WORLD, base, 4, timeout=90)
    # node 1 is lost; node 0 is the only node left holding rank 2's file of step 4 (its
    # replica), and that replica is random bytes under the genuine name and size
    shutil.rmtree(node_dir(base, RANKS_PER_NODE))
    replica = os.path.join(base, "node0", "step_4", "__2_0.distcp")
    size = os.path.getsize(replica)
    with open(replica, "wb") as f:
        f.write(os.urandom(size))
    run_workers(_resume_and_check, WORLD, base, 3, timeout=90)
    for rank in range(WORLD):
        got = loaded(base, rank)
        assert (got["step"], got["tier"]) == (3, "local")  # asserted bit for bit in the ranks
    # rank 2 read its file of step 4 from rank 0, the only holder left, and refused it,
    # naming the file, the peer and its node, and why
    source = "step_4/__2_0.distcp from rank 0 (node 0)"
    refusals = [w for w in loaded(base, 2)["warnings"] if "could not load local step 4" in w]
    assert any(source in w and "__2_0.distcp: checksum mismatch" in w for w in refusals), loaded(
        base, 2
    )["warnings"]


def test_bogus_replicas_of_every_local_step_fall_back_to_the_durable_tier(tmp_path):
    base = str(tmp_path)
    run_workers(save_steps, WORLD, base, 5, timeout=90)  # durable: step 5; local: 4 and 5
    shutil.rmtree(node_dir(base, RANKS_PER_NODE))
    for step in (4, 5):
        replica = os.path.join(base, "node0", f"step_{step}", "__2_0.distcp")
        size = os.path.getsize(replica)
        with open(replica, "wb") as f:
            f.write(os.urandom(size))
    run_workers(_resume_and_check, WORLD, base, 5, timeout=90)
    for rank in range(WORLD):
        got = loaded(base, rank)
        assert (got["step"], got["tier"]) == (5, "durable")  # bit for bit, in the ranks
    assert any("the local tier could not serve step 5" in w for w in loaded(base, 0)["warnings"])


def _resume_fails(rank: int, world: int, base: str) -> None:
    with checkpointer(base, rank) as ck:
        state = initial_state(rank)
        try:
            ck.load(state, strict=False)
        except CheckpointError as exc:
            message = str(exc)
        else:
            raise AssertionError("a load where no step loads on every rank returned")
        with open(os.path.join(base, f"failed{rank}.txt"), "w") as f:
            f.write(message)


def test_where_nothing_loads_the_error_lists_every_attempt_and_says_the_state_is_partial(
    tmp_path,
):
    base = str(tmp_path)
    run_workers(save_steps, WORLD, base, 5, timeout=90)  # durable: step 5; local: 4 and 5
    shutil.rmtree(node_dir(base, RANKS_PER_NODE))
    for where in ("node0/step_4", "node0/step_5", "durable/step_5"):
        bogus = os.path.join(base, where, "__2_0.distcp")
        size = os.path.getsize(bogus)
        with open(bogus, "wb") as f:
            f.write(os.urandom(size))
    run_workers(_resume_fails, WORLD, base, timeout=90)
    for rank in range(WORLD):
        with open(os.path.join(base, f"failed{rank}.txt")) as f:
            message = f.read()
        for attempt in ("step 5 from the local tier", "step 5 from", "step 4 from the local tier"):
            assert attempt in message, message
        assert "checksum mismatch" in message and "may hold part of a failed attempt" in message


# -- the manifest's digests ------------------------------------------------------------------


def _index(blocks: list[int], value_checksum: int) -> CheckpointIndex:
    return CheckpointIndex(
        {
            "__0_0.distcp": {"w@0": IndexRecord(0, 100, 64, 3 << 20, blocks)},
            "__1_0.distcp": {"v@0": IndexRecord(0, 100, 64, 1 << 20, [7])},
        },
        {"step": ValueEntry("__0_0.distcp", 200, 10, value_checksum)},
    )


def test_a_data_files_digest_binds_its_index_entries_and_only_them():
    files = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    genuine = blocks_digests(_index([1, 2, 3], 9), files)
    assert all(d.startswith("xxh3-blocks:") for d in genuine.values())
    assert len(set(genuine.values())) == 3  # an empty file has a digest of its own
    # one block checksum, or a value's checksum, of rank 0's file changes its digest only
    for other in (_index([1, 2, 4], 9), _index([1, 2, 3], 8)):
        changed = blocks_digests(other, files)
        assert changed["__0_0.distcp"] != genuine["__0_0.distcp"]
        assert {f: changed[f] for f in files[1:]} == {f: genuine[f] for f in files[1:]}
    # an index read back from its bytes gives the same digests (the manifest's are taken
    # from the bytes rank 0 wrote; a load's from the index it reads)
    read = CheckpointIndex.from_json(_index([1, 2, 3], 9).to_json(), "index")
    assert blocks_digests(read, files) == genuine
    check_blocks(read, genuine, "step_4")
    with pytest.raises(CorruptCheckpointError, match=r"step_4: refused, the index's .* __0_0"):
        check_blocks(_index([1, 2, 4], 9), genuine, "step_4")
    with pytest.raises(CorruptCheckpointError, match="step_4: refused, the step has no index"):
        check_blocks(None, genuine, "step_4")
