"""`python -m flashmoe_science report`: one markdown report of a pipeline run, for the PR comment and
the job summary.

It reads what the other commands left in the report folder (flashmoe_science.pipeline.paths.report_dir()):
env.json, build.json (or a build.log tail when the build failed), gates.json, bench.json and
stages.json, and writes report.md there. A missing file renders as "not run", never as an error.

    line 1   the verdict: `## ✅ flashmoe-science: passed`, `## ❌ flashmoe-science: 3 gates failed`, ...
    line 2   MARKER, a hidden line by which the PR comment is found and updated in place
    then     a summary table (one row per stage, with wall times), then one <details> section per
             stage, failing sections first and open, passing ones closed

The report stays under GitHub's 65,536-character comment limit: passing details go first, then
benchmark rows, then failing-case details, and the report says what it left out. With
$GITHUB_STEP_SUMMARY set, the report is appended to the job summary too.

Exit status: 0 whatever the verdict (the verdict is data; the workflow decides what fails), 2 when
an input exists but cannot be read or parsed (the report is still written, and names it).

Other commands call `record_stage(name, seconds, status)` to add their wall time to stages.json.
This module needs only the standard library, so the report renders even where torch is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fcntl
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from . import exitcodes
from .paths import report_dir

MARKER = "<!-- flashmoe-science-report -->"
MAX_CHARS = 65_536  # GitHub rejects a comment body above this ("Body is too long")
# The sticky-comment action adds its own hidden header line to the body; keep room for it. The
# budget is counted in UTF-8 bytes, which is never less than GitHub's count of characters.
HEADROOM = 512
BUDGET = MAX_CHARS - HEADROOM

STAGES_FILE = "stages.json"
STAGES_SCHEMA = "flashmoe-science/stages/1"
STAGE_ORDER = ("env", "build", "test", "bench", "sanitize", "report")
BASELINES = ("sdpa-default", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")  # bench.py's names
BASELINE_LABELS = {
    "sdpa-default": "SDPA default",
    "sdpa-flash": "SDPA flash",
    "sdpa-cudnn": "SDPA cuDNN",
    "sdpa-efficient": "SDPA efficient",
}
BENCH_KINDS = ("prefill", "decode", "small")
BUILD_LOG_TAIL_LINES = 60
RERUN_ALL_MAX = 20  # one combined `-k 'a or b ...'` command for up to this many failing cases

OK, NOTRUN, WARN, FAIL = 0, 1, 2, 3
TIMES = "\u00d7"  # the multiplication sign, as in "1.25 times faster"
ICONS = {OK: "✅", NOTRUN: "⏭️", WARN: "⚠️", FAIL: "❌"}


# --------------------------------------------------------------------------------------------------
# stages.json: wall time per stage, written by the other commands
# --------------------------------------------------------------------------------------------------


def record_stage(
    name: str, seconds: float, status: str = "ok", directory: Path | None = None
) -> Path:
    """Add or replace one stage's wall time and status ("ok", "fail" or "skip") in stages.json.

    Safe to call from concurrent processes: writers take a lock and replace the file atomically.
    A corrupt stages.json is started afresh rather than failing the caller's stage.
    """
    folder = Path(directory) if directory is not None else report_dir()
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
        stages[name] = {
            "seconds": round(float(seconds), 3),
            "status": status,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        tmp = path.with_name(f".{STAGES_FILE}.tmp")
        tmp.write_text(json.dumps({"schema": STAGES_SCHEMA, "stages": stages}, indent=2) + "\n")
        tmp.replace(path)
    return path


@contextlib.contextmanager
def timed_stage(name: str, directory: Path | None = None) -> Iterator[None]:
    """`with timed_stage("bench"): ...` records the block's wall time, "fail" if it raised."""
    start = time.monotonic()
    status = "fail"
    try:
        yield
        status = "ok"
    finally:
        record_stage(name, time.monotonic() - start, status, directory)


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    env: dict | None = None
    build: dict | None = None
    build_log: str | None = None
    gates: dict | None = None
    bench: dict | None = None
    stages: dict[str, dict] = dataclasses.field(default_factory=dict)
    base_build: dict | None = None
    base_build_path: str | None = None
    unreadable: dict[str, str] = dataclasses.field(default_factory=dict)  # file -> why
    run_url: str | None = None


def _read_json(path: Path, label: str, unreadable: dict[str, str]) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        unreadable[label] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return None
    if not isinstance(data, dict):
        unreadable[label] = f"expected a JSON object, found {type(data).__name__}"
        return None
    return data


def _normalize_stages(doc: dict | None) -> dict[str, dict]:
    """stages.json as written by record_stage ({"stages": {name: {...}}}) or as a plain mapping
    {name: seconds}; either way -> {name: {"seconds": float|None, "status": str|None}}."""
    if not doc:
        return {}
    raw = doc.get("stages", doc)
    stages: dict[str, dict] = {}
    if not isinstance(raw, dict):
        return stages
    for name, value in raw.items():
        if name == "schema":
            continue
        if isinstance(value, dict):
            stages[str(name)] = {
                "seconds": _num(value.get("seconds")),
                "status": value.get("status"),
            }
        else:
            stages[str(name)] = {"seconds": _num(value), "status": None}
    return stages


