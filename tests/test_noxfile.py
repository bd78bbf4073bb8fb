"""The noxfile as a user meets it: a session exits with its command's exit code, and nox prints no
line about a uv it does not use."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from flashmoe_science.pipeline import exitcodes
from flashmoe_science.pipeline.paths import REPO_ROOT

pytest.importorskip("nox")


@pytest.fixture(scope="module")
def noxfile():
    spec = importlib.util.spec_from_file_location("noxfile_under_test", REPO_ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Session:
    """What flashmoe() uses of a nox session: log, and error (which raises, as nox's does)."""

    class Failed(Exception):
        pass

    def __init__(self):
        self.said = []

    def log(self, text):
        self.said.append(text)

    def error(self, text):
        raise self.Failed(text)


@pytest.mark.parametrize("code", [2, 125, 126, 255])
def test_a_session_exits_with_the_commands_code(noxfile, monkeypatch, code):
    monkeypatch.setattr(noxfile.subprocess, "call", lambda cmd, cwd: code)
    with pytest.raises(SystemExit) as stopped:
        noxfile.flashmoe(Session(), "report")
    assert stopped.value.code == code


def test_a_failure_is_nox_s_and_a_killed_command_gets_the_shells_code(noxfile, monkeypatch):
    monkeypatch.setattr(noxfile.subprocess, "call", lambda cmd, cwd: 1)
    with pytest.raises(Session.Failed):  # nox reports it and goes on with the other sessions
        noxfile.flashmoe(Session(), "test")
    monkeypatch.setattr(noxfile.subprocess, "call", lambda cmd, cwd: -9)
    with pytest.raises(SystemExit) as stopped:
        noxfile.flashmoe(Session(), "bench")
    assert stopped.value.code == 128 + 9
    monkeypatch.setattr(noxfile.subprocess, "call", lambda cmd, cwd: 0)
    noxfile.flashmoe(Session(), "env")


def test_nox_s_report_exits_2_on_an_unreadable_input_and_says_nothing_of_uv(tmp_path):
    """The real nox, as a user runs it (about 3 s): UV names a uv that does not exist, so nox's
    lookup fails here as on a machine without uv."""
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "gates.json").write_text("{not json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHMOE_")}
    env.update(UV=str(tmp_path / "no-uv" / "uv"), FLASHMOE_PYTHON=sys.executable)
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "report", "--", "--dir", str(reports)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == exitcodes.USAGE, output
    assert "gates.json is unreadable" in output
    assert "uv binary not found" not in output


def test_nox_s_build_builds_the_plant_unit_too_and_passes_the_users_arguments(noxfile, monkeypatch):
    """The test stage's planted-bug tests load the plant unit: the build session compiles it beside
    the library's (on 2 cores the cold test stage waited ~6 s for it otherwise)."""
    ran = []
    monkeypatch.setattr(noxfile.subprocess, "call", lambda cmd, cwd: ran.append(cmd) or 0)
    session = Session()
    session.posargs = ["--backend", "cpu"]
    noxfile.build(session)
    assert ran == [
        [noxfile.PYTHON, "-m", "flashmoe_science", "build", "--plants", "--backend", "cpu"]
    ]
