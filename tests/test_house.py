"""The repository's pages stay readable: README.md is a user's page of at most README_MAX_LINES
lines, no markdown table cell in README.md or docs/ runs past CELL_MAX_CHARS characters (details go
to docs/ as prose), every file benches/NOTES.md's index names exists (and every notes file is
indexed), and the relative links of these pages lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
CELL_MAX_CHARS = 300
NOTES_INDEX = ROOT / "benches" / "NOTES.md"
NOTES_DIR = ROOT / "benches" / "notes"
# A markdown link's target: [text](target), not images' or URLs' schemes.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def table_cells(text: str) -> list[tuple[int, str]]:
    """(line number, cell) of every cell of every markdown table outside code fences."""
    cells, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            continue
        if fenced or not stripped.startswith("|"):
            continue
        row = re.split(r"(?<!\\)\|", stripped.strip("|"))
        cells += [(number, cell.strip()) for cell in row]
    return cells


def long_cells(text: str, limit: int = CELL_MAX_CHARS) -> list[str]:
    return [f"line {n}: {len(c)} characters" for n, c in table_cells(text) if len(c) > limit]


def indexed_notes(text: str) -> list[str]:
    """The notes files benches/NOTES.md's index links to (targets under notes/)."""
    return [t for t in LINK.findall(text) if t.startswith("notes/")]


def broken_links(page: Path) -> list[str]:
    """Relative link targets of `page` (anchors and URLs left out) that name no file."""
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path):
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def test_the_checks_catch_what_they_are_for():
    long_row = "| `x` | " + "y" * (CELL_MAX_CHARS + 1) + " |"
    assert long_cells(f"| a | b |\n|---|---|\n{long_row}\n") == [
        f"line 3: {CELL_MAX_CHARS + 1} characters"
    ]
    assert long_cells(f"| a | b |\n|---|---|\n| `x` | {'y' * CELL_MAX_CHARS} |\n") == []
    assert long_cells(f"```\n{long_row}\n```\n") == []  # a code block is not a table
    assert [c for _, c in table_cells(r"| a \| b | c |")] == [r"a \| b", "c"]
    assert indexed_notes("- [notes/x.md](notes/x.md): x\n- [docs](../docs/api.md)") == [
        "notes/x.md"
    ]


def test_readme_is_a_users_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move details to docs/ "
        "and link them"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_table_cell_is_an_essay(page):
    long = long_cells(page.read_text())
    assert not long, (
        f"{page.relative_to(ROOT)}: table cells over {CELL_MAX_CHARS} characters ({', '.join(long)}): "
        "keep a short cell and move the detail to prose in docs/"
    )


def test_the_notes_index_names_files_that_exist_and_every_file_is_indexed():
    named = indexed_notes(NOTES_INDEX.read_text())
    assert named, "benches/NOTES.md has no index of benches/notes/*.md"
    missing = [n for n in named if not (NOTES_INDEX.parent / n).is_file()]
    assert not missing, f"benches/NOTES.md's index names files that do not exist: {missing}"
    unindexed = sorted(
        f"notes/{p.name}" for p in NOTES_DIR.glob("*.md") if f"notes/{p.name}" not in named
    )
    assert not unindexed, f"benches/notes/ files missing from benches/NOTES.md's index: {unindexed}"


@pytest.mark.parametrize(
    "page",
    [*pages(), NOTES_INDEX, *sorted(NOTES_DIR.glob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_lead_somewhere(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"


# Where a named path is run or read, not only described: a path that moved breaks these.
EXECUTED = (".ci/run", "noxfile.py", "pyproject.toml", "MANIFEST.in")
EXECUTED_DIRS = ("scripts", ".github")
# A path of the repository: its top folder, then the rest.
REPO_PATH = re.compile(
    r"(?<![\w.-])((?:flashmoe_science|tests|scripts|csrc|docs|benches|requirements|\.github|\.ci)"
    r"/[A-Za-z0-9_./-]*[A-Za-z0-9_])"
)
# Placeholders (requirements/NAME.txt, actions/OWNER/REPO) and what only the wheel lays out
# (the package-dir mapping of csrc/ and benches/ into flashmoe_science/).
NOT_IN_THE_TREE = re.compile(r"\b(NAME|OWNER|REPO|KIND)\b|^flashmoe_science/(csrc|benches)\b")


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    named = set()
    for match in REPO_PATH.finditer(text):
        token = re.split(r"[\s'\"(]", text[: match.start()])[-1]
        if "://" not in token:  # a URL's path is another site's
            named.add(match.group(1).rstrip("."))
    return sorted(p for p in named if not NOT_IN_THE_TREE.search(p) and not (root / p).exists())


def executed_files() -> list[Path]:
    files = [ROOT / name for name in EXECUTED]
    for folder in EXECUTED_DIRS:
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file()]
    return files


@pytest.mark.parametrize("path", executed_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_script_or_workflow_names_exists(path):
    """A module or script that moved leaves no runner script, workflow or session pointing at
    its old place (register.sh's preflight once tested a path the move had emptied)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        pytest.skip("not text")
    assert missing_paths(text) == []


def test_a_moved_path_is_caught():
    text = 'test -f "$root/flashmoe_science/pipeline/runner_requirements.py" || die'
    assert missing_paths(text) == ["flashmoe_science/pipeline/runner_requirements.py"]
    assert missing_paths("requirements/NAME.txt flashmoe_science/csrc/attention_ops.h") == []


def test_every_test_folder_is_collected(pytestconfig):
    """pytest skips folders matching norecursedirs, whose default holds "build": with it,
    tests/build/ (the build stage's tests) silently ran in no stage."""
    from _pytest.pathlib import fnmatch_ex

    skipped = pytestconfig.getini("norecursedirs")
    folders = {p.parent.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")}
    hidden = sorted(
        str(folder)
        for folder in folders
        if any(fnmatch_ex(pattern, part) for pattern in skipped for part in folder.parts)
    )
    assert not hidden, f"never collected (norecursedirs {skipped}): {hidden}"
