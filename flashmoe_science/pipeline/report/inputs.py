"""What the report reads: the stage records in the report folder, checked for readability, size,
nesting and schema (report.schemas; bench.json against benches/bench.schema.json), and for
provenance (whether each record describes this checkout, or the commit the caller names, and this
run). Nothing is read from outside the folder: build.json's `log` is a name, never a path to follow."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .. import markdown as md
from .. import provenance, stages
from ..paths import BENCH_SCHEMA
from . import schemas

BUILD_LOG_TAIL_LINES = 60
BUILD_LOG = "build.log"
MAX_RECORD_BYTES = 64 * 2**20  # a record larger than this is not parsed (the real ones are < 1 MiB)
MAX_LOG_BYTES = 2**20  # of build.log, only the end is read
RECORDS = ("env.json", "build.json", "gates.json", "bench.json", "sanitize.json", "selection.json")


@dataclasses.dataclass
class Inputs:
    env: dict | None = None
    build: dict | None = None
    build_log: str | None = None
    gates: dict | None = None
    bench: dict | None = None
    sanitize: dict | None = None
    selection: dict | None = (
        None  # GPU CI's choice: the full matrix or main's verdict (ci.selection)
    )
    stages: dict[str, dict] = dataclasses.field(default_factory=dict)
    base_build: dict | None = None
    base_build_path: str | None = None
    unreadable: dict[str, str] = dataclasses.field(default_factory=dict)  # file -> why
    stale: dict[str, str] = dataclasses.field(default_factory=dict)  # record file -> why
    stale_stages: dict[str, str] = dataclasses.field(default_factory=dict)  # stage -> why
    notes: list[str] = dataclasses.field(default_factory=list)  # caveats about the inputs
    commit: dict | None = None  # the checkout the report describes
    run_id: str | None = None  # FLASHMOE_RUN_ID, when set
    job_seconds: float | None = None  # since FLASHMOE_JOB_START, when set
    job_start: float | None = None  # FLASHMOE_JOB_START, or the one stages.json recorded
    run_url: str | None = None
    # Set by the privileged job that re-renders a pull request's report from its artifact: the
    # commit it verified the run tested, and the files the pull request changes.
    tested_sha: str | None = None
    changed_paths: list[str] | None = None
    head_sha: str | None = None  # the PR's head now, when it has moved on since the run
    history: list[dict] | None = None  # main's stored benchmark records (pipeline.bench.trend)
    gpu_kind: str | None = None  # the GPU CI leg the records come from (pipeline.gpukinds)
    artifact: str = "reports/"  # the artifact that holds the records, for the footer


def _read_json(
    path: Path,
    label: str,
    unreadable: dict[str, str],
    notes: list[str] | None = None,
    kind: str | None = None,
) -> dict | None:
    """The JSON object at `path`, or None (missing, or unreadable: then `unreadable[label]` says
    why). `kind` names the schema when the label is not the file's usual name."""
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        unreadable[label] = "not a regular file (a link or a folder): not read"
        return None
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            unreadable[label] = f"larger than {MAX_RECORD_BYTES // 2**20} MiB: not read"
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError includes an integer of more digits than Python converts; RecursionError a
        # nesting deeper than the parser follows.
        unreadable[label] = md.flat(f"{type(exc).__name__}: {exc}", 200)
        return None
    if not isinstance(data, dict):
        unreadable[label] = f"expected a JSON object, found {type(data).__name__}"
        return None
    if schemas.depth(data) > schemas.MAX_DEPTH:
        unreadable[label] = f"nested deeper than {schemas.MAX_DEPTH} levels"
        return None
    problem, caveat = schemas.problem(data, kind or label)
    if problem:
        unreadable[label] = problem
        return None
    if caveat and notes is not None and caveat not in notes:
        notes.append(caveat)
    return data


def bench_problem(doc: dict, schema_path: Path = BENCH_SCHEMA) -> tuple[str | None, str | None]:
    """(why bench.json does not match benches/bench.schema.json, a caveat when it cannot be checked).

    The provenance block is checked by the report itself, so it is set aside when the schema does
    not declare it."""
    try:
        import jsonschema
    except ImportError:
        return None, "bench.json was not checked against its schema: jsonschema is not installed"
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"bench.json was not checked against its schema: {schema_path.name}: {exc}"
    if "provenance" not in schema.get("properties", {}):
        doc = {key: value for key, value in doc.items() if key != "provenance"}
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(doc)
    )
    if error is None:
        return None, None
    where = "/".join(str(part) for part in error.absolute_path)[:120] or "(top level)"
    return f"does not match {schema_path.name} at {where}: {error.message}"[:300], None


