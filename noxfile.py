#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.2.9"]
# ///
# The two headers above serve `./noxfile.py`, which uv runs with nox installed from the block;
# `nox` and `python -m nox` read neither and need no uv.
"""Orchestration only: each session runs `python -m flashmoe_science COMMAND`, where the logic lives.

Sessions run in the interpreter that already holds torch (the one running nox, or FLASHMOE_PYTHON):
no per-session virtual environments, so `nox -s env build test` works offline on a GPU box whose
torch was provisioned once. Typical use:

    nox -s build test bench          # locally
    nox -s env build test -- --require-gpu   (GPU runners pass --require-gpu to env and test)
    git bisect run nox -s test -- --gates -k '<gate id>'   # 0 good, 1 bad, 125 skip, 255 stop

A session exits with its command's code (2 for a report input that is stale or unreadable, 125,
255, ...); nox itself would reduce every failure to 1.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "none"
nox.options.sessions = ["env", "build", "test"]
# No session makes a virtual environment, yet nox looks for uv before each one and logs "uv binary
# not found." where there is none; no nox option skips the lookup, so its line is dropped.
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")

HERE = Path(__file__).parent
PYTHON = os.environ.get("FLASHMOE_PYTHON", sys.executable)


def flashmoe(session: nox.Session, *args: str) -> None:
    cmd = [PYTHON, "-m", "flashmoe_science", *args]
    session.log(" ".join(cmd))
    rc = subprocess.call(cmd, cwd=HERE)
    if rc < 0:  # killed by a signal: the shell's code for it
        rc = 128 - rc
    if rc == 1:  # a failure nox reports as its own: the other sessions still run
        session.error(f"`{' '.join(cmd[1:])}` exited with 1")
    if rc:  # any other code reaches the caller (`git bisect run`, CI) unchanged
        session.log(f"`{' '.join(cmd[1:])}` exited with {rc}: nox exits with it")
        raise SystemExit(rc)


@nox.session
def env(session: nox.Session) -> None:
    """Validate Python, torch, CUDA, nvcc, GPU, driver, ninja, compiler, disk and NumPy."""
    flashmoe(session, "env", *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Build the extension as one compilation unit (CUDA when a GPU or TORCH_CUDA_ARCH_LIST is there),
    and beside it the plant unit the planted-bug tests load, so that `nox -s test` compiles nothing."""
    flashmoe(session, "build", "--plants", *session.posargs)


@nox.session
def test(session: nox.Session) -> None:
    """Build incrementally, then run the tests; exit 0 only when gates ran and passed.

    `-- --gates -k ID` runs gates alone (a bisect step), `-- --list` prints the gate ids, `-- --help`
    the rest; other posargs go to pytest."""
    flashmoe(session, "test", *session.posargs)


@nox.session(default=False)
def select(session: nox.Session) -> None:
    """GPU CI: the full matrix, or main's recorded verdict when no gate input changed."""
    flashmoe(session, "select", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Regression benchmarks against PyTorch SDPA (and `-- --base REF`: head against base, interleaved)."""
    flashmoe(session, "bench", *session.posargs)


@nox.session(default=False)
def report(session: nox.Session) -> None:
    """One markdown report (reports/report.md) from the env, build, gate and benchmark JSON."""
    flashmoe(session, "report", *session.posargs)


@nox.session(default=False)
def compile(session: nox.Session) -> None:
    """CUDA compile-and-link check for the L4 (sm_89) and H100/H200 (sm_90a); needs nvcc, not a GPU.
    Fails where ptxas serialized a wgmma pipeline (a kernel correct but several times slower)."""
    flashmoe(
        session, "build", "--backend", "cuda", "--arch", "8.9;9.0a", "--strict", *session.posargs
    )


@nox.session(default=False)
def sanitize(session: nox.Session) -> None:
    """compute-sanitizer memcheck/initcheck/synccheck/racecheck over every kernel path (GPU)."""
    flashmoe(session, "sanitize", *session.posargs)


@nox.session(default=False)
def profile(session: nox.Session) -> None:
    """Nsight Compute on one bench case (`nox -s profile -- CASE`): metrics and what bounds it."""
    flashmoe(session, "profile", *session.posargs)


@nox.session(default=False)
def phases(session: nox.Session) -> None:
    """The sm_90a forward's phases per tile, or the decode's per block, on one bench case
    (`nox -s phases -- CASE [--block-size N]`; GPU)."""
    flashmoe(session, "phases", *session.posargs)


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """pre-commit on all files (ruff, clang-format, shellcheck, YAML and workflow checks)."""
    session.run(
        PYTHON, "-m", "pre_commit", "run", "--all-files", "--show-diff-on-failure", *session.posargs
    )


if __name__ == "__main__":
    nox.main()
