"""stages.json: each pipeline command's wall time and how it ended, and the job's total time.

The command line (flashmoe_science.pipeline.cli) wraps every stage command in `timed_stage` once,
so every stage gets a row whatever path it exits by; no command records itself. A stage is written
twice: "running" when it starts (so a stage killed by a step timeout shows as unfinished, not as
never run), then its wall time and status when it returns. With FLASHMOE_RUN_ID set (the
workflows), the first stage of a new run drops the entries of older runs.

    {"schema": "flashmoe-science/stages/2",
     "provenance": <the last writer's provenance()>,
     "job_start": <FLASHMOE_JOB_START, when set>,
     "stages": {"build": {"status": "ok", "exit_code": 0, "seconds": 189.3,
                          "started": "2026-11-26T09:30:00.250+00:00", "provenance": {...}}, ...}}

status is derived from the exit code (flashmoe_science.pipeline.exitcodes): "ok" (0), "fail" (1, a
gate or a check failed; 125, the build failed), "skip" (126, a tool is missing), "error" (2, 255 or
any other code: wrong arguments or a broken environment), "interrupted" (Ctrl-C) and "running".

The job's total is FLASHMOE_JOB_START (epoch seconds, exported by the workflow's first step) to now;
without it, the sum of this run's stages, labelled as such.

The job's critical path (critical_path) is where its time went, in the order it went: the steps
before the first stage (checkout, provisioning), each stage, the steps between and after them
(the report, the uploads). A stage that ran alongside a longer one is off the path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import exitcodes
from .paths import report_dir
from .provenance import RUN_ID_VAR, provenance

STAGES_FILE = "stages.json"
SCHEMA = "flashmoe-science/stages/2"
ORDER = ("env", "select", "build", "test", "bench", "sanitize", "profile")
JOB_START_VAR = "FLASHMOE_JOB_START"
MAX_JOB_SECONDS = 7 * 24 * 3600  # a start older than this is a leftover variable, not this job

STATUSES = ("ok", "fail", "skip", "error", "interrupted", "running")


def status_of(exit_code: int) -> str:
    """A command's exit code as a stage status."""
    if exit_code == exitcodes.OK:
        return "ok"
    if exit_code in (exitcodes.GATE_FAILED, exitcodes.BUILD_FAILED):
        return "fail"
    if exit_code == exitcodes.TOOL_MISSING:
        return "skip"
    return "error"


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def _update(folder: Path, name: str, entry: dict) -> Path:
    """Replace one stage's entry. Concurrent writers take a lock and replace the file atomically;
    a corrupt stages.json is started afresh rather than failing the caller's stage."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STAGES_FILE
    with open(folder / f".{STAGES_FILE}.lock", "w") as lock:  # hidden: not uploaded as an artifact
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            doc = json.loads(path.read_text())
            stages = doc.get("stages") if isinstance(doc, dict) else None
            if not isinstance(stages, dict):
                stages = {}
        except (OSError, ValueError):
            stages = {}
        if os.environ.get(RUN_ID_VAR):  # a new run starts afresh: drop the entries of older runs
            run = entry["provenance"].get("run_id")
            stages = {
                key: value
                for key, value in stages.items()
                if isinstance(value, dict) and (value.get("provenance") or {}).get("run_id") == run
            }
        stages[name] = entry
        doc = {"schema": SCHEMA, "provenance": entry["provenance"], "stages": stages}
        if job_start() is not None:
            doc["job_start"] = job_start()
        tmp = path.with_name(f".{STAGES_FILE}.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)
    return path


def record_stage(
    name: str,
    seconds: float | None,
    status: str,
    exit_code: int | None = None,
    directory: Path | None = None,
    started: str | None = None,
) -> Path:
    """Add or replace one stage's entry in stages.json (in `directory`, default the report folder)."""
    if status not in STATUSES:
        raise ValueError(f"stage status {status!r} is not one of {', '.join(STATUSES)}")
    entry = {
        "status": status,
        "exit_code": exit_code,
        "seconds": None if seconds is None else round(float(seconds), 3),
        "started": started or _now_iso(),
        "provenance": provenance(),
    }
    return _update(Path(directory) if directory is not None else report_dir(), name, entry)


@dataclasses.dataclass
class StageRun:
    """What the wrapped command reports back: its exit code."""

    exit_code: int | None = None


