"""What every section of the report is made of, and the sections every stage can fall back to:
not run, unreadable, stale, or failed before writing its record."""

from __future__ import annotations

import dataclasses

from .. import markdown as md
from .inputs import Inputs, stage_status

# Severities, in the order the report sorts by (worst last). NOTE: ran and passed, with a caveat
# the verdict repeats (a bench with nothing to compare with); STALE: the record describes other code
# or another run, so it says nothing about this one.
OK, NOTE, NOTRUN, WARN, STALE, FAIL = 0, 1, 2, 3, 4, 5
# NOTE is the information sign.
# The stages a leg that reuses main's verdict does not run (ci/selection.py, gpu-ci.yml).
REUSE_SKIPS = ("build", "test", "bench")
ICONS = {OK: "✅", NOTE: "\u2139\ufe0f", NOTRUN: "⏭️", WARN: "⚠️", STALE: "🕰️", FAIL: "❌"}


@dataclasses.dataclass
class Detail:
    """How much of the report to render; the truncation loop lowers these until it fits."""

    passing: bool = True  # passing env checks, passing gate groups, passing kernels' table rows
    bench_rows: int | None = None  # None: all
    failing_cases: int | None = None  # None: all
    omitted: list[str] = dataclasses.field(default_factory=list)
    # The trusted header; off for a GPU kind's section of the one PR comment, which has it on top.
    header: bool = True


@dataclasses.dataclass
class Section:
    key: str  # the stage it belongs to: env, build, test, bench
    title: str
    severity: int
    summary: str  # one line for the summary table
    body: str = ""
    problems: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # for the verdict


def unreadable_section(key: str, title: str, label: str, why: str) -> Section:
    return Section(
        key,
        title,
        FAIL,
        f"{label} unreadable",
        f"`{label}` exists but cannot be used: {md.text(why)}",
        [(FAIL, f"{label} unreadable")],
    )


def stale_section(key: str, title: str, label: str, why: str) -> Section:
    """A record left by other code or another run: named as such, its figures not shown."""
    body = (
        f"`{label}` is {md.text(why)}. Its figures describe other code or another run, so they are "
        f"not shown and count for nothing here. Fix: rerun this stage in the same run as the report "
        f"(`nox -s {key} report`, or the whole `nox -s env build test bench report`), or delete "
        f"`reports/{label}`."
    )
    return Section(key, title, STALE, f"STALE: {md.text(why)}", body, [(STALE, f"stale {label}")])


def not_run(key: str, title: str, missing: str) -> Section:
    """A stage that left nothing behind: its body is the file it would have written."""
    return Section(key, title, NOTRUN, "not run", f"no `{missing}`")


def absent(inputs: Inputs, key: str, title: str, missing: str, problem: str, body: str) -> Section:
    """The section of a stage whose record is missing, by what stages.json says of this run:
    failed or killed (a failure), ran and wrote nothing (a warning), skipped, or not run."""
    status = stage_status(inputs, key)
    if status in ("fail", "error", "interrupted"):
        return Section(
            key, title, FAIL, f"failed before writing {missing}", body, [(FAIL, problem)]
        )
    if status == "running":
        return Section(
            key,
            title,
            FAIL,
            "did not finish (killed, timed out, or still running)",
            f"The {key} stage started but never recorded an end, and left no `{missing}`; see the "
            "job log.",
            [(FAIL, f"{key} did not finish")],
        )
    if status == "ok":
        return Section(
            key,
            title,
            WARN,
            f"ran, but wrote no {missing}",
            f"The {key} stage exited 0 without writing `{missing}`; see the job log.",
            [(WARN, f"{key} wrote no {missing}")],
        )
    if status == "skip":
        return Section(key, title, NOTRUN, "skipped (a tool is missing)", f"no `{missing}`")
    reused = (inputs.selection or {}).get(
        "mode"
    ) == "reuse" and "selection.json" not in inputs.stale
    if reused and key in REUSE_SKIPS:
        return Section(
            key, title, NOTRUN, "not run: main's verdict reused", "main's verdict reused"
        )
    return not_run(key, title, missing)