def load_inputs(directory: Path, base_build: Path | None = None) -> Inputs:
    inputs = Inputs()
    bad = inputs.unreadable
    inputs.env = _read_json(directory / "env.json", "env.json", bad)
    inputs.build = _read_json(directory / "build.json", "build.json", bad)
    inputs.gates = _read_json(directory / "gates.json", "gates.json", bad)
    inputs.bench = _read_json(directory / "bench.json", "bench.json", bad)
    inputs.stages = _normalize_stages(_read_json(directory / STAGES_FILE, STAGES_FILE, bad))
    log = directory / "build.log"
    if not log.exists() and inputs.build and isinstance(inputs.build.get("log"), str):
        candidate = Path(inputs.build["log"])
        log = candidate if candidate.is_absolute() else directory / candidate
    if log.is_file():
        try:
            inputs.build_log = _tail(log.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            bad["build.log"] = str(exc)
    if base_build is not None:
        inputs.base_build_path = str(base_build)
        inputs.base_build = _read_json(base_build, f"base build ({base_build})", bad)
    return inputs


def _tail(text: str, lines: int = BUILD_LOG_TAIL_LINES, width: int = 300) -> str:
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join(line if len(line) <= width else line[: width - 1] + "…" for line in kept)


# --------------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _int(value: Any) -> int | None:
    number = _num(value)
    return int(number) if number is not None else None


def _g(value: Any, digits: int = 3) -> str:
    """A number in `digits` significant figures; '—' for missing, NaN or Inf."""
    number = _num(value)
    if number is None:
        return "—"
    if number != 0 and abs(number) >= 10**digits:
        return f"{number:,.0f}"
    return f"{number:.{digits}g}"


def _times(value: Any, digits: int = 3) -> str:
    """A ratio such as 1.44 times; '—' when missing."""
    text = _g(value, digits)
    return text if text == "—" else text + TIMES


def _dur(seconds: Any) -> str:
    number = _num(seconds)
    if number is None:
        return "—"
    if number < 60:
        return f"{number:.1f} s"
    total = round(number)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def _bytes(value: Any) -> str:
    number = _num(value)
    if number is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(number) >= size:
            return f"{number / size:.3g} {unit}"
    return f"{int(number)} B"


def _text(value: Any, limit: int = 300) -> str:
    """Free text from an input file, made safe for one markdown table cell or list item."""
    text = " ".join(str(value).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _code(value: Any, limit: int = 300) -> str:
    """Inline code that survives any backticks in the value."""
    text = " ".join(str(value).split())[:limit].replace("|", "\\|")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fenced(text: str, lang: str = "") -> str:
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else (plural or word + 's')}"


def _sm(capability: Any) -> str | None:
    """'8.9' / [8, 9] / 89 -> 'sm_89'."""
    if capability in (None, ""):
        return None
    if isinstance(capability, (list, tuple)):
        return "sm_" + "".join(str(part) for part in capability[:2])
    text = str(capability)
    if text.startswith("sm_"):
        return text
    return "sm_" + text.replace(".", "")


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Detail:
    """How much of the report to render; the truncation loop lowers these until it fits."""

    passing: bool = True  # passing env checks, passing gate groups, passing kernels' table rows
    bench_rows: int | None = None  # None: all
    failing_cases: int | None = None  # None: all
    omitted: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Section:
    key: str  # the stage it belongs to: env, build, test, bench
    title: str
    severity: int
    summary: str  # one line for the summary table
    body: str = ""
    problems: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # for the verdict


def _stage_failed(inputs: Inputs, name: str) -> bool:
    status = (inputs.stages.get(name) or {}).get("status")
    return isinstance(status, str) and status.lower() in ("fail", "failed", "failure", "error")


def _unreadable_section(key: str, title: str, label: str, why: str) -> Section:
    return Section(
        key,
        title,
        FAIL,
        f"{label} unreadable",
        f"`{label}` exists but cannot be read: {_text(why)}",
        [(FAIL, f"{label} unreadable")],
    )


def _not_run(key: str, title: str, missing: str) -> Section:
    """A stage that left nothing behind: its body is the file it would have written."""
    return Section(key, title, NOTRUN, "not run", f"no `{missing}`")


def _absent(inputs: Inputs, key: str, title: str, missing: str, problem: str, body: str) -> Section:
    """The section of a stage whose JSON is missing: failed (stages.json says so) or not run."""
    if _stage_failed(inputs, key):
        return Section(
            key, title, FAIL, f"failed before writing {missing}", body, [(FAIL, problem)]
        )
    return _not_run(key, title, missing)


# ---- environment ----


def env_facts(env: dict | None) -> list[str]:
    if not env:
        return []
    facts = []
    gpu = env.get("gpu") if isinstance(env.get("gpu"), dict) else None
    if gpu:
        name = _text(gpu.get("name") or "GPU")
        sm = _sm(gpu.get("capability"))
        extra = [sm] if sm else []
        if _num(gpu.get("memory_gib")) is not None:
            extra.append(f"{_g(gpu['memory_gib'])} GiB")
        if (_int(gpu.get("count")) or 1) > 1:
            extra.append(f"{gpu['count']} visible")
        facts.append(f"**GPU** {name}" + (f" ({', '.join(extra)})" if extra else ""))
    else:
        facts.append("**GPU** none")
    if env.get("torch"):
        facts.append(f"**torch** {_text(env['torch'])}")
    cuda = env.get("cuda")
    if isinstance(cuda, dict):
        if cuda.get("torch"):
            facts.append(f"**CUDA** {_text(cuda['torch'])}")
        if cuda.get("nvcc"):
            facts.append(f"**nvcc** {_text(cuda['nvcc'])}")
        if cuda.get("driver_version"):
            facts.append(f"**driver** {_text(cuda['driver_version'])}")
    elif cuda:
        facts.append(f"**CUDA** {_text(cuda)}")
    if env.get("python"):
        facts.append(f"**Python** {_text(env['python'])}")
    if env.get("backend"):
        facts.append(f"**backend** {_text(env['backend'])}")
    return facts


def env_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Environment"
    if "env.json" in inputs.unreadable:
        return _unreadable_section("env", title, "env.json", inputs.unreadable["env.json"])
    env = inputs.env
    if env is None:
        return _absent(
            inputs,
            "env",
            title,
            "env.json",
            "environment check failed",
            "The env stage failed and left no `env.json`; see the job log.",
        )
    checks = [c for c in env.get("checks") or [] if isinstance(c, dict)]
    by_status: dict[str, list[dict]] = {}
    for check in checks:
        by_status.setdefault(str(check.get("status", "?")), []).append(check)
    failed = by_status.get("fail", [])
    warned = by_status.get("warn", [])
    passed_flag = env.get("passed")
    severity = FAIL if failed or passed_flag is False else WARN if warned else OK
    counts = ", ".join(
        f"{len(v)} {k}" for k, v in sorted(by_status.items(), key=lambda kv: _status_rank(kv[0]))
    )
    if failed:
        summary = "failed: " + ", ".join(_text(c.get("name")) for c in failed)
    elif passed_flag is False:
        summary = "failed"
    else:
        summary = f"{counts or 'no checks'}"
    problems = []
    if severity == FAIL:
        names = ", ".join(_text(c.get("name")) for c in failed)
        problems.append((FAIL, "environment check failed" + (f" ({names})" if names else "")))
    elif warned:
        problems.append((WARN, _plural(len(warned), "environment warning")))

    parts = [" · ".join(env_facts(env))]
    if env.get("require_gpu"):
        parts[0] += " · GPU required"
    shown = [c for c in checks if c.get("status") in ("fail", "warn")]
    hidden = [c for c in checks if c.get("status") not in ("fail", "warn")]
    if detail.passing:
        shown += hidden
        hidden = []
    if shown:
        shown.sort(key=lambda c: _status_rank(str(c.get("status"))))
        rows = [
            [
                _check_icon(c.get("status")),
                _text(c.get("name")),
                _text(c.get("detail")),
                _text(c.get("fix") or ""),
            ]
            for c in shown
        ]
        parts.append(_table(["", "check", "detail", "fix"], rows))
    if hidden:
        parts.append(f"_{_plural(len(hidden), 'passing check')} not shown._")
        detail.omitted.append("passing details")
    return Section("env", title, severity, summary, "\n\n".join(parts), problems)


def _status_rank(status: str) -> int:
    return {"fail": 0, "warn": 1, "ok": 2, "skip": 3}.get(status, 4)


def _check_icon(status: Any) -> str:
    return {"ok": "✅", "warn": "⚠️", "fail": "❌", "skip": "⏭️"}.get(str(status), "❔")


# ---- build ----


def _kernel_key(kernel: dict) -> tuple[str, str]:
    return (str(kernel.get("kernel", "?")), str(kernel.get("arch", "?")))


def _spills(kernel: dict) -> tuple[int, int]:
    return (_int(kernel.get("spill_stores")) or 0, _int(kernel.get("spill_loads")) or 0)


def kernel_changes(kernel: dict, base: dict | None) -> tuple[list[str], bool]:
    """What changed against the base build, and whether a spill is new (none in the base)."""
    stores, loads = _spills(kernel)
    if base is None:
        return (["new kernel"] + (["🆕 spills"] if stores or loads else []), bool(stores or loads))
    changes = []
    base_stores, base_loads = _spills(base)
    new_spill = bool(stores or loads) and not (base_stores or base_loads)
    if new_spill:
        changes.append(f"🆕 spills ({stores} B st, {loads} B ld)")
    elif (stores, loads) != (base_stores, base_loads):
        if stores or loads:
            changes.append(f"spills {base_stores}/{base_loads} → {stores}/{loads} B")
        else:
            changes.append("spills gone")
    for field, label in (
        ("registers", "regs"),
        ("smem_bytes", "smem B"),
        ("stack_bytes", "stack B"),
    ):
        now, was = _int(kernel.get(field)), _int(base.get(field))
        if now is not None and was is not None and now != was:
            changes.append(f"{now - was:+d} {label}")
    return changes, new_spill


def build_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Build"
    if "build.json" in inputs.unreadable:
        return _unreadable_section("build", title, "build.json", inputs.unreadable["build.json"])
    build, log = inputs.build, inputs.build_log
    status = str((build or {}).get("status", "ok")).lower()
    failed = (build is None and (log is not None or _stage_failed(inputs, "build"))) or status in (
        "failed",
        "fail",
        "error",
    )
    if build is None and not failed:
        return _not_run("build", title, "build.json")
    parts = []
    if build:
        facts = [f"**backend** {_text(build.get('backend', '?'))}"]
        archs = build.get("arch_list") or []
        if archs:
            facts.append("**arch** " + ", ".join(_sm(a) or "?" for a in archs))
        if build.get("torch_version"):
            facts.append(f"**torch** {_text(build['torch_version'])}")
        if build.get("cuda_version"):
            facts.append(f"**CUDA** {_text(build['cuda_version'])}")
        if build.get("nvcc_version"):
            facts.append(f"**nvcc** {_text(build['nvcc_version'])}")
        elapsed = build.get("elapsed_s")
        if elapsed is not None:
            kind = (
                "cold" if build.get("cold") else "up to date" if build.get("cold") is False else ""
            )
            facts.append(f"**time** {_dur(elapsed)}" + (f" ({kind})" if kind else ""))
        if build.get("compiler_warnings"):
            facts.append(f"**compiler warnings** {_text(build['compiler_warnings'])}")
        parts.append(" · ".join(facts))
        if build.get("reason"):
            parts.append(f"Why this backend: {_text(build['reason'])}")
    if failed:
        summary = "failed"
        if build and build.get("elapsed_s") is not None:
            summary += f" after {_dur(build['elapsed_s'])}"
        error = (build or {}).get("error")
        if error:
            parts.append("**Error**\n\n" + _fenced(_tail(str(error), 40)))
        if log:
            parts.append(f"**`build.log`, last {BUILD_LOG_TAIL_LINES} lines**\n\n" + _fenced(log))
        if not error and not log:
            parts.append(
                "The build failed and left neither an error message nor `build.log`; see the job log."
            )
        parts.append("Reproduce: `nox -s build` (add `-- --force` to rebuild from scratch).")
        return Section("build", title, FAIL, summary, "\n\n".join(parts), [(FAIL, "build failed")])

    kernels = [k for k in build.get("kernels") or [] if isinstance(k, dict)]
    base = inputs.base_build
    base_kernels = {}
    if base is not None:
        base_kernels = {_kernel_key(k): k for k in base.get("kernels") or [] if isinstance(k, dict)}
    rows, new_spills, spilling, changed = [], 0, 0, 0
    for kernel in kernels:
        stores, loads = _spills(kernel)
        spilling += bool(stores or loads)
        changes: list[str] = []
        if base is not None:
            changes, new_spill = kernel_changes(kernel, base_kernels.get(_kernel_key(kernel)))
            new_spills += new_spill
            changed += bool(changes)
        flagged = bool(stores or loads or changes)
        if not detail.passing and not flagged:
            continue
        rows.append(
            [
                _code(kernel.get("kernel", "?"), 120),
                _text(kernel.get("arch", "?")),
                _g(kernel.get("registers")),
                _bytes(kernel.get("smem_bytes")),
                _g(kernel.get("stack_bytes")),
                ("⚠️ " if stores or loads else "") + f"{stores} / {loads}",
            ]
            + (["; ".join(changes) or "—"] if base is not None else [])
        )
    removed = [key for key in base_kernels if key not in {_kernel_key(k) for k in kernels}]
    header = ["kernel", "arch", "registers", "smem", "stack B", "spill st / ld B"]
    if base is not None:
        header.append("vs base")
    if rows:
        parts.append(_table(header, rows))
    hidden = len(kernels) - len(rows)
    if hidden:
        parts.append(f"_{_plural(hidden, 'kernel')} without spills or changes not shown._")
        detail.omitted.append("passing details")
    if not kernels:
        parts.append("No per-kernel resource usage (CPU build, or ptxas printed none).")
    if removed:
        parts.append(
            "Kernels in the base build but not here: "
            + ", ".join(_code(k[0], 120) + f" ({_text(k[1])})" for k in removed)
        )
    if (
        inputs.base_build_path
        and base is None
        and f"base build ({inputs.base_build_path})" not in inputs.unreadable
    ):
        parts.append(
            f"No base build to compare with (`{_text(inputs.base_build_path)}` not found)."
        )

    problems = []
    severity = OK
    if base is not None and new_spills:
        severity = WARN
        problems.append((WARN, f"new register spills in {_plural(new_spills, 'kernel')}"))
    elif base is None and spilling:
        severity = WARN
        problems.append((WARN, f"register spills in {_plural(spilling, 'kernel')}"))
    summary = f"{_text(build.get('backend', '?'))}"
    if build.get("arch_list"):
        summary += " " + ", ".join(_sm(a) or "?" for a in build["arch_list"])
    summary += f", {_plural(len(kernels), 'kernel')}"
    summary += f", {_plural(spilling, 'spilling kernel')}" if spilling else ", no spills"
    if base is not None:
        if new_spills:
            summary += f", {_plural(new_spills, 'new spill')}"
        summary += f", {changed} changed vs base" if changed else ", same as base"
    if "build.log" in inputs.unreadable:
        parts.append(f"`build.log` unreadable: {_text(inputs.unreadable['build.log'])}")
    return Section("build", title, severity, summary, "\n\n".join(parts), problems)


# ---- gates ----


def _case_failed(case: dict) -> bool:
    outcome = case.get("outcome")
    if outcome is not None:
        return outcome not in ("passed", "skipped")
    return case.get("passed") is False


def rerun_command(case_id: str, device: str) -> str:
    return f"nox -s test -- -k '{case_id}-{device}'"


def _safe_id(value: Any) -> str:
    """Case ids and devices go into shell commands: keep only what gates.Case.id can contain."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", str(value))


def gates_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Correctness gates"
    if "gates.json" in inputs.unreadable:
        return _unreadable_section("test", title, "gates.json", inputs.unreadable["gates.json"])
    gates = inputs.gates
    if gates is None:
        return _absent(
            inputs,
            "test",
            title,
            "gates.json",
            "test stage failed",
            "The test stage failed and left no `gates.json` (pytest crashed, or no gate "
            "ran); see the job log. Reproduce: `nox -s test`.",
        )
    cases = [c for c in gates.get("cases") or [] if isinstance(c, dict)]
    failing = [c for c in cases if _case_failed(c)]
    skipped = [c for c in cases if c.get("outcome") == "skipped"]
    total = _int(gates.get("total"))
    total = total if total is not None else len(cases)
    nfailed = _int(gates.get("failed"))
    nfailed = max(nfailed if nfailed is not None else 0, len(failing))
    worst_case = gates.get("worst_case")
    facts = [
        f"**{total - nfailed} of {total} passed**",
        f"**worst max diff** {_g(gates.get('worst_max_diff'))}"
        + (f" ({_code(worst_case, 150)})" if worst_case else ""),
        f"**worst error ratio** {_times(gates.get('worst_ratio'))} PyTorch's own",
    ]
    if skipped:
        facts.append(f"**skipped** {len(skipped)}")
    parts = [" · ".join(facts)]
    problems = []
    if nfailed:
        severity = FAIL
        summary = f"{nfailed} of {total} failed"
        problems.append((FAIL, _plural(nfailed, "gate") + " failed"))
    elif total == 0:
        severity = WARN
        summary = "no gate cases ran"
        problems.append((WARN, "no gate cases ran"))
    elif _stage_failed(inputs, "test"):
        # Every gate passed but pytest failed elsewhere (a unit test, the bisect test): not a pass.
        severity = FAIL
        summary = f"{total} of {total} gates passed; other tests failed"
        problems.append((FAIL, "tests outside the gates failed (see the job log)"))
    else:
        severity = OK
        summary = f"{total} of {total} passed"
    if failing:
        parts.append(_failing_cases(failing, detail))
    if cases and len(cases) > len(failing):
        parts.append(_passing_groups([c for c in cases if not _case_failed(c)], detail))
    return Section("test", title, severity, summary, "\n\n".join(p for p in parts if p), problems)


def _failing_cases(failing: list[dict], detail: Detail) -> str:
    shown = failing if detail.failing_cases is None else failing[: detail.failing_cases]
    rows = [
        [
            _code(c.get("case_id", "?"), 150),
            _text(c.get("device", "?")),
            _diff(c),
            _g(c.get("bound")),
            _g(c.get("pt_max_diff")),
            _times(c.get("ratio")),
            _text(
                "; ".join(str(f) for f in c.get("failures") or []) or c.get("outcome", "failed"),
                200,
            ),
        ]
        for c in shown
    ]
    parts = [
        "**Failing cases**",
        _table(["case", "device", "max diff", "bound", "PyTorch err", "ratio", "failures"], rows),
    ]
    blocks = []
    for c in shown:
        case_id, device = _safe_id(c.get("case_id", "?")), _safe_id(c.get("device", "?"))
        lines = [
            f"- {_code(case_id, 150)} on {_text(device)}"
            + (f", seed {_text(c.get('seed'))}" if c.get("seed") is not None else "")
        ]
        for failure in c.get("failures") or []:
            lines.append(f"  - {_text(failure)}")
        lines.append(
            f"  - max diff {_diff(c)} (mean {_g(c.get('mean_diff'))}); gate-2 bound {_g(c.get('bound'))}"
            f" = 2 {TIMES} PyTorch's {_g(c.get('pt_max_diff'))} + floor {_g(c.get('floor'))}"
        )
        worst = c.get("worst")
        if isinstance(worst, (list, tuple)) and len(worst) == 4:
            b, h, row, col = (_text(x) for x in worst)
            lines.append(f"  - worst element: batch {b}, head {h}, query row {row}, column {col}")
        profile = c.get("row_profile")
        if isinstance(profile, list) and profile:
            segs = [p for p in profile if isinstance(p, (list, tuple)) and len(p) == 3]
            if any(_num(p[2]) is not None for p in segs):
                lines.append(
                    "  - error along query rows: "
                    + ", ".join(f"{_text(p[0])}-{_text(p[1])}: {_g(p[2])}" for p in segs)
                )
            elif segs:
                lines.append("  - error along query rows: not finite in any segment")
        lines.append(f"  - rerun: `{rerun_command(case_id, device)}`")
        blocks.append("\n".join(lines))
    parts.append("\n".join(blocks))
    if len(shown) < len(failing):
        parts.append(
            f"_… and {len(failing) - len(shown)} more failing cases: see `gates.json` in the artifact._"
        )
        detail.omitted.append(f"{len(failing) - len(shown)} of {len(failing)} failing-case details")
    elif 1 < len(failing) <= RERUN_ALL_MAX:
        pattern = " or ".join(
            f"{_safe_id(c.get('case_id'))}-{_safe_id(c.get('device'))}" for c in failing
        )
        parts.append(
            "Rerun all failing cases:\n\n" + _fenced(f"nox -s test -- -k '{pattern}'", "sh")
        )
    return "\n\n".join(parts)


def _diff(case: dict) -> str:
    """A case's max diff; NaN/Inf arrive as null (gates.GateResult.to_json)."""
    if _num(case.get("max_diff")) is None and (
        _int(case.get("nonfinite")) or case.get("max_diff") is None
    ):
        return "NaN/Inf"
    return _g(case.get("max_diff"))


def _passing_groups(passing: list[dict], detail: Detail) -> str:
    if not detail.passing:
        detail.omitted.append("passing details")
        return f"_{_plural(len(passing), 'passing case')} not shown._"
    groups: dict[tuple, list[dict]] = {}
    for c in passing:
        key = (
            str(c.get("op", "?")),
            str(c.get("dtype", "?")),
            str(c.get("head_dim", "?")),
            str(c.get("device", "?")),
        )
        groups.setdefault(key, []).append(c)
    rows = []
    for (op, dtype, head_dim, device), members in sorted(groups.items()):
        worst = max(members, key=lambda c: _num(c.get("ratio")) or 0.0)
        rows.append(
            [
                _text(op),
                _text(dtype),
                _text(head_dim),
                _text(device),
                str(len(members)),
                _g(max((_num(c.get("max_diff")) or 0.0) for c in members)),
                _times(worst.get("ratio")),
                _code(worst.get("case_id", "?"), 150),
            ]
        )
    return "**Passing cases by group**\n\n" + _table(
        [
            "op",
            "dtype",
            "head dim",
            "device",
            "cases",
            "worst max diff",
            "worst ratio",
            "worst case",
        ],
        rows,
    )


# ---- benchmark ----
# bench.json follows benches/bench.schema.json ("flashmoe-science/bench/1"). Older or hand-written
# shapes (baseline keys with underscores, {"unsupported": reason}, a flat comparison) render too.


def _result(container: dict | None, name: str) -> dict | None:
    """A baseline's (or our) result; keys may be spelled sdpa-default or sdpa_default."""
    if not isinstance(container, dict):
        return None
    value = container.get(name, container.get(name.replace("-", "_")))
    return value if isinstance(value, dict) else None


def _measured(result: dict | None) -> bool:
    return (
        isinstance(result, dict)
        and result.get("status", "ok") == "ok"
        and "unsupported" not in result
        and _num(result.get("median_ms")) is not None
    )


def _not_measured(result: dict | None) -> tuple[str, str] | None:
    """(status, reason) of a result that has no timing: unsupported, or error."""
    if not isinstance(result, dict) or _measured(result):
        return None
    status = str(result.get("status") or ("unsupported" if "unsupported" in result else "error"))
    reason = result.get("reason") or result.get("unsupported") or "no timing"
    return status, str(reason)


def _over_ours(case: dict, result: dict | None) -> float | None:
    """Another result's time / our time (its stored ratio when a time is missing)."""
    ours = case.get("ours")
    if _measured(ours) and _measured(result) and _num(ours["median_ms"]):
        return _num(result["median_ms"]) / _num(ours["median_ms"])
    if isinstance(result, dict) and _num(result.get("ratio")):
        return _num(result["ratio"])
    return None


def _speedup(case: dict, name: str) -> float | None:
    """Baseline time / our time: above 1 we are faster."""
    speed = _over_ours(case, _result(case.get("baselines"), name))
    if speed:
        return speed
    ratios = case.get("ratios") if isinstance(case.get("ratios"), dict) else {}
    return _num(ratios.get(name, ratios.get(name.replace("-", "_"))))


def _baseline_tflops(case: dict, name: str) -> float | None:
    base = _result(case.get("baselines"), name)
    if not _measured(base):
        return None
    if _num(base.get("tflops")) is not None:
        return _num(base["tflops"])
    ours = case.get("ours") or {}
    if _num(ours.get("tflops")) and _num(ours.get("median_ms")):
        return ours["tflops"] * ours["median_ms"] / base["median_ms"]  # same FLOPs
    return None


def _group(case: dict) -> str:
    """prefill, decode or small: where in the matrix the case comes from."""
    return str(case.get("group") or case.get("kind") or "?")


_SEQ_RE = re.compile(r"(?:^|[-_])(sq|sk|s|k|seq|seqlen)(\d+)(?=$|[-_])", re.IGNORECASE)
_BATCH_RE = re.compile(r"(?:^|[-_])b\d+(?=$|[-_])")


def _seqlen(case: dict) -> int | None:
    for key in ("seqlen_k", "seqlen", "seqlen_q"):
        if _int(case.get(key)):
            return _int(case[key])
    found = {m.group(1).lower(): int(m.group(2)) for m in _SEQ_RE.finditer(str(case.get("id", "")))}
    for key in ("sk", "k", "seqlen", "seq", "s", "sq"):
        if key in found:
            return found[key]
    return None


def _series(case: dict) -> str:
    """The case with batch and sequence length left out: one line of the chart."""
    if all(key in case for key in ("dtype", "head_dim", "heads_q", "heads_kv", "causal")):
        heads = f"h{case['heads_q']}" + (
            f"kv{case['heads_kv']}" if case["heads_kv"] != case["heads_q"] else ""
        )
        mask = "causal" if case["causal"] else "full"
        return f"{case['dtype']} d{case['head_dim']} {heads} {mask}"
    key = _BATCH_RE.sub("", _SEQ_RE.sub("", str(case.get("id", ""))))
    return key.strip("-_").replace("-", " ")


def prefill_chart(cases: list[dict]) -> str:
    """A mermaid xychart of our TFLOP/s against SDPA's over sequence length, for the prefill series
    with the most points."""
    series: dict[str, dict[int, dict]] = {}
    for case in cases:
        ours = case.get("ours")
        if (
            _group(case) == "prefill"
            and _seqlen(case)
            and _measured(ours)
            and _num(ours.get("tflops"))
        ):
            series.setdefault(_series(case), {}).setdefault(_seqlen(case), case)
    best = None
    for key, by_len in series.items():
        for name in BASELINES:  # in order of preference
            points = [
                (n, c) for n, c in sorted(by_len.items()) if _baseline_tflops(c, name) is not None
            ]
            if len(points) >= 2 and (best is None or len(points) > len(best[2])):
                best = (key, name, points)
            if len(points) == len(by_len):
                break
    if best is None:
        return ""
    key, name, points = best
    ours = [round(_num(c["ours"]["tflops"]), 1) for _, c in points]
    theirs = [round(_baseline_tflops(c, name), 1) for _, c in points]
    y_max = max(10, math.ceil(max(ours + theirs) * 1.1 / 10.0) * 10)
    title = re.sub(r"[^A-Za-z0-9 _.,:+-]", " ", f"prefill {key}").strip()
    chart = "\n".join(
        [
            "xychart-beta",
            f'    title "{title}: TFLOP/s"',
            f'    x-axis "sequence length" [{", ".join(str(n) for n, _ in points)}]',
            f'    y-axis "TFLOP/s" 0 --> {y_max}',
            f"    bar [{', '.join(f'{v:g}' for v in theirs)}]",
            f"    line [{', '.join(f'{v:g}' for v in ours)}]",
        ]
    )
    return (
        _fenced(chart, "mermaid") + f"\n\n_Bars: {BASELINE_LABELS[name]}; line: flashmoe-science._"
    )


def _bench_facts(bench: dict) -> list[str]:
    facts = []
    gpu = bench.get("gpu")
    if isinstance(gpu, dict):
        sm = _sm(gpu.get("capability"))
        facts.append(f"**GPU** {_text(gpu.get('name', '?'))}" + (f" ({sm})" if sm else ""))
    elif gpu:
        facts.append(f"**GPU** {_text(gpu)}")
    for key, label in (
        ("torch", "torch"),
        ("cuda", "CUDA"),
        ("driver", "driver"),
        ("backend", "backend"),
    ):
        if bench.get(key):
            facts.append(f"**{label}** {_text(bench[key])}")
    commit = bench.get("commit")
    if isinstance(commit, dict) and commit.get("sha"):
        facts.append(
            f"**commit** {_code(str(commit['sha'])[:12])}"
            + (" (dirty tree)" if commit.get("dirty") else "")
        )
    elif isinstance(commit, str) and commit:
        facts.append(f"**commit** {_code(commit[:12])}")
    timing = bench.get("timing")
    if isinstance(timing, dict) and timing.get("method"):
        facts.append(f"**timer** {_text(timing['method'])}")
    return facts


def _ceilings(ceilings: Any) -> str:
    if not isinstance(ceilings, dict) or not ceilings:
        return ""
    items = []
    copy, matmul = ceilings.get("copy"), ceilings.get("matmul")
    if isinstance(copy, dict) and _num(copy.get("gbps")):
        items.append(f"copy {_g(copy['gbps'])} GB/s")
    if isinstance(matmul, dict) and _num(matmul.get("tflops")):
        shape = (
            f" ({_text(matmul.get('dtype', ''))} {_text(matmul.get('n', ''))}³)"
            if matmul.get("n")
            else ""
        )
        items.append(f"matmul{shape} {_g(matmul['tflops'])} TFLOP/s")
    if ceilings.get("error"):
        items.append(f"not measured: {_text(ceilings['error'], 160)}")
    items += [f"{_text(k)} {_g(v)}" for k, v in ceilings.items() if _num(v) is not None]
    return "Ceilings measured on this card: " + ", ".join(items) + "." if items else ""


def _pct(value: Any) -> str:
    return f" ({_g(value, 2)}%)" if _num(value) is not None else ""


def _measured_cell(result: Any, label: str, speed: float | None, reasons: dict) -> str:
    """A baseline's or the read floor's cell: ms (its time over ours), or why it is missing."""
    problem = _not_measured(result)
    if result is None:
        return "—"
    if problem:
        reasons.setdefault(f"{label}: {problem[0]}", set()).add(problem[1])
        return "n/a" if problem[0] == "unsupported" else "error"
    return _g(result.get("median_ms")) + (f" ({speed:.2f}{TIMES})" if speed else "")


def _bench_row(
    case: dict, regressed: bool, reasons: dict[str, set[str]], read_floor: bool = False
) -> list[str]:
    ours = case.get("ours") or {}
    label = ("⚠️ " if regressed else "") + _code(case.get("id", "?"), 150)
    problem = _not_measured(ours)
    if problem:
        reasons.setdefault(f"ours: {problem[0]}", set()).add(problem[1])
        dashes = len(BASELINES) + read_floor
        return [f"❌ {label}", f"**{_text(problem[0])}**", "—", "—", "—"] + ["—"] * dashes
    decode = case.get("kind") == "decode"
    iqr = _num(ours.get("iqr_ms"))
    row = [
        label,
        _g(ours.get("median_ms")) + (f" ± {_g(iqr, 2)}" if iqr is not None else ""),
        _g(ours.get("tflops")) + ("" if decode else _pct(ours.get("pct_matmul_ceiling"))),
        _g(ours.get("gbps")) + (_pct(ours.get("pct_copy_ceiling")) if decode else ""),
        _bytes(ours.get("peak_mem_bytes", ours.get("peak_mem"))),
    ]
    for name in BASELINES:
        base = _result(case.get("baselines"), name)
        row.append(_measured_cell(base, BASELINE_LABELS[name], _speedup(case, name), reasons))
    if read_floor:
        floor = _result(case, "read_floor")
        row.append(_measured_cell(floor, "read floor", _over_ours(case, floor), reasons))
    return row


def bench_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Benchmark"
    if "bench.json" in inputs.unreadable:
        return _unreadable_section("bench", title, "bench.json", inputs.unreadable["bench.json"])
    bench = inputs.bench
    if bench is None:
        return _absent(
            inputs,
            "bench",
            title,
            "bench.json",
            "bench stage failed",
            "The bench stage failed and left no `bench.json`; see the job log. "
            "Reproduce: `nox -s bench`.",
        )
    cases = [c for c in bench.get("cases") or [] if isinstance(c, dict)]
    comparison = bench.get("comparison") if isinstance(bench.get("comparison"), dict) else None
    compared = [c for c in (comparison or {}).get("cases") or [] if isinstance(c, dict)]
    regressions = [c for c in compared if c.get("verdict") == "regression"]
    improvements = [c for c in compared if c.get("verdict") == "improvement"]
    regressed_ids = {c.get("id") for c in regressions}
    broken = [c for c in cases if _not_measured(c.get("ours"))]

    facts = _bench_facts(bench)
    parts = [" · ".join(facts)] if facts else []
    ceilings = _ceilings(bench.get("ceilings"))
    if ceilings:
        parts.append(ceilings)
    speedups = [s for s in (_speedup(c, "sdpa-default") for c in cases) if s]
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups)) if speedups else None

    # Rows kept when truncating: our failures, regressions, then where we trail SDPA the most.
    def priority(i: int) -> tuple:
        case = cases[i]
        return (
            case not in broken,
            case.get("id") not in regressed_ids,
            _speedup(case, "sdpa-default") or math.inf,
        )

    order = sorted(range(len(cases)), key=priority)
    keep = set(order if detail.bench_rows is None else order[: detail.bench_rows])
    reasons: dict[str, set[str]] = {}
    tables = []
    groups = [g for g in BENCH_KINDS if any(_group(c) == g for c in cases)]
    groups += sorted({_group(c) for c in cases} - set(groups))
    header = ["case", "ours ms", "TFLOP/s", "GB/s", "peak mem"]
    header += [f"{BASELINE_LABELS[n]} ms ({TIMES})" for n in BASELINES]
    for group in groups:
        in_group = [(i, c) for i, c in enumerate(cases) if _group(c) == group]
        floor = any("read_floor" in c for _, c in in_group)
        rows = [
            _bench_row(case, case.get("id") in regressed_ids, reasons, floor)
            for index, case in in_group
            if index in keep
        ]
        if rows:
            columns = header + ([f"read floor ms ({TIMES})"] if floor else [])
            tables.append(f"**{_text(group)}**\n\n" + _table(columns, rows))
    if cases:
        parts.append(
            f"Times are medians ± IQR; ({TIMES}) is SDPA's time over ours, so above 1.00{TIMES} we are "
            "faster; (%) is the share of this card's measured ceiling."
            + (
                f" The read floor is a bare read of the case's K and V, timed alike; its ({TIMES}) "
                f"is its time over ours, so 1.00{TIMES} would be a decode as fast as reading the cache."
                if any("read_floor" in c for c in cases)
                else ""
            )
            + (f" Geometric mean against SDPA default: **{geo:.2f}{TIMES}**." if geo else "")
        )
    parts += tables
    if reasons:
        parts.append(
            "\n".join(
                f"- {_text(what)}: " + " / ".join(_text(r, 160) for r in sorted(texts)[:3])
                for what, texts in sorted(reasons.items())
            )
        )
    if len(keep) < len(cases):
        parts.append(
            f"_{len(cases) - len(keep)} of {len(cases)} benchmark rows not shown (all are in `bench.json`)._"
        )
        detail.omitted.append(f"{len(cases) - len(keep)} of {len(cases)} benchmark rows")
    chart = prefill_chart(cases)
    if chart:
        parts.append(chart)
    head_vs_base = _comparison(comparison, compared, detail)
    if regressions:  # the regressions are the news: put them above the tables
        parts.insert(1 if facts else 0, head_vs_base)
    else:
        parts.append(head_vs_base)

    problems = []
    severity = OK
    if broken:
        severity = FAIL
        problems.append((FAIL, f"our kernel failed on {_plural(len(broken), 'bench case')}"))
    if regressions:
        severity = max(severity, WARN)
        problems.append((WARN, _plural(len(regressions), "regression")))
    summary = _plural(len(cases), "case")
    if broken:
        summary += f", {len(broken)} failed"
    if geo:
        summary += f", {geo:.2f}{TIMES} SDPA default (geo-mean)"
    if _comparison_source(comparison) != "none":
        summary += (
            f", {_plural(len(regressions), 'regression')}, {_plural(len(improvements), 'improvement')}"
            f" vs {_text(_base_ref(comparison))}"
        )
    return Section("bench", title, severity, summary, "\n\n".join(p for p in parts if p), problems)


