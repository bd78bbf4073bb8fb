"""A git runner for tests that build throwaway histories (bisect, bench head-against-base)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from flashmoe_science import _loader

_IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **_IDENTITY},
        check=check,
        capture_output=True,
        text=True,
    )


def commit(repo: Path, message: str) -> str:
    """Commits everything in the working tree; returns the new commit's sha."""
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.strip()


# What a working tree holds besides the project: never copied into a throwaway history.
_NOT_PROJECT = {
    ".git",
    ".venv",
    ".nox",
    ".whl",
    ".scratch",
    ".gl",
    "build",
    "reports",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
}


def project_files(root: Path) -> list[str]:
    """The files git would track in `root` (tracked plus untracked-not-ignored). A tree without .git
    (a runner's copy of the working tree, act's host workspace) is walked instead, minus the folders
    .gitignore names, so the tests that build throwaway histories run there too."""
    listed = git(root, "ls-files", "--cached", "--others", "--exclude-standard", check=False)
    if listed.returncode == 0:
        return listed.stdout.split()
    return [
        str(path.relative_to(root))
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and not _NOT_PROJECT.intersection(path.relative_to(root).parts)
        and not path.name.endswith(".egg-info")
    ]


def copy_project(root: Path, dest: Path) -> None:
    for name in project_files(root):
        src = root / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def reuse_this_build(dest: Path) -> bool:
    """Give the copy of the project at `dest` this checkout's up-to-date build of the unit (no
    defines) where their kernel sources are the same (_loader.reuse_build, what bench --base does
    for a base), so the copy's first use loads it instead of compiling the same unit again: a test
    of what happens after that build skips 20-30 s of compiling on 2 cores."""
    return _loader.reuse_build(_loader.resolve_config(), dest / "csrc", dest / "build")
