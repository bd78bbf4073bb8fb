"""`python -m flashmoe_science report`: one markdown report of a pipeline run, for the PR comment and
the job summary.

It reads what the other commands left in the report folder (flashmoe_science.pipeline.paths.report_dir()):
env.json, selection.json (GPU CI: the full matrix or main's verdict reused), build.json (or a
build.log tail when the build failed), gates.json, bench.json,
sanitize.json (each compute-sanitizer tool's result and what it does not check of the Hopper
features) and stages.json, and writes report.md there. A missing file renders as "not run", never as an error.

    line 1   the verdict: `## ✅ flashmoe-science: passed`, `## ❌ flashmoe-science: 3 gates failed`, ...
    line 2   MARKER, a hidden line by which the PR comment is found and updated in place
    then     the commit (and run) the report describes, a summary table (one row per stage, with
             wall times and the job's total), the job's critical path, then one <details>
             section per stage, failing sections first and open, passing ones closed

Every record carries its provenance (flashmoe_science.pipeline.provenance). One from another commit,
from another run (when FLASHMOE_RUN_ID is set), or without provenance is STALE: named with both
commits, its figures not shown, and the verdict is never a pass.

The report stays under GitHub's 65,536-character comment limit: passing details go first, then
benchmark rows, then failing-case details, and the report says what it left out. With
$GITHUB_STEP_SUMMARY set, the report is appended to the job summary too.

Whatever the records hold (they may come from a pull request's code), the report stays bounded
and escaped: every record is checked against its schema (report.schemas, benches/bench.schema.json)
and its size and nesting, no file is read from a path a record names, each section fails alone,
and the verdict (its problems named up to a count) and the marker are always lines 1 and 2.
Nothing from the records reaches the command's own output unescaped.

The privileged job that comments on pull requests (pr-report.yml) renders with the default
branch's code from the run's artifact: --tested-sha (the commit it verified the run tested; the
records must describe it), --run-id, --run-url, --head-sha (the PR's head now: a newer one makes
the verdict stale), --changed-files (the PR's changed paths: a warning when they include the CI or
the report code) and --history (main's stored benchmark points, pipeline.bench.trend). With --legs
(a folder of the run's artifacts, one gpu-ci-reports-KIND/ per GPU kind) and --jobs (the run's
jobs and their results), it renders the one comment over every leg instead (report.legs): a
verdict line per GPU kind, then each kind's report; --history then holds one folder per kind.

Exit status: 0 whatever the verdict (the verdict is data; the workflow decides what fails), 2 when
an input cannot be used: it exists but cannot be read or parsed, does not match its schema, or is
stale (the report is still written, and names it). Rerun the stage that writes it.

Modules: inputs (reading and provenance), sections (the shared pieces), one module per section,
render (verdict, stage table, size limit), legs (the comment over the GPU kinds). Markdown helpers live in flashmoe_science.pipeline.markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from .. import exitcodes, stages
from .. import markdown as md
from ..bench import trend
from ..cli import program
from ..markdown import TIMES
from ..paths import report_dir
from .inputs import Inputs, load_inputs
from .legs import load_legs, read_jobs, render_legs
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
        prog=f"{program()} report",
        description="Render the run's artifacts (env.json, build.json, gates.json, bench.json, stages.json) "
        "into one markdown report, report.md, for the PR comment and the job summary.",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the report folder to read (default: --reports-dir or $FLASHMOE_REPORTS_DIR, else "
        "reports/ of the checkout)",
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
        "--tested-sha",
        default=None,
        metavar="SHA",
        help="the commit the run tested, as verified by the caller: the records must describe it "
        "(default: this checkout)",
    )
    parser.add_argument(
        "--head-sha",
        default=None,
        metavar="SHA",
        help="the pull request's head now; one other than --tested-sha makes the verdict stale",
    )
    parser.add_argument(
        "--run-id",
        default=None,
        help="the run the records must come from (default: $FLASHMOE_RUN_ID)",
    )
    parser.add_argument(
        "--run-url", default=None, help="the run's page (default: from $GITHUB_* variables)"
    )
    parser.add_argument(
        "--changed-files",
        type=Path,
        default=None,
        metavar="FILE",
        help="the pull request's changed paths, one a line: warn when CI or report code changed",
    )
    parser.add_argument(
        "--history",
        type=Path,
        default=None,
        metavar="DIR",
        help="main's stored benchmark points (pipeline.bench.trend): add the performance history",
    )
    parser.add_argument(
        "--legs",
        type=Path,
        default=None,
        metavar="DIR",
        help="the run's artifacts, one gpu-ci-reports-KIND folder per GPU kind: one comment over "
        "all kinds (instead of --dir)",
    )
    parser.add_argument(
        "--jobs",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --legs: the run's jobs, one `NAME<TAB>RESULT` a line (a leg whose job did not "
        "succeed is a failure)",
    )
    parser.add_argument(
        "--no-step-summary",
        action="store_true",
        help="do not append to $GITHUB_STEP_SUMMARY even when it is set",
    )
    return parser


def _safe(value: object, limit: int = 300) -> str:
    """A value from the records for the command's output: one line, no `::` a CI runner would
    take for a workflow command."""
    return md.flat(value, limit).replace("::", ": :")


def main(argv: Iterable[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.legs is not None and (args.dir is not None or args.base_build is not None):
        parser.error("--legs reads every leg's folder itself: drop --dir and --base-build")
    if args.jobs is not None and args.legs is None:
        parser.error("--jobs goes with --legs (the legs' jobs)")
    directory = args.dir if args.dir is not None else args.legs or report_dir()
    if not directory.is_dir() and args.legs is None:  # --legs: no folder is every leg missing
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
    sha_ok = re.compile(r"^[0-9a-f]{40}$")
    for option in ("tested_sha", "head_sha"):
        value = getattr(args, option)
        if value is not None and not sha_ok.match(value):
            print(
                f"report: --{option.replace('_', '-')} wants a full commit id (40 hex digits), "
                f"not {_safe(value, 60)!r}",
                file=sys.stderr,
            )
            return exitcodes.USAGE
    changed = None
    if args.changed_files is not None:
        try:
            lines = args.changed_files.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            print(f"report: --changed-files: {_safe(exc)}", file=sys.stderr)
            return exitcodes.USAGE
        changed = [line.strip() for line in lines if line.strip()]
    if args.legs is not None:
        return _main_legs(args, output, changed)
    tested = {"sha": args.tested_sha, "dirty": False, "fingerprint": None}
    inputs = load_inputs(
        directory,
        args.base_build,
        commit=tested if args.tested_sha else None,
        run_id=args.run_id,
        job_seconds=job,
        job_start=start,
    )
    inputs.tested_sha, inputs.head_sha = args.tested_sha, args.head_sha
    inputs.changed_paths = changed
    if args.history is not None:
        inputs.history, skipped = trend.load_points(args.history)
        inputs.notes += [f"history point skipped: {why}" for why in skipped[:3]]
    if os.environ.get(stages.JOB_START_VAR) and job is None:
        inputs.notes.append(
            f"{stages.JOB_START_VAR}={os.environ[stages.JOB_START_VAR]!r} is not this job's start "
            "(not epoch seconds, in the future, or days ago): the total is the sum of the stages"
        )
    inputs.run_url = args.run_url or run_url()
    text, truncated = render(inputs, min(args.max_chars, MAX_CHARS))
    if not _write(text, truncated, output, args):
        return exitcodes.USAGE
    return _exit_status([inputs])


def _main_legs(args: argparse.Namespace, output: Path, changed: list[str] | None) -> int:
    """The one comment over every GPU kind's leg (report.legs)."""
    jobs = None
    if args.jobs is not None:
        try:
            jobs = read_jobs(args.jobs)
        except (OSError, ValueError) as exc:
            print(
                f"report: --jobs: {_safe(exc)}; the legs' job results are left out", file=sys.stderr
            )
    legs, notes = load_legs(
        args.legs,
        tested_sha=args.tested_sha,
        run_id=args.run_id,
        jobs=jobs,
        history=args.history,
    )
    url = args.run_url or run_url()
    for leg in legs:
        if leg.inputs is not None:
            leg.inputs.tested_sha, leg.inputs.head_sha = args.tested_sha, args.head_sha
            leg.inputs.run_url = url
            leg.inputs.changed_paths = changed  # each leg's selection is checked against them
    header = Inputs(tested_sha=args.tested_sha, run_url=url, changed_paths=changed)
    if jobs is None:
        notes.append("the run's jobs were not read: each leg is judged by its records alone")
    text, truncated = render_legs(legs, header, min(args.max_chars, MAX_CHARS), notes)
    if not _write(text, truncated, output, args):
        return exitcodes.USAGE
    return _exit_status([leg.inputs for leg in legs if leg.inputs is not None])