def _comparison_source(comparison: dict | None) -> str:
    return str((comparison or {}).get("source") or "none")


def _base_ref(comparison: dict | None) -> str:
    base = (comparison or {}).get("base")
    ref = base.get("ref") if isinstance(base, dict) else None
    return str(ref or (comparison or {}).get("base_ref") or "base")


def _comparison(comparison: dict | None, compared: list[dict], detail: Detail) -> str:
    source = _comparison_source(comparison)
    why = (comparison or {}).get("reason")
    if source == "none":
        return "**Head vs base:** no comparison" + (
            f": {_text(why, 300)}" if why else " (no base measurement)."
        )
    how = {
        "worktree": "base built and timed side by side in this job",
        "same-job": "base built and timed side by side in this job",
        "stored": "base samples from a stored run, so machine drift is not controlled",
    }.get(source, _text(source))
    base = comparison.get("base") if isinstance(comparison.get("base"), dict) else {}
    sha = f" at {_code(str(base['sha'])[:12])}" if base.get("sha") else ""
    stored = ""
    if base.get("stored_commit"):
        stored = (
            f" Stored run: {_code(str(base['stored_commit'])[:12])}"
            + (f" ({_text(base['stored_at'])})" if base.get("stored_at") else "")
            + "."
        )
    rule = ""
    if _num(comparison.get("threshold")) is not None:
        rule = f" A change counts when it exceeds {_g(comparison['threshold'] * 100, 2)}%"
        rule += (
            f" and Mann-Whitney p < {_g(comparison.get('alpha'), 2)}."
            if _num(comparison.get("alpha"))
            else "."
        )
    head = f"**Head vs base** {_code(_base_ref(comparison))}{sha}: {how}.{rule}{stored}"
    if why:
        head += f" Why not side by side: {_text(why, 300)}"
    if not compared:
        return head + "\n\nNo cases compared."
    rank = {"regression": 0, "improvement": 1, "missing": 2}
    ordered = sorted(
        compared,
        key=lambda c: (rank.get(str(c.get("verdict")), 3), -abs(_num(c.get("change_pct")) or 0)),
    )
    shown = ordered
    if detail.bench_rows is not None:
        regressed = [c for c in ordered if c.get("verdict") == "regression"]
        shown = (
            regressed
            + [c for c in ordered if c.get("verdict") != "regression"][
                : max(0, detail.bench_rows - len(regressed))
            ]
        )
    icons = {"regression": "⚠️", "improvement": "🚀", "missing": "❔"}
    rows = []
    for c in shown:
        change = _num(c.get("change_pct"))
        verdict_text = _text(c.get("verdict", "?"))
        if c.get("verdict") == "missing" and c.get("reason"):
            verdict_text += f": {_text(c['reason'], 120)}"
        rows.append(
            [
                icons.get(str(c.get("verdict")), ""),
                _code(c.get("id", "?"), 150),
                _g(c.get("head_median_ms", c.get("head_ms"))),
                _g(c.get("base_median_ms", c.get("base_ms"))),
                f"{change:+.1f}%" if change is not None else "—",
                _g(c.get("p_value"), 2),
                verdict_text,
            ]
        )
    text = (
        head + "\n\n" + _table(["", "case", "head ms", "base ms", "change", "p", "verdict"], rows)
    )
    if len(shown) < len(compared):
        text += f"\n\n_{len(compared) - len(shown)} unchanged comparisons not shown._"
        detail.omitted.append(f"{len(compared) - len(shown)} of {len(compared)} comparison rows")
    return text


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def verdict(sections: list[Section], inputs: Inputs) -> str:
    problems = [p for s in sections for p in s.problems]
    problems += [
        (FAIL, f"{name} failed") for name in _extra_stages(inputs) if _stage_failed(inputs, name)
    ]
    main_files = {"env.json", "build.json", "gates.json", "bench.json"}
    problems += [
        (WARN, f"{name} unreadable") for name in inputs.unreadable if name not in main_files
    ]
    failing = [text for sev, text in problems if sev == FAIL]
    warning = [text for sev, text in problems if sev == WARN]
    if failing:
        return f"## {ICONS[FAIL]} flashmoe-science: " + ", ".join(failing + warning)
    if warning:
        return f"## {ICONS[WARN]} flashmoe-science: " + ", ".join(warning)
    not_run = [s.key for s in sections if s.severity == NOTRUN]
    if len(not_run) == len(sections):
        return f"## {ICONS[WARN]} flashmoe-science: nothing ran"
    return f"## {ICONS[OK]} flashmoe-science: passed" + (
        f" (not run: {', '.join(not_run)})" if not_run else ""
    )


