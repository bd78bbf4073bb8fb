"""`git bisect run nox -s test` on a throwaway history names the commit that broke correctness and
skips the commit that does not compile (CPU backend, so it runs in CI without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gitrepo import copy_project, git

from flashmoe_science.pipeline.paths import REPO_ROOT

pytest.importorskip("nox")

KERNEL = "csrc/attention_cpu.h"
GOOD_LINE = "const float inv = 1.f / row_sum;"
BROKEN_LINE = "const float inv = 1.f / (row_sum * 1.02f);  // 2% too small"
COMPILE_ERROR = "\nthis line is not C++;\n"
# A few CPU gate cases keep each bisect step to seconds.
SUBSET = "test_gate_cpu and fwd-fp16-d64 and sq129"


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.strip()


def edit(repo: Path, path: str, old: str, new: str) -> None:
    file = repo / path
    text = file.read_text()
    assert old in text, f"{path} no longer contains {old!r}: update this test's planted edits"
    file.write_text(text.replace(old, new, 1))


@pytest.mark.slow
def test_git_bisect_run_names_the_breaking_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_project(REPO_ROOT, repo)
    git(repo, "init", "-q", "-b", "main")
    good = commit(repo, "good: the project as it is")
    (repo / "NOTES.txt").write_text("1\n")
    commit(repo, "docs")
    edit(repo, KERNEL, GOOD_LINE, BROKEN_LINE)
    breaking = commit(repo, "cpu: normalise the output (breaks it by 2%)")
    with (repo / KERNEL).open("a") as f:
        f.write(COMPILE_ERROR)
    no_build = commit(repo, "does not compile")
    edit(repo, KERNEL, COMPILE_ERROR, "\n")
    commit(repo, "compiles again, still broken")
    (repo / "NOTES.txt").write_text("2\n")
    commit(repo, "docs")
    (repo / "NOTES.txt").write_text("3\n")
    bad = commit(repo, "docs")

    # Six commits after the good one: git tests the middle one (the one that does not compile) first.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLASHMOE_", "PYTEST_XDIST", "TORCH_CUDA_ARCH"))
    }
    env["CUDA_VISIBLE_DEVICES"] = ""  # the nested runs build and gate the CPU unit
    git(repo, "bisect", "start", bad, good)
    run = subprocess.run(
        [
            "git",
            "bisect",
            "run",
            sys.executable,
            "-m",
            "nox",
            "-s",
            "test",
            "--",
            "-k",
            SUBSET,
            "--workers",
            "1",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = git(repo, "bisect", "log").stdout
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert f"{breaking} is the first bad commit" in output, output[-4000:]
    assert f"git bisect skip {no_build}" in log, log
    assert "does not build (exit 125" in output
