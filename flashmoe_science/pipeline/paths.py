"""Where the pipeline keeps its files. Every artifact the PR report draws on lands in report_dir():
the directory named by --reports-dir (the command line sets REPORTS_VAR) or REPORTS_VAR, else
reports/ of the checkout the command runs in. An installed package has no checkout of its own: it
takes the working directory's (or its nearest parent's), else ./reports, never site-packages."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .._loader import build_root  # the loader's: the checkout's build/ unless FLASHMOE_BUILD_ROOT

# The package's parent: the checkout when the package runs from one, site-packages when installed.
REPO_ROOT = Path(__file__).resolve().parents[2]
CSRC_DIR = REPO_ROOT / "csrc"
# bench.json's schema, in the checkout's benches/; a wheel carries it as flashmoe_science/benches/
_SCHEMA = Path("benches", "bench.schema.json")
_PACKAGED_SCHEMA = REPO_ROOT / "flashmoe_science" / _SCHEMA
BENCH_SCHEMA = _PACKAGED_SCHEMA if _PACKAGED_SCHEMA.is_file() else REPO_ROOT / _SCHEMA
REPORTS_VAR = "FLASHMOE_REPORTS_DIR"
# The variable's earlier name, still read (an older base commit that `bench --base` runs reads it).
OLD_REPORTS_VAR = "FLASHMOE_REPORT_DIR"
_PROJECT_NAME = re.compile(r'^name\s*=\s*"flashmoe-science"\s*$', re.MULTILINE)


def is_checkout(folder: Path) -> bool:
    """A checkout of this project: its noxfile.py, and a pyproject.toml that names flashmoe-science."""
    try:
        pyproject = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return (folder / "noxfile.py").is_file() and _PROJECT_NAME.search(pyproject) is not None


def checkout_root() -> Path | None:
    """The checkout the commands work in: the package's own when it runs from one, else (an
    installed package) the working directory or its nearest parent that is one; None outside any."""
    if is_checkout(REPO_ROOT):
        return REPO_ROOT
    here = Path.cwd()
    return next((folder for folder in (here, *here.parents) if is_checkout(folder)), None)


def named_reports_dir() -> Path | None:
    """The report folder REPORTS_VAR (or its earlier name) names, None when neither is set."""
    named = os.environ.get(REPORTS_VAR) or os.environ.get(OLD_REPORTS_VAR)
    return Path(named).expanduser() if named else None


def report_dir() -> Path:
    """The one folder a CI workflow uploads: env.json, build.json, gates.json, bench.json, report.md."""
    path = named_reports_dir() or (checkout_root() or Path.cwd()) / "reports"
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
