"""The pytest plugin behind the test stage's record: which tests are gates, and reports/gates.json.

tests/conftest.py loads it (`pytest_plugins`), so plain `pytest` and `nox -s test` agree. A gate is
a test marked `gate` (the case matrices of the modules testing.GATE_MODULES names: forward and decode,
backward, varlen, paged); its figures arrive as the `gate` user
property. `--gates-only` deselects every other test, so a bisect step cannot be failed by a test
that is not a gate.

A test marked `long` (pyproject's markers) is deselected unless `--long` is given (or
FLASHMOE_LONG_TESTS=1): pull requests and pushes leave it out, the daily scheduled runs of GPU CI
and CPU CI select it.
No gate and no planted-bug test may be marked `long`: those run on every pull request, and a
session that collects one is a usage error.

`--no-cpu-twins` deselects the tests that run only the CPU implementation (cpu_twin): gate cases
on the CPU, tests parametrized on device "cpu", tests marked `cpu`. The GPU job's test stage passes
it on pull requests and pushes, where CPU CI runs those tests on the same commit.

At the end of every session (on the controller under pytest-xdist; never for --collect-only) the
plugin writes gates.json, and the test stage writes the same record itself when pytest never got
that far (the build failed, pytest could not start). Schema "flashmoe-science/gates/2":

  schema        "flashmoe-science/gates/2"
  timestamp     UTC, ISO 8601
  provenance    provenance.provenance(): {"commit": {"sha", "dirty", "fingerprint"}, "run_id"}
  outcome       one of OUTCOMES (below)
  reason        one line on why, for every outcome but "passed"/"failed"; else null
  pytest_exit   pytest's exit status; null when pytest did not run
  selection     {"keyword": the -k expression or null, "markexpr": the -m expression or null,
                 "gates_only": bool, "long": bool (the tests marked long were selected),
                 "args": pytest's arguments}
  gates         {"selected", "ran", "passed", "failed", "skipped"} over gate tests only;
                ran = passed + failed; an error in a gate's setup counts as failed
  tests         {"selected", "passed", "failed", "errors", "skipped"} over every test, gates
                included ("selected" = tests that reported; "errors": setup/teardown errors)
  total, failed the gate cases that ran and those that failed (schema 1's names, kept)
  worst_max_diff, worst_case, worst_ratio
                the largest max |out - ref|, its case id, and the largest error ratio to
                PyTorch's own error, over the gate cases that ran (null when none ran)
  cases         one row per gate case that ran: gates.GateResult.to_json() plus op, dtype,
                head_dim, "outcome" (pytest's) and, under pytest-xdist, "worker" (its id);
                failing cases first
  reused        only in a record `python -m flashmoe_science select` wrote instead of a test run
                (ci/selection.py): {"sha", "run_id", "run_url", "key", "timestamp"} of main's
                run whose verdict this pull request's leg reused; its counts and worst figures
                are that run's, and no case rows come with them
  restriction   the build restriction the gates ran on (FLASHMOE_BUILD_ONLY's spelling,
                _loader.build_restriction), whose left-out kernels' gates skipped; null for
                the full build
  workers       one row per process that ran tests, in id order: {"id": pytest-xdist's worker id
                ("gw0", ...) or "main" (no workers), "cuda_visible_devices": the GPU it was
                given (devices.py; null: not pinned), "gpu": the device name it saw (null: none),
                "gates": gate cases it ran, "tests": tests it ran}; [] when none reported

OUTCOMES, and what `python -m flashmoe_science test` exits with for each:
  passed                      gates ran, none failed, no other test failed            0
  failed                      a gate failed                                           1
  tests-failed-outside-gates  no gate failed, another test did                        1
  no-gates-selected           tests ran (and passed), none of them a gate             255
                              (0 with --no-gates-ok)
  gates-skipped-need-gpu      every selected gate was skipped (a CUDA case without     255
                              a GPU, an sm_90 configuration on an older card, or
                              kernels a restricted build left out)
  no-tests-collected          the selection matched nothing (pytest exit 5)           255
  interrupted                 pytest was interrupted, or collection failed            255
  error                       pytest failed to run (usage or internal error), or the  255
                              stage stopped before it: torch missing (255), the
                              commit does not build (125, a bisect skips it)
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from ..paths import REPO_ROOT, report_dir
from ..provenance import provenance
from . import devices, timelimit

SCHEMA = "flashmoe-science/gates/2"
RECORD = "gates.json"
# The files an Actions step appends to: its summary, outputs, environment, PATH and state
JOB_FILE_VARS = (
    "GITHUB_STEP_SUMMARY",
    "GITHUB_OUTPUT",
    "GITHUB_ENV",
    "GITHUB_PATH",
    "GITHUB_STATE",
)
MARKER = "gate"
# The short training run's losses (tests/library/test_training.py), {"ours": [first, last], "sdpa":
# [first, last]}: recorded beside the gates so a run's record and its verdict line carry them.
TRAINING = "training"
LONG = "long"  # the marker of a test that runs only in the scheduled CI runs (GPU's and CPU's)
SLOW = "slow"  # the marker of a test that takes more than a few seconds: workers start those first
CPU = "cpu"  # the marker of a test of the CPU implementation alone (cpu_twin)
LONG_VAR = "FLASHMOE_LONG_TESTS"  # "1": select the tests marked long, as --long does
# The fixture every planted-bug test builds its variant with (tests/conftest.py): such a test is
# what proves a gate, so it never leaves the pull request's run.
PLANT_FIXTURE = "run_planted"
WORKER_OUTPUT = "flashmoe_worker"  # what a pytest-xdist worker sends back: the GPU it used
MAIN = "main"  # the id of the one process of a run without workers

PASSED = "passed"
FAILED = "failed"
TESTS_FAILED_OUTSIDE_GATES = "tests-failed-outside-gates"
NO_GATES_SELECTED = "no-gates-selected"
GATES_SKIPPED_NEED_GPU = "gates-skipped-need-gpu"
NO_TESTS_COLLECTED = "no-tests-collected"
INTERRUPTED = "interrupted"
ERROR = "error"
OUTCOMES = (
    PASSED,
    FAILED,
    TESTS_FAILED_OUTSIDE_GATES,
    NO_GATES_SELECTED,
    GATES_SKIPPED_NEED_GPU,
    NO_TESTS_COLLECTED,
    INTERRUPTED,
    ERROR,
)

PYTEST_EXIT_NAMES = {
    0: "all tests passed",
    1: "tests failed",
    2: "interrupted",
    3: "internal error",
    4: "usage error",
    5: "no tests collected",
}


def empty_counts() -> tuple[dict, dict]:
    """(gates, tests) counters with every key at zero."""
    gates = dict.fromkeys(("selected", "ran", "passed", "failed", "skipped"), 0)
    tests = dict.fromkeys(("selected", "passed", "failed", "errors", "skipped"), 0)
    return gates, tests


def classify(pytest_exit: int | None, gates: dict, tests: dict, collection_errors: int = 0) -> str:
    """The outcome (one of OUTCOMES) of a session with these counts and this exit status."""
    if pytest_exit is None:
        return ERROR
    if pytest_exit == pytest.ExitCode.NO_TESTS_COLLECTED:
        return NO_TESTS_COLLECTED
    if collection_errors or pytest_exit == pytest.ExitCode.INTERRUPTED:
        return INTERRUPTED
    if pytest_exit not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return ERROR
    if gates["failed"]:
        return FAILED
    if tests["failed"] or tests["errors"] or pytest_exit == pytest.ExitCode.TESTS_FAILED:
        return TESTS_FAILED_OUTSIDE_GATES
    if not tests["selected"]:
        return NO_TESTS_COLLECTED
    if not gates["ran"]:
        return GATES_SKIPPED_NEED_GPU if gates["selected"] else NO_GATES_SELECTED
    return PASSED


def selection(
    keyword: str | None,
    markexpr: str | None,
    gates_only: bool,
    args: Sequence[str],
    long: bool = False,
):
    return {
        "keyword": keyword or None,
        "markexpr": markexpr or None,
        "gates_only": bool(gates_only),
        "long": bool(long),
        "args": list(args),
    }


def long_from_env() -> bool:
    return os.environ.get(LONG_VAR, "") == "1"


def cpu_twin(item) -> bool:
    """Whether a test runs the CPU implementation alone, whatever the machine: marked `cpu`,
    parametrized on device "cpu", or a gate case on the CPU (every gate id ends in its device)."""
    if item.get_closest_marker(CPU):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return False
    if callspec.params.get("device") == "cpu":
        return True
    return bool(item.get_closest_marker(MARKER)) and callspec.id.endswith("-cpu")


def kept_short(item) -> str | None:
    """Why a test may not be marked long (a gate, a planted bug); None when it may."""
    if item.get_closest_marker(MARKER):
        return "a gate"
    if PLANT_FIXTURE in getattr(item, "fixturenames", ()):
        return "a planted-bug test"
    return None


def write_record(
    *,
    outcome: str,
    pytest_exit: int | None,
    selected: dict,
    gates: dict | None = None,
    tests: dict | None = None,
    rows: Iterable[dict] = (),
    reason: str | None = None,
    training: dict | None = None,
    workers: Iterable[dict] = (),
    reused: dict | None = None,
    worst: dict | None = None,
    restriction: str | None = None,
    tree: Path = REPO_ROOT,
) -> dict:
    """Write gates.json into the report directory (atomically) and return what was written.
    Counts left out are zero: the stage stopped before any test ran. `training`: the training
    run's losses and outcome where it ran (TRAINING), else null. `workers`: the processes that
    ran tests and the GPU each used. `reused` and `worst`: main's run whose verdict stands in
    for a test run, and its worst figures (ci/selection.py). `restriction`: the restricted build's
    spelling, None for the full build. `tree`: the checkout it describes."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome={outcome!r}; supported: {', '.join(OUTCOMES)}")
    if gates is None or tests is None:
        gates, tests = empty_counts()
    rows = list(rows)
    failed_rows = [r for r in rows if r.get("outcome") != "passed"]
    worst_row = max(rows, key=lambda r: r.get("max_diff") or 0.0) if rows else {}
    doc = {
        "schema": SCHEMA,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "provenance": provenance(tree),
        "outcome": outcome,
        "reason": reason,
        "pytest_exit": None if pytest_exit is None else int(pytest_exit),
        "selection": selected,
        "gates": gates,
        "tests": tests,
        "total": len(rows),
        "failed": len(failed_rows),
        "worst_max_diff": worst_row.get("max_diff"),
        "worst_case": worst_row.get("case_id"),
        "worst_ratio": max((r.get("ratio") or 0.0) for r in rows) if rows else None,
        "cases": sorted(rows, key=lambda r: (r.get("outcome") == "passed", r.get("case_id", ""))),
        "training": training,
        "restriction": restriction or None,
        "workers": sorted(workers, key=lambda w: _worker_order(str(w.get("id")))),
    }
    if reused is not None:
        doc["reused"] = reused
        doc["total"], doc["failed"] = gates.get("ran", 0), gates.get("failed", 0)
        for name in ("worst_max_diff", "worst_case", "worst_ratio"):
            doc[name] = (worst or {}).get(name)
    path = report_dir() / RECORD
    tmp = path.with_name(f".{RECORD}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return doc


def _restriction_text() -> str | None:
    """The spelling of the restriction of the build the gates ran on; None for the full build.
    (From the loader, which imports no torch: this runs at the end of every session.)"""
    from ... import _loader

    try:
        return _loader.build_restriction().text() or None
    except _loader.ConfigError:  # a spelling the build refuses: recorded as given, never a crash
        return os.environ.get(_loader.ONLY_VAR) or None


def _worker_order(worker_id: str) -> tuple[int, str]:
    """gw2 before gw10."""
    digits = worker_id.removeprefix("gw")
    return (int(digits), "") if digits.isdigit() else (-1, worker_id)


def _worker_of(report) -> str:
    """The id of the worker that ran a test: pytest-xdist's on the controller, else MAIN."""
    node = getattr(report, "node", None)
    gateway = getattr(node, "gateway", None)
    return str(getattr(gateway, "id", None) or MAIN)


def _skip_reason(report) -> str | None:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return None


class GateRecorder:
    """Per-session state: each test's outcome (gate or not) and the gate cases' figures."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.outcomes: dict[str, str] = {}  # nodeid -> passed | failed | error | skipped
        self.is_gate: dict[str, bool] = {}
        self.skip_reasons: list[str] = []
        self.rows: list[dict] = []
        self.training: dict | None = None
        self.collection_errors = 0
        self.long_left_out = 0  # tests marked long that this run leaves out (no --long)
        self.twins_left_out = 0  # CPU twins this run leaves out (--no-cpu-twins)
        # worker id -> {"id", "cuda_visible_devices", "gpu", "gates", "tests"}
        self.workers: dict[str, dict] = {}
        self.running: dict[str, float] = {}  # nodeid -> when it started (time.monotonic)

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        # on the controller under pytest-xdist too: the tests a time limit names (timelimit.py)
        self.running[nodeid] = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        self.running.pop(nodeid, None)

    def stopped_at_the_limit(self) -> None:
        """The controller's part of a run stopped at the stage's time limit: the tests still
        running, on stderr and as the reason of an interrupted record."""
        lines = timelimit.running_text(self.running)
        for line in lines:
            print(f"test: still running at the time limit: {line}", file=sys.stderr, flush=True)
        for nodeid in self.running:  # begun, never finished: neither passed nor failed
            self.outcomes.pop(nodeid, None)
        limit = os.environ.get(timelimit.LIMIT_VAR, "").strip()
        self.write(INTERRUPTED, 2, timelimit.reason(limit, lines))

    def _worker(self, worker_id: str) -> dict:
        return self.workers.setdefault(
            worker_id,
            {"id": worker_id, "cuda_visible_devices": None, "gpu": None, "gates": 0, "tests": 0},
        )

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_setupnodes(self, config: pytest.Config, specs: list) -> None:
        """Pin each worker to a GPU (devices.py) and give it its share of the CPU cores
        (devices.THREAD_VARS, each unless the run sets it) before it starts."""
        gpus = devices.visible_devices()
        threads = devices.threads_per_worker(os.cpu_count(), len(specs))
        for index, spec in enumerate(specs):
            device = devices.device_of(index, gpus)
            if device is not None:
                spec.env[devices.VISIBLE_VAR] = device
            for name in devices.THREAD_VARS:
                if name not in os.environ:
                    spec.env[name] = str(threads)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """A worker's own account of the GPU it used (sent at its end, workeroutput)."""
        said = (getattr(node, "workeroutput", None) or {}).get(WORKER_OUTPUT)
        worker = self._worker(str(node.gateway.id))
        given = node.gateway.spec.env.get(devices.VISIBLE_VAR)
        if isinstance(said, dict):
            worker["cuda_visible_devices"] = said.get("cuda_visible_devices")
            worker["gpu"] = said.get("gpu")
            # every worker collects the whole selection: each leaves out the same tests
            self.long_left_out = max(self.long_left_out, int(said.get("long_left_out") or 0))
            self.twins_left_out = max(self.twins_left_out, int(said.get("twins_left_out") or 0))
        else:  # it crashed before its end: what it was given
            worker["cuda_visible_devices"] = given

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        long_ones = [item for item in items if item.get_closest_marker(LONG)]
        for item in long_ones:
            what = kept_short(item)
            if what:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked `{LONG}` but is {what}: gates and planted bugs run "
                    f"on every pull request. Remove the marker (make the test shorter instead)"
                )
        drop = set() if config.getoption("long") else {id(item) for item in long_ones}
        if config.getoption("no_cpu_twins"):
            twins = {id(item) for item in items if cpu_twin(item)}
            self.twins_left_out = len(twins)
            drop |= twins
        if config.getoption("gates_only"):
            drop |= {id(item) for item in items if not item.get_closest_marker(MARKER)}
        else:  # a gates-only run leaves out every other test, long or not: nothing to say
            self.long_left_out = 0 if config.getoption("long") else len(long_ones)
        if drop:
            config.hook.pytest_deselected(items=[item for item in items if id(item) in drop])
            items[:] = [item for item in items if id(item) not in drop]
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
        if hasattr(config, "workerinput") and workers.isdigit():
            items[:] = slow_first(items, int(workers), lambda item: item.get_closest_marker(SLOW))

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collection_errors += 1

    def pytest_runtest_logreport(self, report) -> None:
        # Runs on the controller under pytest-xdist too, with keywords and user_properties carried.
        nodeid = report.nodeid
        self.is_gate[nodeid] = MARKER in report.keywords
        previous = self.outcomes.get(nodeid)
        if report.failed:
            self.outcomes[nodeid] = "failed" if report.when == "call" else "error"
            if previous == "failed":
                self.outcomes[nodeid] = "failed"
        elif report.skipped:
            self.outcomes[nodeid] = "skipped"
            reason = _skip_reason(report)
            if self.is_gate[nodeid] and reason and reason not in self.skip_reasons:
                self.skip_reasons.append(reason)
        elif report.when == "call" or previous is None:
            self.outcomes[nodeid] = "passed"
        if report.when == "call":
            worker_id = _worker_of(report)
            worker = self._worker(worker_id)
            worker["tests"] += 1
            worker["gates"] += self.is_gate[nodeid] and not report.skipped
            for name, value in report.user_properties:
                if name == MARKER:
                    row = {**value, "outcome": report.outcome}
                    if worker_id != MAIN:
                        row["worker"] = worker_id
                    self.rows.append(row)
                elif name == TRAINING:
                    self.training = {**value, "outcome": report.outcome}

    def counts(self) -> tuple[dict, dict]:
        gates, tests = empty_counts()
        for nodeid, outcome in self.outcomes.items():
            tests["selected"] += 1
            tests["errors" if outcome == "error" else outcome] += 1
            if self.is_gate.get(nodeid):
                gates["selected"] += 1
                if outcome == "skipped":
                    gates["skipped"] += 1
                else:
                    gates["ran"] += 1
                    gates["passed" if outcome == "passed" else "failed"] += 1
        return gates, tests

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        config = self.config
        here = {"cuda_visible_devices": os.environ.get(devices.VISIBLE_VAR), "gpu": None}
        if hasattr(
            config, "workerinput"
        ):  # a worker: say which GPU it used and what it left out, the rest is the controller's
            here["gpu"] = devices.gpu_name()
            config.workeroutput[WORKER_OUTPUT] = {
                **here,
                "long_left_out": self.long_left_out,
                "twins_left_out": self.twins_left_out,
            }
            return
        if config.option.collectonly:
            return
        if MAIN in self.workers:  # this process ran the tests itself
            self.workers[MAIN].update(here, gpu=devices.gpu_name())
        gates, tests = self.counts()
        outcome = classify(int(exitstatus), gates, tests, self.collection_errors)
        self.write(outcome, int(exitstatus), self.reason(outcome, int(exitstatus), gates, tests))

    def write(self, outcome: str, exitstatus: int, reason: str | None) -> None:
        """gates.json for this session's tests so far."""
        config = self.config
        gates, tests = self.counts()
        write_record(
            outcome=outcome,
            pytest_exit=exitstatus,
            selected=selection(
                config.option.keyword,
                config.option.markexpr,
                config.getoption("gates_only"),
                config.invocation_params.args,
                config.getoption("long"),
            ),
            gates=gates,
            tests=tests,
            rows=self.rows,
            reason=reason,
            training=self.training,
            workers=self.workers.values(),
            restriction=_restriction_text(),
        )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.twins_left_out and not hasattr(self.config, "workerinput"):
            n = self.twins_left_out
            terminalreporter.write_line(
                f"{n:,} CPU twin test{'' if n == 1 else 's'} left out (--no-cpu-twins): CPU CI "
                "runs them; run the stage without it for them here"
            )
        if self.long_left_out and not hasattr(self.config, "workerinput"):
            n = self.long_left_out
            terminalreporter.write_line(
                f"{n:,} test{'' if n == 1 else 's'} marked `{LONG}` left out: `--long` runs them "
                "(the scheduled CI runs do)"
            )

    def reason(self, outcome: str, exitstatus: int, gates: dict, tests: dict) -> str | None:
        if outcome == GATES_SKIPPED_NEED_GPU:
            return "; ".join(self.skip_reasons[:3]) or "skipped"
        if outcome == INTERRUPTED and self.collection_errors:
            return f"{self.collection_errors} error(s) while collecting tests"
        if outcome in (INTERRUPTED, ERROR, NO_TESTS_COLLECTED):
            return f"pytest exited {exitstatus} ({PYTEST_EXIT_NAMES.get(exitstatus, 'unknown')})"
        if outcome == NO_GATES_SELECTED:
            return f"{tests['selected']} tests ran, none of them a gate"
        if outcome == TESTS_FAILED_OUTSIDE_GATES:
            return f"{tests['failed'] + tests['errors']} tests outside the gates failed"
        return None


