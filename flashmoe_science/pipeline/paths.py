"""Where the pipeline keeps its files. Every artifact the PR report draws on lands in REPORT_DIR."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CSRC_DIR = REPO_ROOT / "csrc"


def build_root() -> Path:
    """Root of the (git-ignored) build directories; one subdirectory per torch/CUDA/arch key."""
    return Path(os.environ.get("FLASHMOE_BUILD_ROOT", REPO_ROOT / "build"))


def report_dir() -> Path:
    """The one folder a CI workflow uploads: env.json, build.json, gates.json, bench.json, report.md."""
    path = Path(os.environ.get("FLASHMOE_REPORT_DIR", REPO_ROOT / "reports"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_gpu_from_env() -> bool:
    """FLASHMOE_REQUIRE_GPU=1 (set by GPU runners) makes env, build and test demand the CUDA path,
    so one variable serves `nox -s env build test bench report` without per-session options."""
    return os.environ.get("FLASHMOE_REQUIRE_GPU", "") == "1"
