"""The Trace Event Format, as Perfetto's JSON importer and chrome://tracing read it."""


def check_trace_event_format(doc: dict) -> list[dict]:
    """Assert ``doc`` is a JSON-object trace as the Trace Event Format defines it (what
    Perfetto's JSON importer reads); returns its complete events."""
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list)
    named_threads = set()
    complete = []
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name"), e
            assert isinstance(e["args"]["name"], str), e
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
            continue
        assert e["ph"] == "X", e
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)), e
        assert e["dur"] >= 0, e
        assert isinstance(e.get("args", {}), dict), e
        complete.append(e)
    last: dict[tuple[int, int], float] = {}
    open_ends: dict[tuple[int, int], list[float]] = {}
    for e in complete:
        key = (e["pid"], e["tid"])
        assert key in named_threads, f"no thread_name for {key}"
        assert e["ts"] >= last.get(key, float("-inf")), f"ts goes back on thread {key}"
        last[key] = e["ts"]
        # complete events on one thread nest: each ends before the one enclosing it
        stack = open_ends.setdefault(key, [])
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        end = e["ts"] + e["dur"]
        assert not stack or end <= stack[-1] + 1e-3, f"{e} overlaps its parent on {key}"
        stack.append(end)
    return complete
