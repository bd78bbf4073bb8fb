"""`python -m flashmoe_science test` (and so `nox -s test`): build incrementally, then run the tests.

Exit codes follow the `git bisect run` contract (flashmoe_science.pipeline.exitcodes), one per
outcome of reports/gates.json (gate_plugin.OUTCOMES), so a bisect step is good only when gates ran
and passed:
  0   gates ran and every one passed, and so did every other selected test    -> good
      (or, with --no-gates-ok, the selected tests passed and none was a gate)
  1   a gate failed, or a test outside the gates failed                        -> bad
  125 this commit cannot be built                                              -> skipped
  255 not a verdict on this commit: no gate selected, every selected gate skipped (a CUDA case
      without a GPU), no test collected (-k matched nothing), pytest interrupted or unusable,
      no GPU where one is required, torch missing                              -> the bisect stops

Selections: `--gates` collects the gate module alone and keeps only the gates, so a test that is
not a gate cannot mark a bisect step bad; `--list` prints the gate ids (what `-k` selects) and runs
nothing: on a machine without a GPU only those it can run, unless `--all`. A selection of at most
SERIAL_MAX_TESTS tests runs in this process, in the one pytest session that collected it: starting
pytest-xdist workers (each imports torch and collects), or even one more process or session,
costs more than such a run. A larger one runs on pytest-xdist workers spread over every GPU of the
machine, one GPU each (devices.py); the whole suite (no -k, no paths) goes to them without being
collected here first. pytest runs with its plugin autoload off, so plugins installed in a reused
interpreter (pytest-benchmark, ...) stay out. FLASHMOE_TEST_TIME_LIMIT (seconds) stops a run on
workers that hangs, naming the tests it is stuck in and printing their stacks (timelimit.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from .. import exitcodes
from ..cli import program
from ..paths import REPO_ROOT, report_dir, require_gpu_from_env
from ..provenance import clear_outputs
from . import devices, timelimit
from . import plugin as gate_plugin
from .plugin import (
    ERROR,
    FAILED,
    GATES_SKIPPED_NEED_GPU,
    INTERRUPTED,
    NO_GATES_SELECTED,
    NO_TESTS_COLLECTED,
    PASSED,
    TESTS_FAILED_OUTSIDE_GATES,
)

# The gate matrix lives here; `--gates` collects nothing else.
GATE_MODULES = (
    "tests/gates/test_gates.py",
    "tests/gates/test_grad_gates.py",
    "tests/gates/test_varlen.py",
    "tests/gates/test_paged.py",
)
# At most this many selected tests run without pytest-xdist: each worker imports torch and collects
# before its first test, so a small selection is faster in one process on a few cores
# (benches/notes/harness.md, moved from code comments).
SERIAL_MAX_TESTS = 32
# Plugin autoload is off (PYTEST_DISABLE_PLUGIN_AUTOLOAD): the plugins the suite uses, by module.
# pytest-xdist's workers get the same arguments and environment, so they load it too; its other
# entry point (xdist.looponfail) serves only --looponfail.
PLUGINS = ("-p", "xdist.plugin")


def report_plugins() -> tuple[str, ...]:
    """pytest-instafail where it is installed (the test dependency group has it): each failure is
    printed with its traceback when it happens, not in the summary at the end, so a run stopped
    by a time limit still names what failed. Left out where it is missing (a GPU machine without
    it runs the suite as before)."""
    import importlib.util

    if importlib.util.find_spec("pytest_instafail") is None:
        return ()
    return ("-p", "pytest_instafail", "--instafail")


EXIT_CODES = {
    PASSED: exitcodes.OK,
    FAILED: exitcodes.GATE_FAILED,
    TESTS_FAILED_OUTSIDE_GATES: exitcodes.GATE_FAILED,
    NO_GATES_SELECTED: exitcodes.ENV_BROKEN,
    GATES_SKIPPED_NEED_GPU: exitcodes.ENV_BROKEN,
    NO_TESTS_COLLECTED: exitcodes.ENV_BROKEN,
    INTERRUPTED: exitcodes.ENV_BROKEN,
    ERROR: exitcodes.ENV_BROKEN,
}
NO_TESTS_EXIT = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
LIST_HINT = "`nox -s test -- --list` prints the gate ids"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{program()} test",
        description="Build (incrementally) and run the correctness gates and the other tests. "
        "Unknown options go to pytest, e.g. `-x`. Bisect with the gates alone: "
        "`git bisect run nox -s test -- --gates -k '<gate id>'`.",
        epilog="Paths under tests/ (tests/bench/, tests/gates/test_testing.py) collect those "
        "alone. Exit: 0 gates ran and passed; 1 a gate or another test failed; 125 no build; "
        "255 no verdict (no gate selected, every gate skipped for want of a GPU, nothing "
        "collected, pytest unusable). The outcome and counts land in reports/gates.json.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        default=require_gpu_from_env(),
        help="a missing GPU or CUDA build is an error, exit 255 (default: FLASHMOE_REQUIRE_GPU=1)",
    )
    parser.add_argument(
        "--workers",
        default=None,
        help="pytest-xdist workers, each pinned to one GPU in turn (default: none for a selection "
        f"of at most {SERIAL_MAX_TESTS} tests, else three per two CPU cores up to "
        f"{devices.MAX_WORKERS}, and at least one per GPU; the GPUs: ${devices.DEVICES_VAR}, "
        f"else ${devices.VISIBLE_VAR}, else every GPU)",
    )
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k: select by name")
    parser.add_argument(
        "--gates",
        action="store_true",
        help=f"run the gates alone ({', '.join(GATE_MODULES)}, tests marked `gate`): "
        "what a bisect wants",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the gate ids (narrowed by -k), one a line, and run nothing; without a GPU, "
        "only those that run here",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="with --list: the ids that need a GPU too, on a machine without one",
    )
    parser.add_argument(
        "--no-gates-ok",
        action="store_true",
        help="a selection without gates (e.g. -k test_api) exits 0 when its tests pass "
        "(default: 255, since it says nothing about correctness)",
    )
    return parser


def isolated_env(base: dict[str, str]) -> dict[str, str]:
    """`base` with pytest's plugin autoload off, so only PLUGINS and the suite's own load, and
    Python's output unbuffered: the stage's stdout is a pipe (nox, a CI log), where Python holds
    up to 8 KB back, so without it a failure that instafail prints at once would reach the log
    only when the run ends, which a run stopped by a time limit never does."""
    env = dict(base, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONUNBUFFERED="1")
    env.pop("PYTEST_PLUGINS", None)
    return env


# The run's slowest tests (5 s or more each, 20 at most) are listed at its end, so where the
# stage's time goes (planted-bug builds, the gate matrix, the training run) is in every job's log.
DURATIONS = ("--durations=20", "--durations-min=5")


# How the workers share the tests: idle workers steal queued tests from busy ones. The suite's
# durations run from milliseconds to many seconds (the planted-bug builds, the act runs), and
# xdist's default split left one worker finishing a long queue alone (benches/notes/harness.md v5.3).
DIST = ("--dist", "worksteal")


def pytest_command(targets: list[str], workers: str, pytest_args: list[str]) -> list[str]:
    """The stage's pytest run: our plugins, the report plugins, `workers` xdist workers sharing the
    tests by work stealing, the slowest tests listed at the end."""
    plugins = [*PLUGINS, *report_plugins()]
    dist = DIST if workers != "0" else ()
    return [
        sys.executable,
        "-m",
        "pytest",
        *plugins,
        *targets,
        "-n",
        workers,
        *dist,
        "-q",
        *DURATIONS,
        *pytest_args,
    ]


@dataclass
class Collected:
    """What a selection collects: pytest's exit status, the test count and the gate ids."""

    exit: int
    tests: int = 0
    gate_ids: list[str] = field(default_factory=list)
    gpu_ids: set[str] = field(default_factory=set)  # the gate ids marked `gpu`

    def pytest_collection_finish(self, session) -> None:
        self.tests = len(session.items)
        gates = [item for item in session.items if item.get_closest_marker(gate_plugin.MARKER)]
        self.gate_ids = [_gate_id(item) for item in gates]
        self.gpu_ids = {_gate_id(item) for item in gates if item.get_closest_marker("gpu")}


