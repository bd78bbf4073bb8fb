"""`python -m flashmoe_science COMMAND ...`: the one entry point that nox sessions, the workflows and
scripts call. Each command lives in its own module; exit codes follow flashmoe_science.pipeline.exitcodes.

Every stage command is timed here, once, into stages.json (flashmoe_science.pipeline.stages), with a
status from its exit code. `report` is not: it renders stages.json, and cannot time itself into its
own output; the job's total covers it."""

from __future__ import annotations

import importlib
import sys

from . import exitcodes, stages

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


def usage() -> str:
    lines = ["usage: python -m flashmoe_science COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `python -m flashmoe_science COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return exitcodes.OK if argv else exitcodes.USAGE
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"flashmoe_science: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return exitcodes.USAGE
    if name not in stages.ORDER or "-h" in rest or "--help" in rest:
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
