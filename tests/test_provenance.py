"""Which commit a record names: a checkout's own, and none for a tree git does not track, even when
that tree sits inside some repository (an installed copy in a virtual environment, an unpacked
archive under a scratch folder); such a tree is known by a fingerprint of its files. Run on
throwaway repositories and folders."""

from __future__ import annotations

from pathlib import Path

import pytest
from gitrepo import commit, git

from flashmoe_science.pipeline import provenance


def _project(root: Path) -> Path:
    (root / "flashmoe_science").mkdir(parents=True)
    (root / "flashmoe_science" / "__init__.py").write_text("VERSION = 1\n")
    return root


def _repo(root: Path) -> str:
    git(root, "init", "-q")
    return commit(root, "project")


def test_a_clean_checkout_is_its_commit_and_an_edit_makes_it_dirty(tmp_path):
    tree = _project(tmp_path / "checkout")
    sha = _repo(tree)
    assert provenance.commit(tree) == {"sha": sha, "dirty": False, "fingerprint": None}

    (tree / "flashmoe_science" / "__init__.py").write_text("VERSION = 2\n")
    first = provenance.commit(tree)
    assert first["sha"] == sha and first["dirty"] and first["fingerprint"]
    assert provenance.commit(tree) == first  # the same edit, the same fingerprint

    (tree / "new.py").write_text("x = 1\n")  # an untracked file changes the code too
    assert provenance.commit(tree)["fingerprint"] != first["fingerprint"]


@pytest.mark.parametrize("kind", ["ignored", "untracked"])
def test_a_copy_inside_another_repository_names_no_commit(tmp_path, kind):
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "README").write_text("someone else's project\n")
    if kind == "ignored":
        (outer / ".gitignore").write_text(".venv/\n")
    _repo(outer)
    copy = _project(outer / ".venv" / "lib" / "site-packages")

    block = provenance.commit(copy)

    assert block["sha"] is None and not block["dirty"] and block["fingerprint"]
    assert provenance.describe_commit(block) == f"no commit (files {block['fingerprint']})"


def test_a_tree_outside_git_is_known_by_its_files(tmp_path):
    """Records written from an unpacked archive (no git at all) still judge each other: the same
    files are the same code, an edit makes the older records stale, caches do not count."""
    from flashmoe_science.pipeline.report.inputs import stale_reason

    first, second = _project(tmp_path / "a"), _project(tmp_path / "b")
    (first / "csrc").mkdir()
    (first / "csrc" / "kernel.cuh").write_text("// v1\n")
    (second / "csrc").mkdir()
    (second / "csrc" / "kernel.cuh").write_text("// v1\n")
    written = provenance.commit(first)
    assert written == provenance.commit(second)  # same files, same code, wherever they lie
    record = {"commit": written, "run_id": "r1"}
    assert stale_reason(record, provenance.commit(first), None) is None

    (first / "flashmoe_science" / "__pycache__").mkdir()
    (first / "flashmoe_science" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert provenance.commit(first) == written

    (first / "csrc" / "kernel.cuh").write_text("// v2\n")
    now = provenance.commit(first)
    assert now["fingerprint"] != written["fingerprint"]
    reason = stale_reason(record, now, None)
    assert reason and f"files {written['fingerprint']}" in reason

    empty = tmp_path / "empty"
    empty.mkdir()
    assert provenance.commit(empty) == {"sha": None, "dirty": False, "fingerprint": None}
    assert stale_reason({"commit": provenance.commit(empty)}, provenance.commit(empty), None)


def test_a_project_tracked_in_a_larger_repository_counts_only_its_own_files(tmp_path):
    mono = tmp_path / "mono"
    tree = _project(mono / "attention")
    (mono / "other.txt").write_text("a\n")
    sha = _repo(mono)

    (mono / "other.txt").write_text("b\n")  # an edit outside the project
    (mono / "stray.txt").write_text("c\n")
    assert provenance.commit(tree) == {"sha": sha, "dirty": False, "fingerprint": None}

    (tree / "flashmoe_science" / "__init__.py").write_text("VERSION = 2\n")
    assert provenance.commit(tree)["dirty"]