def stale_reason(block: object, commit: dict | None, run_id: str | None) -> str | None:
    """Why a record's provenance block does not describe this checkout and run; None if it does."""
    if not isinstance(block, dict) or not isinstance(block.get("commit"), dict):
        return "without provenance (written by an older pipeline, or by hand)"
    theirs = block["commit"]
    if not provenance.same_code(theirs, commit):
        return (
            f"from commit {provenance.describe_commit(theirs)}, "
            f"not {provenance.describe_commit(commit)} (this checkout)"
        )
    if run_id and block.get("run_id") != run_id:
        return f"from run {block.get('run_id') or 'unknown'}, not this run ({run_id})"
    return None


def load_inputs(
    directory: Path,
    base_build: Path | None = None,
    commit: dict | None = None,
    run_id: str | None = None,
    job_seconds: float | None = None,
    job_start: float | None = None,
) -> Inputs:
    """Read the report folder. `commit` is the checkout's (provenance.commit() when None) and
    `run_id` this run's (FLASHMOE_RUN_ID when None): records from other code or runs are stale."""
    inputs = Inputs(
        commit=commit if commit is not None else provenance.commit(),
        run_id=run_id if run_id is not None else (os.environ.get(provenance.RUN_ID_VAR) or None),
        job_seconds=job_seconds,
        job_start=job_start if job_seconds is not None else None,
    )
    bad = inputs.unreadable
    inputs.env = _read_json(directory / "env.json", "env.json", bad, inputs.notes)
    inputs.build = _read_json(directory / "build.json", "build.json", bad, inputs.notes)
    inputs.gates = _read_json(directory / "gates.json", "gates.json", bad, inputs.notes)
    inputs.bench = _read_json(directory / "bench.json", "bench.json", bad)
    inputs.sanitize = _read_json(directory / "sanitize.json", "sanitize.json", bad, inputs.notes)
    inputs.selection = _read_json(directory / "selection.json", "selection.json", bad, inputs.notes)
    for label in RECORDS:
        doc = getattr(inputs, label.removesuffix(".json"))
        why = (
            None
            if doc is None
            else stale_reason(doc.get("provenance"), inputs.commit, inputs.run_id)
        )
        if why:
            inputs.stale[label] = why
    if inputs.bench is not None and "bench.json" not in inputs.stale:
        try:
            problem, caveat = bench_problem(inputs.bench)
        except RecursionError:
            problem, caveat = "nested too deeply to check against its schema", None
        if problem:
            bad["bench.json"], inputs.bench = problem, None
        if caveat:
            inputs.notes.append(caveat)
    try:
        stages_doc = _read_json(
            directory / stages.STAGES_FILE, stages.STAGES_FILE, bad, inputs.notes
        )
        inputs.stages = stages.normalize(stages_doc)
        recorded = (stages_doc or {}).get("job_start")
        if inputs.job_start is None and md.num(recorded) is not None and recorded > 0:
            inputs.job_start = float(recorded)
    except (TypeError, ValueError, OverflowError) as exc:  # a shape the schema let through
        bad[stages.STAGES_FILE] = md.flat(f"{type(exc).__name__}: {exc}", 200)
        inputs.stages = {}
    for name, stage in inputs.stages.items():
        why = stale_reason(stage["provenance"], inputs.commit, inputs.run_id)
        if why:
            inputs.stale_stages[name] = why
    named = (inputs.build or {}).get("log")
    if isinstance(named, str) and named and Path(named).name != BUILD_LOG:
        inputs.notes.append(
            f"build.json names its log {md.flat(named, 120)!r}: only {BUILD_LOG} in the report "
            "folder is read"
        )
    _read_build_log(inputs, directory / BUILD_LOG)

    if base_build is not None:
        inputs.base_build_path = str(base_build)
        inputs.base_build = _read_json(
            base_build, f"base build ({base_build})", bad, inputs.notes, "build.json"
        )
    return inputs


def _read_build_log(inputs: Inputs, log: Path) -> None:
    """The end of build.log, when it is a regular file in the report folder (a link is not
    followed: it could point anywhere on the machine)."""
    if log.is_symlink():
        inputs.unreadable[BUILD_LOG] = "a symbolic link: not followed"
        return
    if not log.is_file():
        return
    try:
        with log.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - MAX_LOG_BYTES))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError as exc:
        inputs.unreadable[BUILD_LOG] = md.flat(exc, 200)
        return
    inputs.build_log = md.tail(text, BUILD_LOG_TAIL_LINES)


def stage_status(inputs: Inputs, name: str) -> str | None:
    """This run's status of a stage (ok, fail, skip, error, interrupted, running), None when the
    stage has no entry of this run."""
    if name in inputs.stale_stages:
        return None
    return (inputs.stages.get(name) or {}).get("status")


def stage_failed(inputs: Inputs, name: str) -> bool:
    return stage_status(inputs, name) in ("fail", "error", "interrupted", "running")