def _extra_stages(inputs: Inputs) -> list[str]:
    known = {"env", "build", "test", "bench"}
    ordered = [s for s in STAGE_ORDER if s in inputs.stages and s not in known]
    return ordered + [s for s in inputs.stages if s not in known and s not in ordered]


def summary_table(sections: list[Section], inputs: Inputs) -> str:
    rows = []
    total = 0.0
    counted = False
    for section in sections:
        stage = inputs.stages.get(section.key) or {}
        seconds = stage.get("seconds")
        if seconds is not None:
            total += seconds
            counted = True
        rows.append([ICONS[section.severity], section.key, section.summary, _dur(seconds)])
    for name in _extra_stages(inputs):
        stage = inputs.stages[name]
        status = str(stage.get("status") or "")
        icon = (
            ICONS[FAIL]
            if _stage_failed(inputs, name)
            else ICONS[NOTRUN]
            if status.startswith("skip")
            else ICONS[OK]
        )
        if stage.get("seconds") is not None:
            total += stage["seconds"]
            counted = True
        rows.append([icon, _text(name), _text(status or "ran"), _dur(stage.get("seconds"))])
    if counted:
        rows.append(["", "**total**", "", f"**{_dur(total)}**"])
    return _table(["", "stage", "result", "wall time"], rows)


