"""`python -m flashmoe_science report`: one markdown report of a pipeline run, for the PR comment and
the job summary.

It reads what the other commands left in the report folder (flashmoe_science.pipeline.paths.report_dir()):
env.json, build.json (or a build.log tail when the build failed), gates.json, bench.json and
stages.json, and writes report.md there. A missing file renders as "not run", never as an error.

    line 1   the verdict: `## ✅ flashmoe-science: passed`, `## ❌ flashmoe-science: 3 gates failed`, ...
    line 2   MARKER, a hidden line by which the PR comment is found and updated in place
    then     the commit (and run) the report describes, a summary table (one row per stage, with
             wall times and the job's total), then one <details> section per stage, failing
             sections first and open, passing ones closed

Every record carries its provenance (flashmoe_science.pipeline.provenance). One from another commit,
from another run (when FLASHMOE_RUN_ID is set), or without provenance is STALE: named with both
commits, its figures not shown, and the verdict is never a pass.

The report stays under GitHub's 65,536-character comment limit: passing details go first, then
benchmark rows, then failing-case details, and the report says what it left out. With
$GITHUB_STEP_SUMMARY set, the report is appended to the job summary too.

Exit status: 0 whatever the verdict (the verdict is data; the workflow decides what fails), 2 when
an input cannot be used: it exists but cannot be read or parsed, does not match its schema, or is
stale (the report is still written, and names it). Rerun the stage that writes it.

Modules: inputs (reading and provenance), sections (the shared pieces), one module per section,
render (verdict, stage table, size limit). Markdown helpers live in flashmoe_science.pipeline.markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from .. import exitcodes, stages
from ..markdown import TIMES
from ..paths import report_dir
from .inputs import Inputs, load_inputs
from .render import BUDGET, MARKER, MAX_CHARS, render, run_url
from .sections import ICONS, NOTE

__all__ = [
    "BUDGET",
    "ICONS",
    "MARKER",
    "MAX_CHARS",
    "NOTE",
    "TIMES",
    "Inputs",
    "load_inputs",
    "main",
    "render",
]


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
    output = args.output or directory / "report.md"
    with contextlib.suppress(OSError):  # a report that fails to render must not leave an older one
        output.unlink()
    start = stages.job_start()
    job = stages.job_seconds(start)
    inputs = load_inputs(directory, args.base_build, job_seconds=job)
    if os.environ.get(stages.JOB_START_VAR) and job is None:
        inputs.notes.append(
            f"{stages.JOB_START_VAR}={os.environ[stages.JOB_START_VAR]!r} is not this job's start "
            "(not epoch seconds, in the future, or days ago): the total is the sum of the stages"
        )
    inputs.run_url = run_url()
    text, truncated = render(inputs, min(args.max_chars, MAX_CHARS))
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
    stale = {
        **inputs.stale,
        **{f"the {name} stage": why for name, why in inputs.stale_stages.items()},
    }
    for name, why in stale.items():
        print(
            f"report: {name} is stale ({why}); fix: rerun its stage in this run",
            file=sys.stderr,
        )
    return exitcodes.USAGE if inputs.unreadable or stale else exitcodes.OK
