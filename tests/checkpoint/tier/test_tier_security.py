"""What only the job may write into the local tier, and recovery that falls back: 4 gloo
ranks as 2 nodes of 2 (the setup and the reference run of ``test_two_tier``).

- A stranger process (no torch, no slipstream: only sockets and the peer link's frame
  format) on every rank's real peer link gets no byte of any file, no step or size, and no
  ``put`` accepted, before and after the job's own ranks have used the link.
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
import struct
import subprocess
import sys

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

STRANGER = r"""
import json, os, socket, struct, sys

addresses = [tuple(a) for a in json.loads(sys.argv[1])]
names = json.loads(sys.argv[2])
MAGIC = b"slipstream-peer-link/1\n\0"


def frame(header):
    body = json.dumps(header).encode()
    return struct.pack("!I", len(body)) + body


def talk(address, data):
    # send ``data`` and end the stream, then read whatever comes back until the server
    # closes the connection (or goes quiet)
    got = b""
    with socket.create_connection(address, timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
    return got


replies = []
for address in addresses:
    for name in names:
        read = {"op": "read", "name": name, "offset": 0, "length": 16}
        past = {"op": "read", "name": name, "offset": 1 << 40, "length": 1}
        put = {"op": "put", "name": name, "length": 4}
        attempts = [
            frame(read),                                     # the old, open protocol
            frame(past),                                     # a read past the end: its size?
            frame(put) + b"evil",                            # a put
            frame({"op": "size", "name": name}),             # an unknown request
            MAGIC + os.urandom(32) + os.urandom(32) + frame(read),  # a guessed proof
            MAGIC + os.urandom(32) + os.urandom(32) + frame(put) + b"evil",
            MAGIC[:5],                                       # a truncated greeting
            os.urandom(300),
        ]
        replies += [talk(address, a).hex() for a in attempts]
print(json.dumps(replies))
"""


def stranger(addresses: list[tuple[str, int]], names: list[str]) -> list[bytes]:
    """What a process with neither torch nor slipstream gets back from each attempt."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin")}
    out = subprocess.run(
        [sys.executable, "-I", "-c", STRANGER, json.dumps(addresses), json.dumps(names)],
        capture_output=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr.decode()
    return [bytes.fromhex(r) for r in json.loads(out.stdout)]


def check_stranger(base: str, addresses: list[tuple[str, int]], steps: list[int]) -> None:
    names = [f"step_{s}/{f}" for s in steps for f in ("__0_0.distcp", ".metadata")]
    names.append("step_1/../../.tier_key")
    before = snapshot(base)
    replies = stranger(addresses, names)
    assert len(replies) == len(addresses) * len(names) * 8
    for reply in replies:
        # nothing, or the handshake's challenge (a random nonce and a MAC): never a header,
        # a size or a byte of a file
        assert len(reply) in (0, 64), reply[:200]
        assert b"step" not in reply and b"error" not in reply
    assert snapshot(base) == before, "a stranger's put changed a node's files"


def _strangers_on_the_link(rank: int, world: int, base: str) -> None:
    state = initial_state(rank)
    with checkpointer(base, rank) as ck:
        assert ck.local_tier is not None
        with open(os.path.join(base, f"address{rank}.json"), "w") as f:
            json.dump(list(ck.local_tier.address), f)
        dist.barrier()
        addresses = [
            tuple(json.load(open(os.path.join(base, f"address{r}.json")))) for r in range(world)
        ]
        if rank == 0:  # no valid client has connected yet
            check_stranger(base, addresses, [1])
        dist.barrier()
        for step in (1, 2):
            train_step(state, rank, step)
            ck.save(step, state).result(TIMEOUT)
        dist.barrier()
        if rank == 0:  # every rank's valid clients have connected, and idle connections wait
            check_stranger(base, addresses, [1, 2])
        dist.barrier()
        loaded = initial_state(rank)
        assert ck.load(loaded, strict=False) == 2 and ck.last_load_tier == "local"
        assert_same(loaded, reference(rank, 2))


def test_a_stranger_on_the_peer_link_learns_nothing_and_puts_nothing(tmp_path):
    run_workers(_strangers_on_the_link, WORLD, str(tmp_path), timeout=240)


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
                    "address": list(ck.local_tier.address),
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
    # naming the file, the peer and its address, and why
    host, port = loaded(base, 0)["address"]
    source = f"step_4/__2_0.distcp from rank 0 ({host}:{port})"
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