def _render(inputs: Inputs, detail: Detail, note: str | None = None) -> str:
    sections = [
        env_section(inputs, detail),
        build_section(inputs, detail),
        gates_section(inputs, detail),
        bench_section(inputs, detail),
    ]
    lines = [verdict(sections, inputs), MARKER, ""]
    facts = env_facts(inputs.env)
    if facts:
        lines += [" · ".join(facts), ""]
    if note:
        lines += [note, ""]
    if inputs.unreadable:
        lines += [
            "> **Unreadable inputs:** "
            + "; ".join(
                f"`{_text(name)}`: {_text(why, 160)}" for name, why in inputs.unreadable.items()
            ),
            "",
        ]
    lines += [summary_table(sections, inputs), ""]
    ran = [s for s in sections if s.severity != NOTRUN]
    for section in sorted(ran, key=lambda s: -s.severity):  # stable: failures first, then warnings
        is_open = " open" if section.severity >= WARN else ""
        lines += [
            f"<details{is_open}><summary>{ICONS[section.severity]} <b>{section.title}</b>: {section.summary}</summary>",
            "",
            section.body,
            "",
            "</details>",
            "",
        ]
    not_run = [s for s in sections if s.severity == NOTRUN]
    if not_run:
        lines += [
            "**Not run:** " + ", ".join(f"{s.title.lower()} ({s.body})" for s in not_run) + ".",
            "",
        ]
    footer = "Reproduce locally: `nox -s env build test bench report`."
    if inputs.run_url:
        footer += f" All inputs of this report are in the `reports/` artifact of [this run]({inputs.run_url})."
    lines.append(f"<sub>{footer}</sub>")
    return "\n".join(lines).rstrip("\n") + "\n"