def _gate_id(item) -> str:
    return getattr(getattr(item, "callspec", None), "id", item.name)


def collect(pytest_args: list[str]) -> Collected:
    """Collect `pytest_args` in this process (torch is imported already) and run nothing."""
    collected = Collected(exit=-1)
    sink = io.StringIO()
    argv = [*PLUGINS, *pytest_args, "--collect-only", "-qq", "-p", "no:cacheprovider"]
    with (
        as_the_stage(isolated_env(dict(os.environ))),
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        collected.exit = int(pytest.main(argv, plugins=[collected]))
    return collected


@contextlib.contextmanager
def as_the_stage(env: dict[str, str]) -> Iterator[None]:
    """Inside, this process has `env` for its environment and the repository root for its working
    directory, as the stage's pytest runs; both restored on the way out."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.chdir(REPO_ROOT):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class HeldOutput(io.TextIOBase):
    """stdout for a session whose output is shown or dropped once it is known whether the session
    runs its tests (SmallRun): held until then, then written through to `target`, or dropped."""

    def __init__(self, target) -> None:
        super().__init__()
        self.target = target
        self.held: list[str] | None = []  # None once decided
        self.shown = True

    def decide(self, show: bool) -> None:
        if self.held is None:
            return
        held, self.held, self.shown = self.held, None, show
        if show:
            self.write("".join(held))
            self.flush()

    def write(self, text: str) -> int:
        if self.held is not None:
            self.held.append(text)
        elif self.shown:
            self.target.write(text)
        return len(text)

    def flush(self) -> None:
        if self.held is None and self.shown:
            self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self.target, "encoding", None) or "utf-8"


class SmallRun:
    """The plugin of the stage's session for a selection that is not the whole suite. Once it is
    collected, a selection of at most `limit` tests (or one that did not collect cleanly: the
    session shows why) runs in this session, after `announce(tests)`; a larger one runs nothing
    and shows nothing here (`too_many`), and the stage hands it to workers. One collection where
    the stage used to collect twice, to count and then to run: a bisect step of one gate case took
    4.9 CPU-s on 2 cores, 3.8 with one."""

    def __init__(self, limit: int, output: HeldOutput, announce: Callable[[int | None], None]):
        self.limit = limit
        self.output = output
        self.announce = announce
        self.too_many = False

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session) -> None:
        tests = len(session.items)
        if tests > self.limit and not session.testsfailed:
            self.too_many = True
            session.items = []
            self.output.decide(show=False)
        else:
            self.announce(None if session.testsfailed else tests)
            self.output.decide(show=True)


# pytest options that narrow a selection as -k and test paths do
NARROWING = ("-m", "--deselect", "--lf", "--last-failed", "--sw", "--stepwise", "--ignore")


def is_whole_suite(keyword: str | None, paths: list[str], pytest_args: list[str]) -> bool:
    """Whether the selection is every test (or every gate): far more than SERIAL_MAX_TESTS, so
    it runs on workers without being collected here first (on 2 cores that collection, torch and
    every test module imported, held the workers back by 8 s)."""
    narrowed = any(arg.startswith(NARROWING) for arg in pytest_args)
    return keyword is None and not paths and not narrowed


def run_here(
    pytest_argv: list[str],
    env: dict[str, str],
    plugins: list = (),
    stdout: HeldOutput | None = None,
) -> int:
    """Run pytest in this process, which has imported torch and the extension: a second process
    would do that again before its first test (2-4 s of a bisect step on 2 cores). `plugins` join
    the session and `stdout` takes its output. Output is line-buffered, as PYTHONUNBUFFERED makes
    a child's, so a failure reaches a piped log when instafail prints it."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)  # None: a stand-in stdout
    buffered = reconfigure is not None and not sys.stdout.line_buffering
    if buffered:
        reconfigure(line_buffering=True)
    # The gate plugin is this module's import: pytest cannot rewrite its asserts (package code,
    # not a test's) and would say so in every such run's summary.
    quiet = f"ignore:Module already imported so cannot be rewritten; {gate_plugin.__name__}"
    output = contextlib.redirect_stdout(stdout) if stdout else contextlib.nullcontext()
    try:
        with as_the_stage(env), output:
            return int(pytest.main(["-W", quiet, *pytest_argv], plugins=list(plugins)))
    finally:
        if stdout:
            stdout.decide(show=True)  # a session that stopped before its collection ended
        if buffered:
            reconfigure(line_buffering=False)


def list_gates(pytest_args: list[str], everything: bool = False) -> int:
    """The gate ids on stdout; without a GPU, those that need one only with `everything`, and
    how many were left out on stderr."""
    collected = collect([*GATE_MODULES, "--gates-only", *pytest_args])
    if collected.exit not in (0, NO_TESTS_EXIT):
        print(
            f"test: cannot collect the gates (pytest exit {collected.exit}); see why with "
            f"`python -m pytest {' '.join(GATE_MODULES)} --collect-only`",
            file=sys.stderr,
        )
        return exitcodes.ENV_BROKEN
    import torch  # imported already by the collection

    hidden = set() if everything or torch.cuda.is_available() else collected.gpu_ids
    shown = [gate_id for gate_id in collected.gate_ids if gate_id not in hidden]
    if shown:
        print("\n".join(shown))
    if hidden:
        print(
            f"test: {len(hidden):,} of {len(collected.gate_ids):,} ids not listed: they need a GPU "
            "and this machine has none (`--list --all` lists them)",
            file=sys.stderr,
        )
    elif not collected.gate_ids:
        print("test: no gate matches this selection", file=sys.stderr)
    return exitcodes.OK


def main(argv: list[str]) -> int:
    args, pytest_args = _parser().parse_known_args(argv)
    if args.keyword is not None:
        pytest_args = [*pytest_args, "-k", args.keyword]
    if args.all and not args.list:
        _parser().error("--all goes with --list")
    if args.list:
        return list_gates(pytest_args, args.all)
    paths = [a for a in pytest_args if a == "tests" or a.startswith("tests/")]
    pytest_args = [a for a in pytest_args if a not in paths]
    if paths and args.gates:
        _parser().error(f"--gates collects the gate modules itself; leave out {' '.join(paths)}")
    targets = [*GATE_MODULES, "--gates-only"] if args.gates else (paths or ["tests"])
    start = time.monotonic()
    clear_outputs(gate_plugin.RECORD)
    long = "--long" in pytest_args or gate_plugin.long_from_env()
    selected = gate_plugin.selection(
        args.keyword, None, args.gates, [*targets, *pytest_args], long=long
    )

    def stopped(code: int, reason: str) -> int:
        gate_plugin.write_record(outcome=ERROR, pytest_exit=None, selected=selected, reason=reason)
        return code

    try:
        limit = timelimit.limit_from_env()
    except timelimit.LimitError as exc:
        print(f"test: {exc}", file=sys.stderr)
        return stopped(exitcodes.ENV_BROKEN, str(exc))
    try:
        import torch
    except ImportError as exc:
        print(
            f"test: torch is not importable ({exc}); fix: run scripts/setup_environment.sh",
            file=sys.stderr,
        )
        return stopped(exitcodes.ENV_BROKEN, f"torch is not importable ({exc})")
    if args.require_gpu and not torch.cuda.is_available():
        print(
            "test: --require-gpu but torch sees no GPU; fix: check `nvidia-smi` and that torch is a CUDA build",
            file=sys.stderr,
        )
        return stopped(exitcodes.ENV_BROKEN, "--require-gpu but torch sees no GPU")

    from ..build import unit as build

    try:
        config = build.resolve_config(backend="cuda" if args.require_gpu else "auto")
        build.build(config)
    except build.ConfigError as exc:
        print(f"test: cannot configure the build: {exc}", file=sys.stderr)
        return stopped(exc.exit_code, f"cannot configure the build: {str(exc)[:300]}")
    except build.BuildError as exc:
        print(
            f"test: this commit does not build (exit {exitcodes.BUILD_FAILED}, git bisect skips it)\n{exc}",
            file=sys.stderr,
        )
        return stopped(exitcodes.BUILD_FAILED, "this commit does not build")

    workers = args.workers
    gpus = devices.visible_devices()
    env = isolated_env(dict(os.environ, FLASHMOE_REQUIRE_GPU="1" if args.require_gpu else ""))
    rc = None
    if workers is None and is_whole_suite(args.keyword, paths, pytest_args):
        workers = str(devices.worker_count(os.cpu_count(), gpus))
    if workers is None:  # a selection: collected here, and run here when it is small (SmallRun)
        rc, workers = run_selection(targets, pytest_args, env, gpus)
    if rc is None:
        cmd = pytest_command(targets, workers, pytest_args)
        why = ""
        if workers.isdigit() and int(workers) > 0 and gpus:
            why = f" ({devices.placement_text(int(workers), gpus)})"
        print(f"test: {' '.join(cmd[2:])}{why}", flush=True)
        spent = time.monotonic() - start  # the build and collection: the limit is the stage's
        if limit is not None and workers != "0" and spent >= limit:
            reason = timelimit.before_tests(limit, spent)
            print(f"test: {reason}", file=sys.stderr, flush=True)
            record = gate_plugin.write_record(
                outcome=INTERRUPTED, pytest_exit=None, selected=selected, reason=reason
            )
            return verdict(record, spent, args.no_gates_ok)
        rc = run_here(cmd[3:], env) if workers == "0" else run_command(cmd, env, limit, spent)
    elapsed = time.monotonic() - start
    record = _read_record()
    if record is None:  # pytest stopped before its session ended (usage or internal error)
        record = gate_plugin.write_record(
            outcome={2: INTERRUPTED, NO_TESTS_EXIT: NO_TESTS_COLLECTED}.get(rc, ERROR),
            pytest_exit=rc,
            selected=selected,
            reason=f"pytest exited {rc} ({gate_plugin.PYTEST_EXIT_NAMES.get(rc, 'crashed')})",
        )
    return verdict(record, elapsed, args.no_gates_ok)


def run_selection(
    targets: list[str], pytest_args: list[str], env: dict[str, str], gpus: list[str]
) -> tuple[int | None, str]:
    """A selection (-k, paths) in one session in this process: run there when it collects at most
    SERIAL_MAX_TESTS tests, so (pytest's exit, "0"); else (None, the workers to run it on), its
    session having run nothing and left no record."""
    cmd = pytest_command(targets, "0", pytest_args)
    output = HeldOutput(sys.stdout)

    announced = []

    def announce(tests: int | None) -> None:
        why = f" ({tests} tests: this process, no worker start-up)" if tests else ""
        print(f"test: {' '.join(cmd[2:])}{why}", file=output.target, flush=True)
        announced.append(tests)

    small = SmallRun(SERIAL_MAX_TESTS, output, announce)
    rc = run_here(cmd[3:], env, plugins=[small], stdout=output)
    if not small.too_many:
        if not announced:  # pytest stopped before it collected (a usage error, said above)
            announce(None)
        return rc, "0"
    clear_outputs(gate_plugin.RECORD)
    return None, str(devices.worker_count(os.cpu_count(), gpus))


def run_command(
    cmd: list[str], env: dict[str, str], limit: float | None = None, spent: float = 0.0
) -> int:
    """The stage's pytest on workers, in a process of its own; stopped past `limit` seconds of the
    stage (`spent` of them gone before it) with the tests it is stuck in named (timelimit.py)."""
    if limit is not None:
        return timelimit.run(cmd, REPO_ROOT, env, limit, spent)
    with subprocess.Popen(cmd, cwd=REPO_ROOT, env=env) as proc:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # pytest got the Ctrl-C too: let it write its record
            return proc.wait()


def _read_record() -> dict | None:
    try:
        record = json.loads((report_dir() / gate_plugin.RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("outcome") in EXIT_CODES else None


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def training_line(record: dict) -> str | None:
    """The training run's losses, first and last step, ours against SDPA's, where it ran."""
    run = record.get("training")
    if not run:
        return None
    (ours_first, ours_last), (sdpa_first, sdpa_last) = run["ours"], run["sdpa"]
    return (
        f"test: training run ({run.get('outcome', '?')}), loss first -> last: ours "
        f"{ours_first:.4f} -> {ours_last:.4f}, SDPA {sdpa_first:.4f} -> {sdpa_last:.4f}"
    )


def verdict(record: dict, elapsed: float, no_gates_ok: bool = False) -> int:
    """Print the one line that says what `record` means and what to do next (after the training
    run's losses, where it ran); return the exit."""
    if line := training_line(record):
        print(line, flush=True)
    outcome = record["outcome"]
    gates, tests = record["gates"], record["tests"]
    keyword = (record.get("selection") or {}).get("keyword")
    took = f"in {elapsed:.1f} s"
    passed_tests = _plural(tests["passed"], "test") + " passed"
    other_failed = tests["failed"] + tests["errors"] - gates["failed"]
    code = EXIT_CODES[outcome]
    restriction = record.get("restriction")
    if outcome == PASSED:
        skipped = f"; {gates['skipped']:,} skipped, need a GPU" if gates["skipped"] else ""
        if gates["skipped"] and restriction:
            skipped = (
                f"; {gates['skipped']:,} skipped: a GPU they need or kernels this build restricted "
                f"to {restriction!r} left out (unset FLASHMOE_BUILD_ONLY for the whole matrix)"
            )
        counts = f"{gates['passed']:,} of {gates['ran']:,}{skipped}"
        line = f"test: all gates passed ({counts}) · {passed_tests} {took}"
    elif outcome == FAILED:
        line = (
            f"test: {gates['failed']:,} of {_plural(gates['ran'], 'gate')} FAILED {took}; each "
            "failure above ends with a command that reruns it"
        )
        if other_failed > 0:
            line += f" ({_plural(other_failed, 'other test')} failed too)"
    elif outcome == TESTS_FAILED_OUTSIDE_GATES:
        gate_text = (
            f"{gates['passed']:,} of {_plural(gates['ran'], 'gate')} passed"
            if gates["ran"]
            else "no gate ran"
        )
        line = (
            f"test: {_plural(max(other_failed, 1), 'test')} outside the gates FAILED ({gate_text}) "
            f"{took}; see the failures above (`--gates` runs the gates alone)"
        )
    elif outcome == NO_GATES_SELECTED:
        if no_gates_ok:
            code = exitcodes.OK
            line = f"test: {passed_tests}; no gate selected (--no-gates-ok) {took}"
        else:
            line = (
                f"test: {passed_tests}; no gate selected, so no verdict on correctness (exit "
                f"{code}). Select gates ({LIST_HINT}) or pass --no-gates-ok if that was meant"
            )
    elif outcome == GATES_SKIPPED_NEED_GPU and restriction:
        line = (
            f"test: every selected gate ({gates['skipped']:,}) was skipped: "
            f"{record.get('reason') or 'skipped'}; no verdict on this commit (exit {code}). Select "
            f"gates whose kernels the build restricted to {restriction!r} holds, or unset "
            "FLASHMOE_BUILD_ONLY and rebuild"
        )
    elif outcome == GATES_SKIPPED_NEED_GPU:
        line = (
            f"test: every selected gate ({gates['skipped']:,}) was skipped: "
            f"{record.get('reason') or 'skipped'}; no verdict on this commit (exit {code}). Run "
            "it on a GPU machine with the CUDA build, or select the CPU cases (ids ending -cpu)"
        )
    elif outcome == NO_TESTS_COLLECTED:
        matched = f"-k {keyword!r} matched nothing" if keyword else "the selection matched nothing"
        line = f"test: no tests collected: {matched} (exit {code}); {LIST_HINT}"
    else:
        line = (
            f"test: {record.get('reason') or outcome}; no verdict on this commit (exit {code}). "
            "See pytest's output above"
        )
    print(line, file=sys.stdout if code == exitcodes.OK else sys.stderr, flush=True)
    return code
