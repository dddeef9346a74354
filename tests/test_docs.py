"""The docs stay navigable: no user page runs past 400 lines (measurements go to
docs/benchmark-history.md), every relative link in the README and the docs reaches an
existing file and, where it names an anchor, an existing heading of that file, and the
README's "Layout of the code" names only paths that exist. Each rule's helper is also
shown to catch a synthetic violation, so a rule that silently stopped matching would fail."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
MAX_LINES = 400
EXEMPT = {"benchmark-history.md"}  # the history of dated runs is allowed to grow

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks (blank lines in their place)."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped,
    spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """The relative links of one markdown file that reach no file, or no heading in it."""
    text = path.read_text() if text is None else text
    problems = []
    for lineno, line in enumerate(_prose(text), 1):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{lineno}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{where}: no heading with that anchor in {dest.name}")
    return problems


def long_pages(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    return [
        f"{p.name}: {n} lines (at most {limit}; move measurements to "
        "docs/benchmark-history.md or split the page)"
        for p in paths
        if p.name not in EXEMPT and (n := len(p.read_text().splitlines())) > limit
    ]


def layout_paths(readme: str) -> list[str]:
    """The paths the README's "Layout of the code" names: the first word of every line of its
    code block (a folder or a file, from the repository root), and every `*.py` / `*.md`
    word after it (from that folder, or from the root when it holds a '/')."""
    section = readme.split("## Layout of the code\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    paths = []
    for line in block.splitlines():
        if not line.strip():
            continue
        first, _, rest = line.strip().partition(" ")
        paths.append(first)
        base = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/"
        for word in re.findall(r"[\w./-]+\.(?:py|md)\b", rest):
            paths.append(word if "/" in word else base + word)
    return paths


def missing_layout_paths(readme: str, root: Path = ROOT) -> list[str]:
    return [p for p in layout_paths(readme) if not (root / p).exists()]


def _user_pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


# --- the rules, on the repository --------------------------------------------------------


def test_no_user_page_over_400_lines():
    assert _user_pages(), "no docs found"
    assert long_pages(_user_pages()) == []


def test_every_relative_link_resolves():
    problems = []
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *_user_pages()]:
        problems += broken_links(path)
    assert problems == []


def test_readme_layout_names_existing_paths():
    readme = (ROOT / "README.md").read_text()
    assert len(layout_paths(readme)) > 20
    assert missing_layout_paths(readme) == []


# --- each helper catches what it is there to catch ---------------------------------------


def test_slug_matches_github():
    assert slug("DCP's arguments") == "dcps-arguments"
    assert slug("Staging once: `ss.stage`") == "staging-once-ssstage"
    assert slug("A whole checkpoint, without a template: `ss.load_all`") == (
        "a-whole-checkpoint-without-a-template-ssload_all"
    )
    assert slug("Sync: trainer -> rollout") == "sync-trainer---rollout"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_long_page_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("line\n" * (MAX_LINES + 1))
    history = tmp_path / "benchmark-history.md"
    history.write_text("line\n" * (MAX_LINES + 1))
    assert [p.split(":")[0] for p in long_pages([page, history])] == ["page.md"]
    page.write_text("line\n" * MAX_LINES)
    assert long_pages([page]) == []


def test_broken_links_are_caught():
    doc = ROOT / "docs" / "checkpoint.md"
    fake = (
        "[ok](sync.md#modes) [ok](#loading) [ok](../README.md) [web](https://x.org/#y)\n"
        "[gone](no-such-page.md) [bad anchor](sync.md#no-such-heading) [self](#nowhere)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    problems = broken_links(doc, fake)
    assert len(problems) == 3, problems
    assert "no-such-page.md: no such file" in problems[0]
    assert "sync.md#no-such-heading: no heading" in problems[1]
    assert "#nowhere: no heading" in problems[2]


def test_missing_layout_path_is_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "real.py").write_text("")
    (tmp_path / "top.py").write_text("")
    readme = (
        "## Layout of the code\n\n```\n"
        "pkg/        real.py and gone.py\n"
        "top.py      see pkg/real.py, pkg/also_gone.py\n"
        "nothing/    here\n"
        "```\n\n## Next\n"
    )
    assert missing_layout_paths(readme, tmp_path) == ["pkg/gone.py", "pkg/also_gone.py", "nothing/"]