def slow_first(items: list, workers: int, is_slow) -> list:
    """`items` reordered so that each worker's first share of a work-stealing run starts with an
    equal part of the slow tests. pytest-xdist's worksteal cuts the collection (the same in every
    worker) into `workers` contiguous shares, N // workers first, then what is left over the rest,
    and an idle worker steals from the end of the longest queue (by count): a slow test at a
    share's head starts early, the run ends on short ones. In collection order a 17 s test came
    late and ran alone for the stage's last 12 s; all slow tests at the front went to one worker,
    which ran them one after another."""
    slow = [item for item in items if is_slow(item)]
    if not slow or workers < 2:
        return items
    fast = [item for item in items if not is_slow(item)]
    order, left, taken = [], len(items), 0
    for share in range(workers):
        size = left // (workers - share)
        left -= size
        mine = slow[share::workers]
        more = max(0, size - len(mine))
        order += mine + fast[taken : taken + more]
        taken += more
    return order + fast[taken:]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gates-only",
        action="store_true",
        default=False,
        help="run only the correctness gates (tests marked `gate`); other tests are deselected",
    )
    parser.addoption(
        "--no-cpu-twins",
        action="store_true",
        default=False,
        help="leave out the tests of the CPU implementation alone (CPU gate cases, tests on device "
        f"cpu or marked `{CPU}`): the GPU job's, where CPU CI runs them on the same commit",
    )
    parser.addoption(
        "--long",
        action="store_true",
        default=long_from_env(),
        help=f"also run the tests marked `{LONG}` (deselected by default; the scheduled CI runs "
        f"select them; {LONG_VAR}=1 does the same)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # A test that runs a pipeline command in a GitHub Actions job (the GPU test stage) would append
    # its fixtures' report to the job's own summary and outputs; workers inherit the removal.
    for name in JOB_FILE_VARS:
        os.environ.pop(name, None)
    config.addinivalue_line(
        "markers", f"{MARKER}: a correctness gate case (counted in reports/{RECORD})"
    )
    config.addinivalue_line(
        "markers",
        f"{CPU}: tests the CPU implementation alone, on any machine (--no-cpu-twins leaves it out)",
    )
    recorder = GateRecorder(config)
    config.pluginmanager.register(recorder, "flashmoe-gate-recorder")
    if os.environ.get(timelimit.LIMIT_VAR, "").strip() and not config.option.collectonly:
        watch = timelimit.Watch(hasattr(config, "workerinput"), recorder.stopped_at_the_limit)
        watch.install()
        config.add_cleanup(watch.uninstall)
