"""The checkpoint's own messages (``slipstream.checkpoint.messages``): each reads back what
it wrote, a malformed one fails naming the message and the field, and the index on disk
keeps its shape: a checkpoint written before the messages had classes still loads.

``fixtures/index_v1`` was written by ``ss.save(_fixture_state(), ...)`` with main's code
at commit 1e93674, before this module existed (its ``.slipstream.json`` is the dict that
code built); it is kept as written.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

import slipstream as ss
from slipstream.checkpoint.format.index import CheckpointIndex, IndexRecord, ValueEntry
from slipstream.checkpoint.load.contents import verify
from slipstream.checkpoint.save.messages import (
    CommitOutcome,
    LayoutDescription,
    LayoutReport,
    SkipDecision,
    WriteReport,
)
from slipstream.checkpoint.tier.messages import (
    HeldStep,
    HostAnnouncement,
    LocalCommitMarker,
    NodeCleared,
    NodeMarked,
    ReplicationReport,
    StepInventory,
    TierCommitOutcome,
    TierRoot,
)
from slipstream.core.flatten import ContainerRecord
from slipstream.errors import CheckpointError, CorruptCheckpointError

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "index_v1"
INDEX_FILE = ".slipstream.json"


def _fixture_state() -> dict:
    """The state ``fixtures/index_v1`` holds, made again the way it was made."""
    g = torch.Generator().manual_seed(28)
    return {
        "model": {"w": torch.randn(8, 6, generator=g), "b": torch.arange(6, dtype=torch.int64)},
        "optim": {
            "state": {"0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 6, generator=g)}},
            "param_groups": [{"lr": 0.01, "params": [0]}],
        },
        "step": 7,
        "note": "written by slipstream before checkpoint/messages.py",
    }


def _blank_like(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _blank_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_blank_like(v) for v in state]
    return None


def _assert_same(got: object, want: object, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}.{i}")
    else:
        assert got == want, (where, got, want)


# -- the index on disk --------------------------------------------------------------------


def test_a_checkpoint_written_before_the_index_had_a_class_still_loads_and_verifies(tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE, directory)
    target = _blank_like(_fixture_state())
    ss.load(target, directory)
    _assert_same(target, _fixture_state())
    report = verify(directory)
    assert report.checksummed_blocks == 4 and report.checksummed_values == 4


def test_the_index_keeps_its_shape_on_disk(tmp_path):
    """A save today writes the keys and value types main's code wrote (the fixture's)."""
    ss.save(_fixture_state(), tmp_path / "ck")
    old = json.loads((FIXTURE / INDEX_FILE).read_text())
    new = json.loads((tmp_path / "ck" / INDEX_FILE).read_text())
    assert list(new) == list(old)
    assert {k: v for k, v in new.items() if k != "save_id"} == {
        k: v for k, v in old.items() if k != "save_id"
    }


def test_an_index_from_a_newer_writer_reads_and_keeps_its_new_fields(tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE, directory)
    index = json.loads((directory / INDEX_FILE).read_text())
    index["compression"] = {"codec": "zstd"}
    index["version"] = 2
    del index["checksum"]  # an optional field left out
    (directory / INDEX_FILE).write_text(json.dumps(index))
    target = _blank_like(_fixture_state())
    ss.load(target, directory)
    _assert_same(target, _fixture_state())
    parsed = CheckpointIndex.from_json((directory / INDEX_FILE).read_bytes(), "ck")
    assert parsed.extra == {"compression": {"codec": "zstd"}} and parsed.version == 2
    assert json.loads(parsed.to_json())["compression"] == {"codec": "zstd"}


@pytest.mark.parametrize(
    "damage, names",
    [
        (lambda ix: ix.update(block_bytes="1 MiB"), "field 'block_bytes' should be int"),
        (lambda ix: ix.pop("records"), "field 'records' is missing"),
        (
            lambda ix: ix["records"]["__0_0.distcp"]["model.w@0,0"].update(blocks="x"),
            "records['__0_0.distcp']['model.w@0,0']: field 'blocks' should be list",
        ),
        (
            lambda ix: ix["records"]["__0_0.distcp"]["model.b@0"].pop("data_offset"),
            "records['__0_0.distcp']['model.b@0']: field 'data_offset' is missing",
        ),
        (
            lambda ix: ix["values"]["step"].update(offset=-0.5),
            "values['step']: field 'offset' should be int",
        ),
        (lambda ix: ix.update(format="something-else"), "is not a slipstream index"),
        (
            lambda ix: ix.update(containers={"m": {"type": "collections.OrderedDict"}}),
            "field 'containers': entry 'm': field 'path' is missing",
        ),
        (
            lambda ix: ix.update(containers={"m": {"path": [["m"]], "type": "builtins.dict"}}),
            "field 'containers': entry 'm': field 'path' is not a non-empty list",
        ),
    ],
)
def test_a_malformed_index_is_refused_naming_the_field(tmp_path, damage, names):
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE, directory)
    index = json.loads((directory / INDEX_FILE).read_text())
    damage(index)
    (directory / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError) as caught:
        ss.load(_blank_like(_fixture_state()), directory)
    assert names in str(caught.value) and INDEX_FILE in str(caught.value)


def test_an_index_that_is_not_json_is_refused(tmp_path):
    directory = tmp_path / "ck"
    shutil.copytree(FIXTURE, directory)
    (directory / INDEX_FILE).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        ss.load(_blank_like(_fixture_state()), directory)


def test_the_index_reads_back_what_it_wrote():
    index = CheckpointIndex(
        {"__0_0.distcp": {"w@0": IndexRecord(0, 100, 64, 32, [1, 2**64 - 1])}},
        {"step": ValueEntry("__0_0.distcp", 100, 9, 77)},
        save_id="abc",
        key_types={"opt.0.step": [None, "int", None]},
        containers={
            "model": ContainerRecord(("model",), "collections.OrderedDict"),
            "opt.0": ContainerRecord(("opt", "0"), "builtins.dict", (None, "int"), "w"),
        },
    )
    assert CheckpointIndex.from_json(index.to_json(), "x") == index


# -- the ranks' messages --------------------------------------------------------------------


def test_every_rank_message_reads_back_what_it_wrote():
    desc = LayoutDescription(
        [],
        ["step"],
        {"step": ("step",), "opt.0": ("opt", 0)},
        containers={"cfg": ContainerRecord(("cfg",), "omegaconf.dictconfig.DictConfig")},
    )
    layout = LayoutReport("fp", desc)
    assert LayoutReport.from_json(layout.to_json(), "m") == layout
    write = WriteReport("fp", {"w@0,0": [1, 2]}, {"step": ValueEntry("__0_0.distcp", 9, 4, 5)})
    assert WriteReport.from_json(write.to_json(), "m") == write
    for outcome in (CommitOutcome(save_id="s"), CommitOutcome("boom", timeout=True, dead=True)):
        assert CommitOutcome.from_json(outcome.to_json(), "m") == outcome
    assert SkipDecision.from_json(SkipDecision(True).to_json(), "m") == SkipDecision(True)
    failed = WriteReport(None, error="disk full")
    assert WriteReport.from_json(failed.to_json(), "m") == failed


@pytest.mark.parametrize(
    "cls, text, names",
    [
        (LayoutReport, '{"fp": "a", "error": null}', "field 'desc' is missing"),
        (
            LayoutReport,
            '{"fp": "a", "desc": {"chunks": [["w", "float32", [2], [0]]], "values": [], '
            '"paths": {}}}',
            "field 'chunks' entry 0 is not",
        ),
        (
            LayoutReport,
            '{"fp": "a", "desc": {"chunks": [], "values": [], "paths": {"w": 3}}}',
            "field 'paths' entry 'w' is not a list",
        ),
        (
            WriteReport,
            '{"fingerprint": "a", "records": {"w@0": "zz"}, "values": {}, "error": null}',
            "records['w@0']: expected a list of integers",
        ),
        (
            WriteReport,
            '{"fingerprint": "a", "records": {}, "values": {"step": ["f", 1, 2, 3]}}',
            "values['step']: expected a JSON object",
        ),
        (CommitOutcome, '{"error": null}', "field 'save_id' is missing"),
        (SkipDecision, '{"skip": "yes"}', "field 'skip' should be bool"),
        (SkipDecision, "[1, 2]", "expected a JSON object"),
        (CommitOutcome, "{truncated", "not valid JSON"),
    ],
)
def test_a_malformed_rank_message_fails_naming_the_message_and_field(cls, text, names):
    what = "rank 1's 3/done message"
    with pytest.raises(CheckpointError) as caught:
        cls.from_json(text, what)
    assert what in str(caught.value) and names in str(caught.value), str(caught.value)
    assert not isinstance(caught.value, CorruptCheckpointError)


# -- the local tier's messages ----------------------------------------------------------------


A, B = "xxh3-blocks:" + "a" * 64, "sha256:" + "b" * 64


def test_every_local_tier_message_reads_back_what_it_wrote():
    messages = [
        HostAnnouncement("node-3"),
        NodeCleared(7),
        NodeMarked(7),
        NodeMarked(7, "/dev/shm/x/step_7/.local_commit: OSError: No space left on device"),
        TierRoot("/dev/shm/slipstream/ab12"),
        ReplicationReport(
            {"__1_0.distcp": 4096, ".metadata": 120}, {"__1_0.distcp": A, ".metadata": B}
        ),
        ReplicationReport({"__1_0.distcp": 4096}, {}),  # a data file's digest: rank 0's part
        ReplicationReport(error="rank 1: PeerDiedError: gone", dead=[3]),
        TierCommitOutcome(
            {"__0_0.distcp": 10, "__1_0.distcp": 12}, {"__0_0.distcp": A, "__1_0.distcp": B}
        ),
        TierCommitOutcome(error="rank 2 timed out", dead=[]),
        StepInventory(
            {
                4: HeldStep(
                    {"__0_0.distcp": 10, ".metadata": 3},
                    {"__0_0.distcp": A, ".metadata": B},
                    ["__0_0.distcp"],
                )
            }
        ),
    ]
    for message in messages:
        assert type(message).from_json(message.to_json(), "m") == message
    marker = LocalCommitMarker(9, 4, {"__0_0.distcp": 10}, {"__0_0.distcp": A}, "c" * 64)
    assert LocalCommitMarker.from_json(marker.to_json(), "m") == marker
    # the marker keeps the shape it had on disk before it had a class, plus the manifest's
    # digests and its MAC
    assert json.loads(marker.to_json()) == {
        "step": 9,
        "world_size": 4,
        "files": {"__0_0.distcp": 10},
        "digests": {"__0_0.distcp": A},
        "mac": "c" * 64,
    }


@pytest.mark.parametrize(
    "cls, text, names",
    [
        (HostAnnouncement, '{"host": 3}', "field 'host' should be str"),
        (NodeCleared, "{}", "field 'step' is missing"),
        (NodeMarked, '{"step": 3, "error": 1}', "field 'error' should be str"),
        (TierRoot, "{}", "field 'url' is missing"),
        (ReplicationReport, '{"files": {"a": -1}, "error": null}', "field 'files' entry 'a'"),
        (ReplicationReport, '{"error": "x", "dead": ["r1"]}', "field 'dead'"),
        (TierCommitOutcome, '{"error": null}', "field 'files' is missing"),
        (
            TierCommitOutcome,
            '{"error": null, "files": {"a": 1}, "digests": {"b": "sha256:' + "0" * 64 + '"}}',
            "field 'digests' does not name the same files",
        ),
        (
            TierCommitOutcome,
            '{"error": null, "files": {"a": 1}, "digests": {"a": "' + "0" * 64 + '"}}',
            "field 'digests' entry 'a' is not a digest of a kind it knows",
        ),
        (
            ReplicationReport,
            '{"error": null, "files": {"a": 1}, "digests": {"b": "sha256:' + "0" * 64 + '"}}',
            "field 'digests' does not name the same files",
        ),
        (StepInventory, '{"steps": {"x": {}}}', "field 'steps' key 'x' is not a step number"),
        (
            StepInventory,
            '{"steps": {"4": {"files": {"a": 1}, "digests": {"a": "sha256:' + "0" * 64 + '"}, '
            '"held": ["b"]}}}',
            "steps['4']: field 'held' names 'b'",
        ),
        (TierCommitOutcome, "{truncated", "not valid JSON"),
    ],
)
def test_a_malformed_local_tier_message_fails_naming_the_message_and_field(cls, text, names):
    what = "rank 1's tier/commit/3 message"
    with pytest.raises(CheckpointError) as caught:
        cls.from_json(text, what)
    assert what in str(caught.value) and names in str(caught.value), str(caught.value)


def test_a_malformed_local_commit_marker_is_corrupt_naming_the_field():
    with pytest.raises(CorruptCheckpointError, match=r"step_4/.local_commit: field 'world_size'"):
        LocalCommitMarker.from_json('{"step": 4, "files": {}}', "step_4/.local_commit")
