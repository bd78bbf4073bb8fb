"""The README's bisect recipe, `git bisect run nox -s test -- --gates -k '<ids>'`, on a throwaway
history names the commit that broke correctness, skips the commit that does not compile, and leaves
the last step's gates.json, marked with that step's commit (CPU backend, so it runs in CI without a
GPU). One step over a few gate cases is timed: it runs in one process, without worker start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gitrepo import commit, copy_project, git, reuse_this_build

from flashmoe_science.pipeline.paths import REPO_ROOT

pytest.importorskip("nox")

KERNEL = "csrc/attention_cpu.h"
GOOD_LINE = "const float inv = 1.f / row_sum;"
BROKEN_LINE = "const float inv = 1.f / (row_sum * 1.02f);  // 2% too small"
COMPILE_ERROR = "\nthis line is not C++;\n"
# A few CPU gate cases keep each bisect step to seconds; their ids come from `--list`.
CASES = 3
STEP_BUDGET_S = 60  # generous for a loaded 2-core machine; a step took 5-6 s there, idle


def edit(repo: Path, path: str, old: str, new: str) -> None:
    file = repo / path
    text = file.read_text()
    assert old in text, f"{path} no longer contains {old!r}: update this test's planted edits"
    file.write_text(text.replace(old, new, 1))


@pytest.mark.slow
@pytest.mark.long
def test_git_bisect_run_names_the_breaking_commit(tmp_path):
    """Long (80-100 s on 2 cores: a copied project, nox, and a CPU rebuild per bisect step), so it
    runs in the scheduled run (`--long`); the exit-code contract of a single step, which the recipe
    rests on, is tested on every pull request (tests/gates/test_testing.py)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_project(REPO_ROOT, repo)
    reuse_this_build(repo)  # the good commit's sources are this checkout's
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

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLASHMOE_", "PYTEST_", "TORCH_CUDA_ARCH")) and k != "PYTHONPATH"
    }
    env["CUDA_VISIBLE_DEVICES"] = ""  # the nested runs build and gate the CPU unit
    # Tools found through PYTHONPATH (nox on a machine that carries it that way) stay; this
    # checkout's package does not: each bisect step imports its own commit's.
    kept = [
        entry
        for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if entry and not Path(entry).resolve().is_relative_to(REPO_ROOT)
    ]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    nox_test = [sys.executable, "-m", "nox", "-s", "test", "--"]

    def run(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
        )

    # The recipe: pick gate ids with --list, then time one step on the good commit (built once).
    listed = run(*nox_test, "--list")
    ids = [i for i in listed.stdout.split() if i.endswith("-cpu")][:CASES]
    assert len(ids) == CASES, listed.stdout + listed.stderr
    selection = " or ".join(ids)
    git(repo, "checkout", "-q", good)
    assert run(*nox_test, "--gates", "-k", selection).returncode == 0
    started = time.monotonic()
    step = run(*nox_test, "--gates", "-k", selection)
    step_s = time.monotonic() - started
    print(f"one bisect step over {CASES} gate cases, build up to date: {step_s:.1f} s")
    assert step.returncode == 0, step.stdout + step.stderr
    assert " -n 0 " in step.stdout and f"all gates passed ({CASES} of {CASES})" in step.stdout
    assert step_s < STEP_BUDGET_S, step.stdout
    git(repo, "checkout", "-q", "main")

    # Six commits after the good one: git tests the middle one (the one that does not compile) first.
    git(repo, "bisect", "start", bad, good)
    bisect = run("git", "bisect", "run", *nox_test, "--gates", "-k", selection)
    log = git(repo, "bisect", "log").stdout
    output = bisect.stdout + bisect.stderr
    assert bisect.returncode == 0, output[-4000:]
    assert f"{breaking} is the first bad commit" in output, output[-4000:]
    assert f"git bisect skip {no_build}" in log, log
    assert "does not build (exit 125" in output

    # reports/ holds the last step's gates.json, marked with that step's commit, after the reset too.
    steps = ("git bisect good ", "git bisect bad ", "git bisect skip ")
    last_step = [ln.split()[-1] for ln in log.splitlines() if ln.startswith(steps)][-1]
    git(repo, "bisect", "reset")
    gates = json.loads((repo / "reports" / "gates.json").read_text())
    assert gates["provenance"]["commit"]["sha"] == last_step != bad