def _truncation_note(detail: Detail) -> str:
    omitted = list(dict.fromkeys(detail.omitted))  # unique, in order
    return (
        f"> ✂️ **Truncated** to fit GitHub's {MAX_CHARS:,}-character comment limit; not shown: "
        + ", ".join(omitted)
        + ". The full data is in the run's `reports/` artifact."
    )


def _render_with(inputs: Inputs, detail: Detail) -> str:
    """Render once to learn what this level of detail omits, then again with the note in place."""
    probe = dataclasses.replace(detail, omitted=[])
    _render(inputs, probe)
    final = dataclasses.replace(detail, omitted=[])
    note = _truncation_note(probe) if probe.omitted else None
    return _render(inputs, final, note)


def render(inputs: Inputs, budget: int = BUDGET) -> tuple[str, bool]:
    """The report, cut down until it fits in `budget` UTF-8 bytes. Returns (text, truncated)."""
    text = _render(inputs, Detail())
    if _size(text) <= budget:
        return text, False
    detail = Detail(passing=False)
    text = _render_with(inputs, detail)
    if _size(text) <= budget:
        return text, True
    n_bench = len([c for c in (inputs.bench or {}).get("cases") or [] if isinstance(c, dict)])
    detail.bench_rows = _largest(
        lambda n: _size(_render_with(inputs, dataclasses.replace(detail, bench_rows=n))) <= budget,
        n_bench,
    )
    text = _render_with(inputs, detail)
    if _size(text) <= budget:
        return text, True
    n_fail = len(
        [
            c
            for c in (inputs.gates or {}).get("cases") or []
            if isinstance(c, dict) and _case_failed(c)
        ]
    )
    detail.failing_cases = _largest(
        lambda k: (
            _size(_render_with(inputs, dataclasses.replace(detail, failing_cases=k))) <= budget
        ),
        n_fail,
    )
    text = _render_with(inputs, detail)
    if _size(text) <= budget:
        return text, True
    return _hard_cut(text, budget), True