def _write(text: str, truncated: bool, output: Path, args: argparse.Namespace) -> bool:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(
            f"report: cannot write {output}: {exc}; fix: pass --output to a writable path",
            file=sys.stderr,
        )
        return False
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_path and not args.no_step_summary:
        try:
            with open(summary_path, "a", encoding="utf-8") as handle:
                handle.write(text + "\n")
        except OSError as exc:  # the summary is a convenience; the report file is what counts
            print(f"report: cannot append to $GITHUB_STEP_SUMMARY ({exc})", file=sys.stderr)
    headline = text.splitlines()[0].lstrip("# ")
    print(
        f"report: {_safe(headline, 400)} -> {output} ({len(text):,} chars"
        f"{', truncated' if truncated else ''})"
    )
    return True


def _exit_status(every: list[Inputs]) -> int:
    """2 when an input of any report was unreadable or stale (each named on stderr), else 0."""
    bad = False
    for inputs in every:
        bad |= _name_bad_inputs(inputs)
    return exitcodes.USAGE if bad else exitcodes.OK


def _name_bad_inputs(inputs: Inputs) -> bool:
    """Name on stderr each input that was unreadable or stale; whether there was one."""
    where = f" ({inputs.gpu_kind} leg)" if inputs.gpu_kind else ""
    for name, why in inputs.unreadable.items():
        print(
            f"report: {_safe(name)}{where} is unreadable ({_safe(why)}); fix: rerun the stage "
            "that writes it",
            file=sys.stderr,
        )
    stale = {
        **inputs.stale,
        **{f"the {name} stage": why for name, why in inputs.stale_stages.items()},
    }
    for name, why in stale.items():
        print(
            f"report: {_safe(name)}{where} is stale ({_safe(why)}); fix: rerun its stage in this run",
            file=sys.stderr,
        )
    return bool(inputs.unreadable or stale)
