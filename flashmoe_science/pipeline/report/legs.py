"""The one PR comment of a GPU CI run with a leg per GPU kind (pipeline.gpukinds): each leg's
artifact (gpu-ci-reports-KIND/) rendered as its own report, put together as

    line 1   the verdict over all kinds: `## ❌ flashmoe-science: h100 failed, l4 passed`
    line 2   MARKER
    then     one verdict line per GPU kind (in KINDS order), the trusted header once, then one
             <details> section per kind holding that leg's report (open when it did not pass)

Every kind of KINDS gets its line: a leg with no artifact shows as missing, a leg whose job did
not succeed (the run's jobs, from the API: `--jobs`) as failed whatever its records say, and a
leg whose records come from another card than its label promises as a warning. None of these is
ever a pass. Each leg's records must carry its own run id (gpukinds.leg_run_id), so one leg's
files never pass for another's, and its history is main's runs of its kind only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import gpukinds
from .. import markdown as md
from ..bench import trend
from ..ci.runartifacts import FETCH_NOTES
from .inputs import Inputs, load_inputs
from .render import MARKER, hard_cut, render, verdict
from .sections import FAIL, ICONS, NOTE, NOTRUN, OK, STALE, WARN
from .trusted import trusted_header

MAX_JOBS_BYTES = 1 << 20
# A kind's result in the comment's first line, by the severity of its verdict.
WORDS = {
    OK: "passed",
    NOTE: "passed",
    NOTRUN: "not run",
    WARN: "warned",
    STALE: "stale",
    FAIL: "failed",
}
VERDICT_CHARS = 1_000  # of a leg's verdict line
LEG_OVERHEAD = 600  # bytes around a leg's report, its verdict lines and <details>, most of the time
MIN_SHARE = 2_000  # bytes of a leg's report below which it is only its verdict and stage table


@dataclasses.dataclass
class Leg:
    kind: gpukinds.GpuKind
    inputs: Inputs | None  # None: the run has no artifact of this leg
    job: str | None  # the leg job's conclusion from the API; None when unknown


@dataclasses.dataclass
class LegVerdict:
    severity: int
    text: str  # one line, escaped
    body: str  # the leg's report without its verdict and marker lines; "" when none


def read_jobs(path: Path) -> dict[str, str]:
    """The run's jobs as `gh api ... --jq '.jobs[] | [.name, .conclusion // .status] | @tsv'`
    writes them: name -> result, one a line."""
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_JOBS_BYTES:
        raise ValueError(f"{path} is not a regular file under {MAX_JOBS_BYTES} bytes")
    jobs = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        name, _, result = line.partition("\t")
        if name.strip():
            jobs[name.strip()] = result.strip() or "running"
    return jobs


def load_legs(
    folder: Path,
    *,
    tested_sha: str | None,
    run_id: str | None,
    jobs: dict[str, str] | None,
    history: Path | None,
) -> tuple[list[Leg], list[str]]:
    """(a Leg per kind of KINDS, notes on what else the folder holds). `folder` holds the run's
    artifacts as download-artifact writes a pattern's: one gpu-ci-reports-KIND/ per leg."""
    commit = {"sha": tested_sha, "dirty": False, "fingerprint": None} if tested_sha else None
    legs, notes = [], []
    for kind in gpukinds.KINDS.values():
        directory = folder / gpukinds.artifact_name(kind.label)
        job = None if jobs is None else jobs.get(gpukinds.job_name(kind.label), "missing")
        if directory.is_symlink() or not directory.is_dir():
            legs.append(Leg(kind, None, job))
            continue
        inputs = load_inputs(
            directory,
            commit=commit,
            run_id=gpukinds.leg_run_id(run_id, kind.label) if run_id else None,
        )
        inputs.gpu_kind = kind.label
        inputs.artifact = gpukinds.artifact_name(kind.label)
        if history is not None:
            inputs.history, skipped = trend.load_points(history / kind.label)
            inputs.notes += [f"history point skipped: {why}" for why in skipped[:3]]
        legs.append(Leg(kind, inputs, job))
    notes_file = folder / FETCH_NOTES
    if notes_file.is_file() and not notes_file.is_symlink():
        with notes_file.open(encoding="utf-8", errors="replace") as handle:
            lines = handle.read(MAX_JOBS_BYTES).splitlines()
        notes += [md.text(line, 400) for line in lines if line.strip()][:10]
    known = {gpukinds.artifact_name(kind) for kind in gpukinds.KINDS} | {FETCH_NOTES}
    others = (
        sorted(p.name for p in folder.iterdir() if p.name not in known) if folder.is_dir() else []
    )
    if others:
        notes.append(
            "not a GPU kind's artifact, not read: " + ", ".join(md.code(n, 80) for n in others[:5])
        )
    return legs, notes


def job_said(result: str) -> str:
    """A leg job's result from the jobs API, in words."""
    known = {
        "success": "its job passed",
        "failure": "its job failed",
        "cancelled": "its job was cancelled",
        "timed_out": "its job timed out",
        "skipped": "its job was skipped",
        "missing": "no job of this leg in the run",
        "running": "its job has not finished",
    }
    return known.get(result, f"its job ended {md.text(result, 30)}")


def device_problem(kind: gpukinds.GpuKind, inputs: Inputs) -> str | None:
    """Why the leg's env.json describes a card of another kind (its name, or its compute
    capability where it gives one); None when it matches or names no card."""
    gpu = (inputs.env or {}).get("gpu") if "env.json" not in inputs.stale else None
    name = gpu.get("name") if isinstance(gpu, dict) else None
    if not isinstance(name, str) or not name:
        return None
    capability = gpu.get("capability")
    if isinstance(capability, str) and capability:
        return kind.device_problem(name, capability.removeprefix("sm_"))
    return None if kind.matches(name) else f"{name} is not an {kind.card}"


def leg_verdict(leg: Leg, budget: int) -> tuple[LegVerdict, bool]:
    """The leg's verdict and its report's body within `budget` bytes; (verdict, truncated)."""
    if leg.inputs is None:
        artifact = md.code(gpukinds.artifact_name(leg.kind.label))
        if leg.job is None:
            text = f"no report: the leg did not run, or uploaded no {artifact}"
        else:
            text = f"no report: {job_said(leg.job)}, and there is no {artifact}"
        return LegVerdict(FAIL, text, ""), False
    text, truncated = render(leg.inputs, budget, header=False)
    # the body only: the verdict comes as data, not from parsing its line back
    rest = text.partition("\n")[2].removeprefix(MARKER + "\n").lstrip("\n")
    records = verdict(leg.inputs)
    severity, said = records.severity, records.sentence
    moved = leg.inputs.head_sha and leg.inputs.tested_sha != leg.inputs.head_sha
    if leg.inputs.stale or leg.inputs.stale_stages or moved:
        # another commit's, run's or leg's records, or a head the run did not test: say so
        severity = max(severity, STALE)
    problems = []
    if leg.job is not None and leg.job != "success":
        problems.append(job_said(leg.job))
        severity = FAIL
    wrong_card = device_problem(leg.kind, leg.inputs)
    if wrong_card:
        problems.append(f"ran on the wrong card: {md.text(wrong_card, 120)}")
        severity = max(severity, WARN)
    if problems:
        said = "; ".join(problems) + (f" (its records: {said})" if said else "")
    if leg.job is None:
        said += " (the job's own result was not read)"
    if len(said) > VERDICT_CHARS:
        said = said[: VERDICT_CHARS - 1] + "…"
    return LegVerdict(severity, said, rest), truncated


def _kind_label(kind: gpukinds.GpuKind) -> str:
    return f"**{kind.label}** ({kind.card}, {kind.sm})"


def _assemble(legs: list[Leg], verdicts: list[LegVerdict], top: str, notes: list[str]) -> str:
    worst = max(v.severity for v in verdicts)
    summary = ", ".join(
        f"{leg.kind.label} {WORDS[v.severity]}" for leg, v in zip(legs, verdicts, strict=True)
    )
    lines = [f"## {ICONS[worst]} flashmoe-science: {summary}", MARKER, ""]
    lines += [
        f"- {ICONS[v.severity]} {_kind_label(leg.kind)}: {v.text}"
        for leg, v in zip(legs, verdicts, strict=True)
    ]
    lines.append("")
    if top:
        lines += [top, ""]
    lines += [f"> **Note:** {note}" for note in notes]
    if notes:
        lines.append("")
    for leg, v in zip(legs, verdicts, strict=True):
        if not v.body:
            continue
        is_open = " open" if v.severity >= WARN else ""
        lines += [
            f"<details{is_open}><summary>{ICONS[v.severity]} <b>{leg.kind.label}</b> "
            f"({leg.kind.card}, {leg.kind.sm}): {WORDS[v.severity]}</summary>",
            "",
            v.body.rstrip("\n"),
            "",
            "</details>",
            "",
        ]
    return "\n".join(lines).rstrip("\n") + "\n"


def render_legs(
    legs: list[Leg], header: Inputs, budget: int, notes: list[str] = ()
) -> tuple[str, bool]:
    """The one comment over all legs, within `budget` UTF-8 bytes; (text, truncated). Each leg
    with records gets an equal share of what the rest leaves; a share another leg leaves unused
    goes to the legs that were cut."""
    top = trusted_header(header)
    notes = list(notes)
    present = sum(leg.inputs is not None for leg in legs) or 1
    fixed = md.size(top) + sum(md.size(n) + 20 for n in notes) + 200 + LEG_OVERHEAD * len(legs)
    share = max(MIN_SHARE, (budget - fixed) // present)
    best: tuple[str, bool] | None = None
    for _ in range(3):
        rendered = [leg_verdict(leg, share) for leg in legs]
        verdicts = [verdict for verdict, _ in rendered]
        cut = any(truncated for _, truncated in rendered)
        text = _assemble(legs, verdicts, top, notes)
        size = md.size(text)
        if size <= budget:
            best = (text, cut)
            if not cut or budget - size < 500:
                break
            share += (budget - size) // present  # the slack to the legs that were cut
        else:
            share = max(MIN_SHARE, share - (size - budget) // present - 200)
    if best is None:  # the shares are estimates: never post over the limit
        return hard_cut(text, budget), True
    return best
