"""The command line as a shell user meets it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flashmoe_science.pipeline.paths import REPO_ROOT


@pytest.mark.parametrize("command", [["--help"], ["bench", "--list", "--backend", "cpu"]])
def test_a_reader_that_leaves_early_gets_no_traceback(command):
    """`flashmoe-science ... | head -1`: the reader closes the pipe before all is written (here
    before anything is: `true` reads nothing and exits while Python starts)."""
    done = subprocess.run(
        f"{sys.executable} -m flashmoe_science {' '.join(command)} | true",
        shell=True,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