@contextlib.contextmanager
def timed_stage(name: str, directory: Path | None = None) -> Iterator[StageRun]:
    """`with timed_stage("bench") as run: run.exit_code = main(argv)` records the block's wall time
    and a status from the exit code; a SystemExit counts by its code, any other exception as an
    error, Ctrl-C as interrupted."""
    started = _now_iso()
    _record_quietly(name, None, "running", None, directory, started)
    run = StageRun()
    start = time.monotonic()
    status = "error"
    try:
        yield run
        code = run.exit_code if run.exit_code is not None else exitcodes.OK
        run.exit_code, status = code, status_of(code)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        run.exit_code, status = code, status_of(code)
        raise
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        _record_quietly(name, time.monotonic() - start, status, run.exit_code, directory, started)


def _record_quietly(name: str, *args: Any) -> None:
    """The stage's own result matters more than its timing: a report folder that cannot be
    written is said on stderr, and the stage goes on."""
    try:
        record_stage(name, *args)
    except OSError as exc:
        print(f"{name}: cannot record the stage in {STAGES_FILE} ({exc})", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value) if value >= 0 else None


def _started_at(value: Any) -> float | None:
    """An entry's "started" as epoch seconds; None when it is not an ISO time with a zone."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def normalize(doc: dict | None) -> dict[str, dict]:
    """stages.json -> {name: {"seconds", "status", "exit_code", "started_at", "provenance"}}, in
    pipeline order ("started_at": the start as epoch seconds, or None).

    Only the shape record_stage writes is read; an entry of another shape (an older stages.json)
    keeps its name with no time, status or provenance, so the report shows it as stale."""
    raw = (doc or {}).get("stages")
    if not isinstance(raw, dict):
        return {}
    stages = {}
    for name, value in raw.items():
        value = value if isinstance(value, dict) else {}
        status = value.get("status")
        exit_code = value.get("exit_code")
        stages[str(name)] = {
            "seconds": _seconds(value.get("seconds")),
            "status": status if status in STATUSES else None,
            "exit_code": exit_code if isinstance(exit_code, int) else None,
            "started_at": _started_at(value.get("started")),
            "provenance": value.get("provenance")
            if isinstance(value.get("provenance"), dict)
            else None,
        }
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(stages.items(), key=lambda item: rank.get(item[0], len(ORDER))))


def job_start(environ: dict | None = None) -> float | None:
    """FLASHMOE_JOB_START as epoch seconds, or None when unset or not a number."""
    value = (environ if environ is not None else os.environ).get(JOB_START_VAR, "").strip()
    try:
        start = float(value)
    except ValueError:
        return None
    return start if start > 0 else None


def job_seconds(start: float | None, now: float | None = None) -> float | None:
    """Seconds since the job started; None without a start, or one in the future or days ago."""
    if start is None:
        return None
    elapsed = (time.time() if now is None else now) - start
    return elapsed if 0 <= elapsed <= MAX_JOB_SECONDS else None


# --------------------------------------------------------------------------------------------------
# The critical path
# --------------------------------------------------------------------------------------------------

# GPU CI's time budget, set on the card of the h200 leg (gpukinds): the whole job and its test
# stage. The workflow's step limits leave a margin over it (tests/ci/test_workflows.py), and the report
# of a run on that card says when one went over.
BUDGET_KIND = "h200"
BUDGET_S = {"job": 8 * 60, "test": 4 * 60}

SETUP = "setup"  # the job's steps before its first stage: checkout, provisioning
BETWEEN = "other steps"  # steps between two stages
FINISH = "report and upload"  # steps after the last stage
SLACK = 1.0  # seconds: older records give their starts to the second (a stage that ends this
# little after the path got there ran alongside it)


def critical_path(
    stages: dict[str, dict], start: float | None = None, end: float | None = None
) -> list[tuple[str, float]]:
    """[(step, seconds)] in the order the job spent them: SETUP from the job's `start` to its
    first stage, each stage (the part of it that no earlier stage covered), BETWEEN for a gap
    between stages, FINISH from the last stage to the job's `end`: the steps add up to the
    job's time. A stage that ended before
    the path got there ran alongside a longer one: it is not on the path. Stages without a start
    or a wall time (an older record, a stage still running) are left out; [] when none has one."""
    timed = sorted(
        (stage["started_at"], stage["started_at"] + stage["seconds"], name)
        for name, stage in stages.items()
        if stage.get("started_at") is not None
        and stage.get("seconds") is not None
        and stage.get("status") != "running"
    )
    if not timed:
        return []
    path: list[tuple[str, float]] = []
    cursor = timed[0][0] if start is None else min(start, timed[0][0])
    for began, ended, name in timed:
        if ended <= cursor + SLACK and path:
            continue
        gap = began - cursor
        if gap > 0:
            path.append((BETWEEN if path else SETUP, gap))
        path.append((name, ended - max(began, cursor)))
        cursor = max(cursor, ended)
    if end is not None and end > cursor:
        path.append((FINISH, end - cursor))
    return path
