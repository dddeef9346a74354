"""The package's import graph: no module imports itself back through others, core/ sits
below checkpoint/, sync/ and fsdp/ (it imports none of them), sync/ and fsdp/ never import
checkpoint/, and checkpoint/ never imports sync/. Inside checkpoint/, the folders keep their
roles: format/ stands below the save and the load, load/ never imports save/, and storage/
imports nothing of checkpoint/ but format/."""

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


def _checkpoint_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module -> the checkpoint/ modules it imports against :data:`CHECKPOINT_RULES`."""
    bad = {}
    for folder, allowed in CHECKPOINT_RULES.items():
        inside = f"{CHECKPOINT}.{folder}"
        ok = tuple(f"{CHECKPOINT}.{a}" for a in (folder, *allowed))
        for mod, deps in graph.items():
            if mod != inside and not mod.startswith(inside + "."):
                continue
            found = sorted(
                d
                for d in deps
                if d.startswith(CHECKPOINT + ".")
                and not any(d == o or d.startswith(o + ".") for o in ok)
            )
            if found:
                bad[mod] = found
    return bad


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
