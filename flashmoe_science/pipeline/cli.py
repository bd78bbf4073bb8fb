"""`python -m flashmoe_science COMMAND ...` (or the `flashmoe-science` command): the one entry point
that nox sessions, the workflows and scripts call. Each command lives in its own module; exit codes
follow flashmoe_science.pipeline.exitcodes.

`--reports-dir DIR`, before or after the command, names the report folder for that command and the
processes it starts (it sets paths.REPORTS_VAR); without it, paths.report_dir() decides.

Every stage command is timed here, once, into stages.json (flashmoe_science.pipeline.stages), with a
status from its exit code. `report` is not: it renders stages.json, and cannot time itself into its
own output; the job's total covers it."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from . import exitcodes, paths, stages

CONSOLE_SCRIPT = "flashmoe-science"  # pyproject.toml's [project.scripts]
REPORTS_OPTION = "--reports-dir"

COMMANDS = {
    "env": (
        "flashmoe_science.pipeline.env.checks",
        "validate the environment (Python, torch, CUDA, nvcc, GPU, NumPy, ...)",
    ),
    "select": (
        "flashmoe_science.pipeline.ci.selection",
        "GPU CI: the full matrix, or main's verdict when no gate input changed",
    ),
    "build": (
        "flashmoe_science.pipeline.build.unit",
        "build the extension as one compilation unit",
    ),
    "test": (
        "flashmoe_science.pipeline.gates.testing",
        "build incrementally, then run the correctness gates (bisect-safe)",
    ),
    "bench": (
        "flashmoe_science.pipeline.bench.run",
        "time the kernels against PyTorch SDPA; --base REF compares commits",
    ),
    "report": (
        "flashmoe_science.pipeline.report",
        "render reports/*.json into reports/report.md (PR comment, job summary)",
    ),
    "sanitize": (
        "flashmoe_science.pipeline.tools.sanitize",
        "compute-sanitizer's tools over every kernel path",
    ),
    "profile": (
        "flashmoe_science.pipeline.tools.profile",
        "Nsight Compute on one bench case: what bounds it",
    ),
    "phases": (
        "flashmoe_science.pipeline.tools.phases",
        "the sm_90a forward's time per tile, phase by phase (a traced build)",
    ),
}


def program() -> str:
    """The name the user called us by: the console script's, else `python -m flashmoe_science`."""
    called = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return CONSOLE_SCRIPT if called == CONSOLE_SCRIPT else "python -m flashmoe_science"


def usage() -> str:
    me = program()
    lines = [f"usage: {me} [{REPORTS_OPTION} DIR] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [
        "",
        "options:",
        f"  {REPORTS_OPTION} DIR  where the commands write and `report` reads (default: "
        f"${paths.REPORTS_VAR}, else reports/ of the checkout, else ./reports)",
        "",
        f"Run `{me} COMMAND --help` for a command's options.",
    ]
    return "\n".join(lines)


def take_reports_dir(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without `--reports-dir DIR` (or `--reports-dir=DIR`), and DIR; options after `--`
    belong to another program and stay. Raises ValueError for the option without a folder."""
    rest, chosen = [], None
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            rest += argv[index:]
            break
        if arg == REPORTS_OPTION or arg.startswith(REPORTS_OPTION + "="):
            value = arg.partition("=")[2] if "=" in arg else None
            if value is None:
                index += 1
                value = argv[index] if index < len(argv) else ""
            if not value or value.startswith("-"):
                raise ValueError(
                    f"{REPORTS_OPTION} needs a folder, e.g. {REPORTS_OPTION} ./reports"
                )
            chosen = value
        else:
            rest.append(arg)
        index += 1
    return rest, chosen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        argv, reports = take_reports_dir(argv)
    except ValueError as exc:
        print(f"{program()}: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    if reports is not None:  # the environment carries it to the processes a command starts
        os.environ[paths.REPORTS_VAR] = str(Path(reports).expanduser().resolve())
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return exitcodes.OK if argv else exitcodes.USAGE
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{program()}: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return exitcodes.USAGE
    # help and listings run nothing: no stage row (a listing would replace the run's own); nor
    # do a background run's start and wait (its child records the run's own row)
    if name not in stages.ORDER or {"-h", "--help", "--list", "--background", "--wait"} & set(rest):
        return _run(name, rest)
    with stages.timed_stage(name) as stage:
        stage.exit_code = _run(name, rest)
    return stage.exit_code


def _run(name: str, rest: list[str]) -> int:
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ImportError as exc:  # torch missing or broken: the machine is at fault, not the commit
        print(f"flashmoe_science {name}: cannot import {exc.name or exc}: {exc}", file=sys.stderr)
        print(
            "  fix: run scripts/setup_environment.sh (or activate the environment that holds torch)",
            file=sys.stderr,
        )
        return exitcodes.ENV_BROKEN
    return int(module.main(rest) or 0)
