"""Where the pipeline keeps its files. Every artifact the PR report draws on lands in REPORT_DIR."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .._loader import build_root  # the loader's: the checkout's build/ unless FLASHMOE_BUILD_ROOT

REPO_ROOT = Path(__file__).resolve().parents[2]
CSRC_DIR = REPO_ROOT / "csrc"


def report_dir() -> Path:
    """The one folder a CI workflow uploads: env.json, build.json, gates.json, bench.json, report.md."""
    path = Path(os.environ.get("FLASHMOE_REPORT_DIR", REPO_ROOT / "reports"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_gpu_from_env() -> bool:
    """FLASHMOE_REQUIRE_GPU=1 (set by GPU runners) makes env, build and test demand the CUDA path,
    so one variable serves `nox -s env build test bench report` without per-session options."""
    return os.environ.get("FLASHMOE_REQUIRE_GPU", "") == "1"


def base_dirs(tree: Path, sha: str | None) -> tuple[Path, Path]:
    """(build root, report dir) of a base commit that `bench --base` builds beside the worktree:
    <build root>/worktrees/<sha12>.build and <sha12>.reports (dir-<hash> for a tree without a sha)."""
    path_hash = hashlib.sha256(str(tree.resolve()).encode()).hexdigest()[:8]
    label = sha[:12] if sha else f"dir-{path_hash}"
    root = build_root().resolve() / "worktrees"
    return root / f"{label}.build", root / f"{label}.reports"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m flashmoe_science.pipeline.paths base-report SHA`: where the base's build.json is,
    so a workflow asks instead of spelling the layout (which FLASHMOE_BUILD_ROOT moves)."""
    parser = argparse.ArgumentParser(prog="python -m flashmoe_science.pipeline.paths")
    sub = parser.add_subparsers(dest="query", required=True)
    base = sub.add_parser(
        "base-report", help="the build.json of a base commit built by bench --base"
    )
    base.add_argument("sha", help="the base commit's full sha (as `git rev-parse` prints it)")
    args = parser.parse_args(argv)
    print(base_dirs(REPO_ROOT, args.sha)[1] / "build.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
