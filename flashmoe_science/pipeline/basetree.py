"""The base side of a head-against-base comparison: its commit, its worktree, its build.

`bench --base REF` (bench/headbase.py) times REF's tree beside the head; `build --base REF`
(build/unit.py) starts REF's build ahead, during the GPU job's build step. Both take the tree, the
build root, the report dir, the environment and the command from here, so the bench finds the
build the build step made. REF is checked out as a detached git worktree in
<build root>/worktrees/<sha12> and built into <sha12>.build beside it (paths.base_dirs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import _loader
from . import paths, provenance

# Where a tree keeps its bench command: this layout first, then the one before the pipeline moved.
BENCH_MODULE_PATHS = ("flashmoe_science/pipeline/bench/run.py", "flashmoe_science/bench.py")


class BaseUnavailable(Exception):
    """The base cannot be timed side by side; the message says why (it goes into bench.json)."""


def _git(*args: str, cwd: Path = paths.REPO_ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(
            f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout.strip()


def resolve_ref(ref: str) -> str:
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except RuntimeError:
        return ""


def commit_has_bench(sha: str) -> bool:
    for path in BENCH_MODULE_PATHS:
        done = subprocess.run(
            ["git", "cat-file", "-e", f"{sha}:{path}"], cwd=paths.REPO_ROOT, capture_output=True
        )
        if done.returncode == 0:
            return True
    return False


def tree_has_bench(tree: Path) -> bool:
    return any((tree / path).is_file() for path in BENCH_MODULE_PATHS)


def prepare_worktree(sha: str) -> Path:
    """A detached worktree of sha under <build root>/worktrees, reused (with its build) if clean."""
    tree = paths.build_root().resolve() / "worktrees" / sha[:12]
    if (tree / ".git").exists():
        commit = provenance.commit(tree)
        if commit["sha"] == sha and not commit["dirty"]:
            return tree
    with contextlib.suppress(RuntimeError):
        _git("worktree", "remove", "--force", str(tree))
    shutil.rmtree(tree, ignore_errors=True)
    tree.parent.mkdir(parents=True, exist_ok=True)
    try:
        _git("worktree", "prune")
        _git("worktree", "add", "--detach", "--force", str(tree), sha)
    except RuntimeError as exc:
        raise BaseUnavailable(f"cannot create a worktree of {sha[:12]}: {exc}") from exc
    return tree


def side_env(
    tree: Path, build_root: Path | None, report_dir: Path | None, defines: str | None = None
) -> dict:
    """The environment a side's build and worker run in: its own tree first on the path, and for the
    base its own build root and report dir, so neither its library nor its build.json touch ours;
    `defines` (comma-separated) replaces FLASHMOE_BUILD_DEFINES for that side when given."""
    env = dict(os.environ)
    if defines is not None:
        env[_loader.DEFINES_VAR] = defines
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("PYTEST_XDIST_WORKER", None)
    if build_root is not None:
        env["FLASHMOE_BUILD_ROOT"] = str(build_root)
    if report_dir is not None:  # both names: a base older than the current name reads the earlier
        env[paths.REPORTS_VAR] = env[paths.OLD_REPORTS_VAR] = str(report_dir)
    return env


def start_base_build(tree: Path, env: dict, log_path: Path) -> subprocess.Popen:
    """The base's `python -m flashmoe_science build`, run in its tree with its environment (the
    command every version of the package has had), output to `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "flashmoe_science", "build"],
            cwd=tree,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def base_build_failed(code: int, log_path: Path) -> BaseUnavailable:
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    tail = " | ".join(lines[-3:])[:400]
    return BaseUnavailable(f"the base does not build (exit {code}): {tail}; log: {log_path}")


@dataclasses.dataclass
class Prebuild:
    """The base's build started ahead of the bench (start_prebuild)."""

    sha: str
    process: subprocess.Popen
    log: Path
    reports: Path  # its report dir: the build.json the bench's base side writes too


def start_prebuild(ref: str, head: _loader.BuildConfig, say=print) -> Prebuild | None:
    """`build --base REF`: REF's worktree and build started exactly as `bench --base REF` makes
    them (the same tree, build root, environment and command), so that the bench finds the base
    built. None, with the reason said, where there is nothing to build ahead: REF unknown or
    without a bench command (the bench says so again), or kernel sources that hash as the head's
    (the bench reuses the head's build)."""
    sha = resolve_ref(ref)
    if not sha:
        say(f"build: --base {ref}: no such commit here, nothing built for the bench's comparison")
        return None
    if not commit_has_bench(sha):
        say(f"build: --base {ref}: {sha[:12]} has no bench command, nothing built for it")
        return None
    try:
        tree = prepare_worktree(sha)
    except BaseUnavailable as exc:
        say(f"build: --base {ref}: {exc}")
        return None
    theirs = dataclasses.replace(head, sources_dir=tree / "csrc")
    if theirs.source.exists() and _loader.source_hash(theirs) == _loader.source_hash(head):
        say(f"build: --base {ref}: its kernel sources are these; the bench reuses this build")
        return None
    build_root, reports = paths.base_dirs(tree, sha)
    reports.mkdir(parents=True, exist_ok=True)
    log = reports.parent / f"{build_root.name}.log"
    say(f"build: the base {sha[:12]} ({ref}) builds beside, for the bench (log {log})")
    process = start_base_build(tree, side_env(tree, build_root, reports), log)
    return Prebuild(sha, process, log, reports)