def _largest(fits, upper: int) -> int:
    """The largest n in [0, upper] with fits(n), assuming fits is monotone; 0 if none."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _hard_cut(text: str, budget: int) -> str:
    """Last resort: keep whole lines up to the budget, then close what is open and say so."""
    note = f"\n\n> ✂️ **Cut here** to fit GitHub's {MAX_CHARS:,}-character comment limit; the full data is in the run's `reports/` artifact.\n"
    kept: list[str] = []
    used = _size(note) + 200  # room for the closing fence and tags
    fence: str | None = None
    open_details = 0
    for line in text.splitlines():
        cost = _size(line) + 1
        if used + cost > budget:
            break
        kept.append(line)
        used += cost
        stripped = line.strip()
        if re.match(r"^`{3,}", stripped):
            ticks = re.match(r"^`+", stripped).group(0)
            if fence is None:
                fence = ticks
            elif stripped == fence:
                fence = None
        elif fence is None:
            open_details += stripped.count("<details") - stripped.count("</details>")
    tail = []
    if fence:
        tail.append(fence)
    tail += ["", "</details>"] * max(0, min(open_details, 20))
    return "\n".join(kept + tail) + note


def _run_url() -> str | None:
    server, repo, run = (
        os.environ.get(k) for k in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_RUN_ID")
    )
    if server and repo and run:
        return f"{server}/{repo}/actions/runs/{run}"
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science report",
        description="Render the run's artifacts (env.json, build.json, gates.json, bench.json, stages.json) "
        "into one markdown report, report.md, for the PR comment and the job summary.",
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="the report folder to read (default: reports/)"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="where to write (default: DIR/report.md)"
    )
    parser.add_argument(
        "--base-build",
        type=Path,
        default=None,
        metavar="PATH",
        help="the base branch's build.json: flag new register spills and resource changes against it",
    )
    parser.add_argument(
        "--max-chars",
        type=int,
        default=BUDGET,
        help=f"size budget in UTF-8 bytes (default {BUDGET}: GitHub's {MAX_CHARS} less room for the comment header)",
    )
    parser.add_argument(
        "--no-step-summary",
        action="store_true",
        help="do not append to $GITHUB_STEP_SUMMARY even when it is set",
    )
    return parser


def main(argv: Iterable[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    directory = args.dir if args.dir is not None else report_dir()
    if not directory.is_dir():
        print(
            f"report: {directory} is not a folder; fix: pass --dir to the folder holding env.json etc.",
            file=sys.stderr,
        )
        return exitcodes.USAGE
    inputs = load_inputs(directory, args.base_build)
    inputs.run_url = _run_url()
    text, truncated = render(inputs, min(args.max_chars, MAX_CHARS))
    output = args.output or directory / "report.md"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(
            f"report: cannot write {output}: {exc}; fix: pass --output to a writable path",
            file=sys.stderr,
        )
        return exitcodes.USAGE
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path and not args.no_step_summary:
        try:
            with open(summary_path, "a", encoding="utf-8") as handle:
                handle.write(text + "\n")
        except OSError as exc:  # the summary is a convenience; the report file is what counts
            print(f"report: cannot append to $GITHUB_STEP_SUMMARY ({exc})", file=sys.stderr)
    headline = text.splitlines()[0].lstrip("# ")
    print(
        f"report: {headline} -> {output} ({len(text):,} chars{', truncated' if truncated else ''})"
    )
    for name, why in inputs.unreadable.items():
        print(
            f"report: {name} is unreadable ({why}); fix: rerun the stage that writes it",
            file=sys.stderr,
        )
    return exitcodes.USAGE if inputs.unreadable else exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
