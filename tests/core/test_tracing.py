"""Tracing: torch.profiler ranges for every stage, and a Trace Event Format file of
slipstream's threads that Perfetto and chrome://tracing open."""

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile
from trace_format import check_trace_event_format

import slipstream as ss
from slipstream.core import tracing

SAVE_STAGES = [
    "slipstream.save.prepare",
    "slipstream.save.stage",
    "slipstream.save.write",
    "slipstream.save.write_piece",
    "slipstream.save.commit",
]
LOAD_STAGES = ["slipstream.load", "slipstream.load.read", "slipstream.load.read_piece"]


@pytest.fixture(autouse=True)
def no_recording_left():
    yield
    tracing.stop()


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(256, 256, generator=g) for i in range(8)} | {"step": 3}


def _thread_names(doc: dict) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def test_a_save_and_a_load_write_a_valid_trace_of_every_thread(tmp_path):
    trace = tmp_path / "trace.json"
    tracing.start(trace)
    tracing.set_process_name("rank 0")
    state = _state()
    with tracing.span("train.step", step=0):
        response = ss.async_save(state, tmp_path / "ck")
        response.staging_completion.result(60)
    response.upload_completion.result(60)
    back = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    ss.load(back | {"step": 0}, tmp_path / "ck")
    assert all(torch.equal(back[k], state[k]) for k in back)
    assert tracing.stop() == str(trace)

    doc = json.loads(trace.read_text())
    events = check_trace_event_format(doc)
    names = {e["name"] for e in events}
    assert set(SAVE_STAGES + LOAD_STAGES) <= names, sorted(names)
    threads = _thread_names(doc)
    by_thread = defaultdict(set)
    for e in events:
        by_thread[threads[(e["pid"], e["tid"])]].add(e["name"])
    main = threading.main_thread().name
    assert {"train.step", "slipstream.save.prepare", "slipstream.load"} <= by_thread[main]
    stage = [t for t in by_thread if t.startswith("slipstream-stage")]
    upload = [t for t in by_thread if t.startswith("slipstream-upload")]
    assert stage and "slipstream.save.stage" in by_thread[stage[0]], dict(by_thread)
    assert upload and {"slipstream.save.write", "slipstream.save.commit"} <= by_thread[upload[0]]
    process = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert [p["args"]["name"] for p in process] == ["rank 0"]
    assert doc["otherData"]["dropped_events"] == 0
    # the save ran inside the step's range on the training thread
    step = next(e for e in events if e["name"] == "train.step")
    prepare = next(e for e in events if e["name"] == "slipstream.save.prepare")
    assert (
        step["ts"] <= prepare["ts"] and prepare["ts"] + prepare["dur"] <= step["ts"] + step["dur"]
    )


def test_stages_show_as_ranges_in_a_torch_profiler_trace(tmp_path):
    """No slipstream recording: the ranges are torch.profiler's own. The caller's ranges
    show in any profile; with profile_all_threads the saver's threads show too."""
    state = _state()
    ss.save(state, tmp_path / "warm")  # the first save of a layout plans; profile a later one
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ss.save(state, tmp_path / "a")
    assert "slipstream.save.prepare" in {e.name for e in prof.events()}

    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        ss.save(state, tmp_path / "b")
        ss.load(dict(state), tmp_path / "b")
    names = {e.name for e in prof.events()}
    assert set(SAVE_STAGES + LOAD_STAGES) <= names, sorted(n for n in names if "slip" in n)
    exported = tmp_path / "profile.json"
    prof.export_chrome_trace(str(exported))
    assert "slipstream.save.stage" in exported.read_text()


def test_memory_is_bounded_and_the_file_says_what_was_dropped(tmp_path):
    tracing.start(tmp_path / "t.json", max_events=10)
    for i in range(50):
        with tracing.span("tick", i=i):
            pass
    tracing.stop()
    doc = json.loads((tmp_path / "t.json").read_text())
    events = check_trace_event_format(doc)
    assert [e["args"]["i"] for e in events] == list(range(40, 50))
    assert doc["otherData"]["dropped_events"] == 40


def test_spans_from_many_threads_are_all_kept(tmp_path):
    tracing.start(tmp_path / "t.json")
    barrier = threading.Barrier(8)

    def work(n: int) -> None:
        barrier.wait(10)
        for i in range(200):
            with tracing.span("work", thread=n, i=i):
                pass

    threads = [threading.Thread(target=work, args=(n,), name=f"worker-{n}") for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    tracing.stop()
    doc = json.loads((tmp_path / "t.json").read_text())
    events = check_trace_event_format(doc)
    names = _thread_names(doc)
    per_thread = defaultdict(list)
    for e in events:
        per_thread[names[(e["pid"], e["tid"])]].append(e["args"]["i"])
    assert {f"worker-{n}": list(range(200)) for n in range(8)} == dict(per_thread)


def test_intervals_on_tracks_and_merged_files(tmp_path):
    tracing.start(tmp_path / "a.json")
    tracing.record_interval("all-gather of unit blocks.0", "fsdp all-gather", 1_000, 6_000)
    with tracing.span("compute"):
        pass
    tracing.stop()
    other = {
        "traceEvents": [
            {"name": "thread_name", "ph": "M", "pid": 7, "tid": 1, "args": {"name": "t"}},
            {"name": "x", "ph": "X", "ts": 0.5, "dur": 1.0, "pid": 7, "tid": 1},
        ]
    }
    (tmp_path / "b.json").write_text(json.dumps(other))
    merged = tracing.merge([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "m.json")
    doc = json.loads(open(merged).read())
    events = check_trace_event_format(doc)
    gather = next(e for e in events if e["name"] == "all-gather of unit blocks.0")
    assert (gather["ts"], gather["dur"]) == (1.0, 5.0)
    assert _thread_names(doc)[(gather["pid"], gather["tid"])] == "fsdp all-gather"
    assert {e["pid"] for e in events} == {os.getpid(), 7}


def test_the_environment_variable_records_a_process_and_writes_at_exit(tmp_path):
    script = (
        "import torch, slipstream as ss\n"
        f"ss.save({{'w': torch.ones(1000)}}, {str(tmp_path / 'ck')!r})\n"
    )
    env = dict(os.environ, SLIPSTREAM_TRACE=str(tmp_path / "trace-{pid}.json"))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, timeout=120, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    (written,) = list(tmp_path.glob("trace-*.json"))
    assert _pid_of(written) != os.getpid()  # {pid} became the child's process id
    events = check_trace_event_format(json.loads(written.read_text()))
    assert set(SAVE_STAGES) <= {e["name"] for e in events}


def _pid_of(path) -> int:
    return int(path.stem.removeprefix("trace-"))


def test_a_forked_child_does_not_overwrite_its_parent_s_file(tmp_path):
    tracing.start(tmp_path / "parent.json")
    with tracing.span("before-fork"):
        pass
    pid = os.fork()
    if pid == 0:  # the child: spans are not recorded into the parent's file
        code = 0 if not tracing.is_recording() else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tracing.stop()
    events = check_trace_event_format(json.loads((tmp_path / "parent.json").read_text()))
    assert [e["name"] for e in events] == ["before-fork"]
