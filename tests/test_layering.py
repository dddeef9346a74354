"""The package's import graph: no module imports itself back through others, core/ sits
below checkpoint/, sync/ and fsdp/ (it imports none of them), sync/ and fsdp/ never import
checkpoint/, and checkpoint/ never imports sync/. Inside checkpoint/, the folders keep their
roles: format/ stands below the save and the load, load/ never imports save/, and storage/
imports nothing of checkpoint/ but format/. Inside sync/, layout/ stands below everything,
transport/ imports no round, round/ no side, and rollout/ nothing of trainer/; no folder
imports the public entry points above it but the sync group."""

import ast
from pathlib import Path

import slipstream

ROOT = Path(slipstream.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ["slipstream", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the slipstream modules it imports (type-checking imports included)."""
    graph = {}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{name}.{alias.name}"
                    deps.add(sub if sub in mods else name)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        # a package's own __init__ runs before its modules: importing it is not a cycle
        graph[mod] = {d for d in deps if d in mods and d != mod and not mod.startswith(d + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[mod] = 2
        path.pop()
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)):
            return found
    return None


def test_no_module_imports_itself_back():
    cycle = _cycle(_imports(_modules()))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_core_imports_nothing_above_it():
    graph = _imports(_modules())
    above = ("slipstream.checkpoint", "slipstream.sync", "slipstream.fsdp")
    bad = {
        mod: sorted(d for d in deps if d.startswith(above))
        for mod, deps in graph.items()
        if mod.startswith("slipstream.core")
    }
    assert not any(bad.values()), bad


def _importers(graph: dict[str, set[str]], below: tuple[str, ...], above: tuple[str, ...]):
    """Modules under ``below`` that import a module under ``above``, with what they import."""
    bad = {
        mod: sorted(d for d in deps if d.startswith(above))
        for mod, deps in graph.items()
        if mod.startswith(below)
    }
    return {mod: deps for mod, deps in bad.items() if deps}


def test_sync_and_fsdp_never_import_checkpoint():
    graph = _imports(_modules())
    bad = _importers(graph, ("slipstream.sync", "slipstream.fsdp"), ("slipstream.checkpoint",))
    assert not bad, bad


def test_checkpoint_never_imports_sync():
    graph = _imports(_modules())
    assert not _importers(graph, ("slipstream.checkpoint",), ("slipstream.sync",))


def test_the_layering_check_sees_an_import():
    graph = {"slipstream.sync.x": {"slipstream.checkpoint.snapshot"}}
    found = _importers(graph, ("slipstream.sync",), ("slipstream.checkpoint",))
    assert found == {"slipstream.sync.x": ["slipstream.checkpoint.snapshot"]}


CHECKPOINT = "slipstream.checkpoint"
CHECKPOINT_RULES = {
    # folder: the checkpoint/ folders (besides itself) it may import
    "format": (),
    "load": ("format", "storage"),
    "storage": ("format",),
}


def _folder_violations(
    graph: dict[str, set[str]],
    package: str,
    rules: dict[str, tuple[str, ...]],
    shared: tuple[str, ...] = (),
) -> dict[str, list[str]]:
    """Module -> the modules of ``package`` it imports against ``rules`` (folder -> the other
    folders it may import); every folder may import the ``shared`` modules of ``package``."""
    bad = {}
    for folder, allowed in rules.items():
        inside = f"{package}.{folder}"
        ok = tuple(f"{package}.{a}" for a in (folder, *allowed, *shared))
        for mod, deps in graph.items():
            if mod != inside and not mod.startswith(inside + "."):
                continue
            found = sorted(
                d
                for d in deps
                if d.startswith(package + ".")
                and not any(d == o or d.startswith(o + ".") for o in ok)
            )
            if found:
                bad[mod] = found
    return bad


def _checkpoint_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module -> the checkpoint/ modules it imports against :data:`CHECKPOINT_RULES`."""
    return _folder_violations(graph, CHECKPOINT, CHECKPOINT_RULES)


def test_checkpoint_folders_keep_their_roles():
    bad = _checkpoint_violations(_imports(_modules()))
    assert not bad, f"imports across checkpoint/'s folder rules {CHECKPOINT_RULES}: {bad}"


def test_the_checkpoint_rules_see_a_violation():
    graph = {
        f"{CHECKPOINT}.load.loader": {f"{CHECKPOINT}.save.layout", f"{CHECKPOINT}.format.names"},
        f"{CHECKPOINT}.format.index": {f"{CHECKPOINT}.load.reader"},
        f"{CHECKPOINT}.storage.local": {f"{CHECKPOINT}.format.names", f"{CHECKPOINT}.api"},
        f"{CHECKPOINT}.save.saver": {f"{CHECKPOINT}.load.loader"},
    }
    found = _checkpoint_violations(graph)
    assert found == {
        f"{CHECKPOINT}.load.loader": [f"{CHECKPOINT}.save.layout"],
        f"{CHECKPOINT}.format.index": [f"{CHECKPOINT}.load.reader"],
        f"{CHECKPOINT}.storage.local": [f"{CHECKPOINT}.api"],
    }, f"the rules missed or invented a violation: {found}"


SYNC = "slipstream.sync"
SYNC_RULES = {
    # folder: the sync/ folders (besides itself) it may import
    "layout": (),
    "transport": ("layout",),
    "round": ("transport", "layout"),
    "trainer": ("round", "transport", "layout"),
    "rollout": ("layout",),
}
#: The one entry-point module every sync/ folder may import: the group they all run on.
SYNC_SHARED = ("group",)


def _sync_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module -> the sync/ modules it imports against :data:`SYNC_RULES`."""
    return _folder_violations(graph, SYNC, SYNC_RULES, SYNC_SHARED)


def test_sync_folders_keep_their_roles():
    graph = _imports(_modules())
    assert all(f"{SYNC}.{folder}" in _modules() for folder in SYNC_RULES)
    bad = _sync_violations(graph)
    assert not bad, f"imports across sync/'s folder rules {SYNC_RULES}: {bad}"


def test_the_sync_rules_see_a_violation():
    graph = {
        f"{SYNC}.layout.described": {f"{SYNC}.round.negotiation", f"{SYNC}.layout.plan"},
        f"{SYNC}.transport.ipc": {f"{SYNC}.round.protocol", f"{SYNC}.group"},
        f"{SYNC}.round.culprits": {f"{SYNC}.publisher", f"{SYNC}.round.protocol"},
        f"{SYNC}.rollout.apply": {f"{SYNC}.trainer.packing", f"{SYNC}.layout.plan"},
        f"{SYNC}.trainer.sending": {f"{SYNC}.transport.network", f"{SYNC}.rollout.sinks"},
        f"{SYNC}.publisher": {f"{SYNC}.trainer.sending", f"{SYNC}.rollout.sinks"},
    }
    found = _sync_violations(graph)
    assert found == {
        f"{SYNC}.layout.described": [f"{SYNC}.round.negotiation"],
        f"{SYNC}.transport.ipc": [f"{SYNC}.round.protocol"],
        f"{SYNC}.round.culprits": [f"{SYNC}.publisher"],
        f"{SYNC}.rollout.apply": [f"{SYNC}.trainer.packing"],
        f"{SYNC}.trainer.sending": [f"{SYNC}.rollout.sinks"],
    }, f"the rules missed or invented a violation: {found}"
