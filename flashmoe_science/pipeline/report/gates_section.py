"""The correctness-gates section, from gates.json ("flashmoe-science/gates/2"), which the test
stage writes on every run:

    outcome      passed | failed | no-gates-selected | gates-skipped-need-gpu |
                 no-tests-collected | tests-failed-outside-gates | interrupted | error
    reason       one line on why, for the outcomes other than passed and failed
    gates        {"selected", "ran", "passed", "failed", "skipped"}: gate cases only
    tests        {"selected", "passed", "failed", "errors", "skipped"}: every test, gates included
    pytest_exit  pytest's own exit status (null when pytest did not run)
    selection    {"keyword": -k, "markexpr": -m, "gates_only": --gates, "long": --long, "args"}
    reused       main's run whose verdict a pull request's leg reused (ci/selection.py): then the
                 counts are that run's and this run ran no gate
    workers      the processes that ran tests: each one's GPU (CUDA_VISIBLE_DEVICES entry and
                 device name) and the gates it ran, shown as the GPUs used
    cases        one row per gate case that ran; `rerun` is the command that reruns it,
                 `rerun_cpu` its CPU twin's, `rerun_needs` the hardware it needs beyond a GPU

Only "passed" is a pass. The other outcomes where nothing failed (no gate selected, every gate
skipped for want of a GPU, nothing collected) are their own warnings, never "all gates passed".
"""

from __future__ import annotations

import re
from typing import Any

from .. import markdown as md
from .inputs import Inputs, stage_status
from .sections import FAIL, OK, WARN, Detail, Section, absent, stale_section, unreadable_section
from .selection_section import reused_text

MAX_FAILING = 100  # failing cases detailed at most; the rest are counted (all are in gates.json)
MAX_GPUS = 16  # GPUs named in the facts line; the rest are counted
RERUN_ALL_MAX = 20  # one combined `-k 'a or b ...'` command for up to this many failing cases
GPU_PREFIX = "FLASHMOE_REQUIRE_GPU=1 "  # without a GPU, a CUDA case then exits 255, not "passed"
# A rerun command from gates.json is shown for copying into a shell: only these characters.
_SAFE_COMMAND = re.compile(r"[A-Za-z0-9_.:=/' -]+")

# outcome -> (severity, what the summary and the verdict say)
OUTCOMES = {
    "passed": (OK, "passed"),
    "failed": (FAIL, "gates failed"),
    "no-gates-selected": (WARN, "no gate selected"),
    "gates-skipped-need-gpu": (WARN, "every selected gate skipped (needs a GPU)"),
    "no-tests-collected": (WARN, "no tests collected"),
    "tests-failed-outside-gates": (FAIL, "tests outside the gates failed"),
    "interrupted": (FAIL, "test run interrupted"),
    "error": (FAIL, "test run error"),
}


def case_failed(case: dict) -> bool:
    return case.get("outcome") not in ("passed", "skipped")


def rerun_command(case: dict) -> str:
    """The case's own `rerun` command when it is a plain one, else one built from its id; CUDA
    cases demand a GPU, so that a machine without one cannot rerun them into a pass."""
    given = case.get("rerun")
    if isinstance(given, str) and _SAFE_COMMAND.fullmatch(given):
        return given
    case_id, device = _safe_id(case.get("case_id", "?")), _safe_id(case.get("device", "?"))
    prefix = GPU_PREFIX if device == "cuda" else ""
    return f"{prefix}nox -s test -- -k '{case_id}-{device}'"


def _safe_id(value: Any) -> str:
    """Case ids and devices go into shell commands: keep only what a case id can contain."""
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", str(value))


def _count(block: Any, key: str) -> int:
    return md.integer((block or {}).get(key) if isinstance(block, dict) else None) or 0


def gates_text(gates: dict) -> str:
    """'692 of 692 gates passed', '3 of 24 gates failed', 'no gate ran, 1 skipped'; on a
    restricted build, the skipped ones say so. The case rows count too: a failed row is never
    hidden behind counts that say otherwise."""
    g = gates.get("gates")
    rows = [c for c in gates.get("cases") or [] if isinstance(c, dict)]
    ran = max(_count(g, "ran"), len([c for c in rows if c.get("outcome") != "skipped"]))
    failed = max(_count(g, "failed"), len([c for c in rows if case_failed(c)]))
    skipped = _count(g, "skipped")
    if not ran:
        text = "no gate ran"
    elif failed:
        text = f"{failed:,} of {ran:,} gates failed"
    else:
        text = f"{_count(g, 'passed'):,} of {ran:,} gates passed"
    restriction = gates.get("restriction")
    if skipped and isinstance(restriction, str) and restriction:
        return f"{text}, {skipped:,} skipped (a build restricted to {md.code(restriction, 120)})"
    return text + (f", {skipped:,} skipped" if skipped else "")


def tests_text(gates: dict) -> str:
    """'1,008 tests passed, 3 skipped': every test pytest ran, gates included."""
    t = gates.get("tests")
    parts = [f"{_count(t, 'passed'):,} tests passed"]
    keys = ("failed", "errors", "skipped")
    return ", ".join(parts + [f"{_count(t, k):,} {k}" for k in keys if _count(t, k)])


def counts_text(gates: dict) -> str:
    """'692 of 692 gates passed · 1,008 tests passed': gates and all tests, never mixed."""
    return f"{gates_text(gates)} · {tests_text(gates)}"


def gpus_text(gates: dict) -> str | None:
    """The GPUs the test stage used, from gates.json's workers: '2: `0` NVIDIA H200 (4 workers,
    957 gates), `1` NVIDIA H200 (4 workers, 957 gates)'; None for a run that used none."""
    workers = [w for w in gates.get("workers") or [] if isinstance(w, dict)]
    groups: dict[tuple, list[int]] = {}
    for worker in workers:
        key = (worker.get("cuda_visible_devices"), worker.get("gpu"))
        group = groups.setdefault(key, [0, 0])
        group[0] += 1
        group[1] += _count(worker, "gates")
    if not any(device is not None or name for device, name in groups):
        return None  # no process was given or saw a GPU: a CPU run
    one_process = [str(w.get("id")) for w in workers] == ["main"]
    parts = []
    for (device, name), (count, ran) in list(groups.items())[:MAX_GPUS]:
        where = f"{md.code(device, 80)} " if device is not None else ""
        card = md.text(name, 80) if name else "no GPU seen"
        processes = "one process" if one_process else md.plural(count, "worker")
        parts.append(f"{where}{card} ({processes}, {md.plural(ran, 'gate')})")
    if len(groups) > MAX_GPUS:
        parts.append(f"and {len(groups) - MAX_GPUS:,} more")
    return (f"{len(groups)}: " if len(groups) > 1 else "") + ", ".join(parts)


def _selection(gates: dict) -> str | None:
    """The options that chose the tests ('-k test_api', '--gates -k fwd', '--long': the tests
    marked long too), None for every test of a pull request's run."""
    selection = gates.get("selection")
    if not isinstance(selection, dict):
        return None
    parts = ["--gates"] if selection.get("gates_only") else []
    parts += ["--long"] if selection.get("long") is True else []
    parts += [f"-k {selection['keyword']}"] if selection.get("keyword") else []
    parts += [f"-m {selection['markexpr']}"] if selection.get("markexpr") else []
    return " ".join(parts) or None


def gates_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Correctness gates"
    if "gates.json" in inputs.unreadable:
        return unreadable_section("test", title, "gates.json", inputs.unreadable["gates.json"])
    if "gates.json" in inputs.stale:
        return stale_section("test", title, "gates.json", inputs.stale["gates.json"])
    gates = inputs.gates
    if gates is None:
        return absent(
            inputs,
            "test",
            title,
            "gates.json",
            "test stage failed",
            "The test stage failed and left no `gates.json` (it could not build, or pytest "
            "could not start); see the job log. Reproduce: `nox -s test`.",
        )
    cases = [c for c in gates.get("cases") or [] if isinstance(c, dict)]
    failing = [c for c in cases if case_failed(c)]
    outcome = str(gates.get("outcome") or "unknown")
    if failing and outcome in ("passed", "unknown"):  # a failed case is never part of a pass
        outcome = "failed"
    severity, said = OUTCOMES.get(outcome, (FAIL, f"unknown outcome {outcome!r}"))
    counts = counts_text(gates)
    exit_code = md.integer(gates.get("pytest_exit"))
    selection = _selection(gates)
    worst_case = gates.get("worst_case")
    facts = [f"**{counts}**"]
    reused = gates.get("reused") if isinstance(gates.get("reused"), dict) else None
    if reused:
        facts.append(f"**reused**: the verdict of {reused_text(reused)}; no gate ran in this run")
    if md.num(gates.get("worst_max_diff")) is not None:
        facts.append(
            f"**worst max diff** {md.sig(gates.get('worst_max_diff'))}"
            + (f" ({md.code(worst_case, 150)})" if worst_case else "")
        )
    if md.num(gates.get("worst_ratio")) is not None:
        facts.append(f"**worst error ratio** {md.times(gates.get('worst_ratio'))} PyTorch's own")
    facts.append(f"**selection** {md.code(selection) if selection else 'all tests'}")
    gpus = gpus_text(gates)
    if gpus:
        facts.append(f"**GPUs used** {gpus}")
    if exit_code is not None:
        facts.append(f"**pytest exit** {exit_code}")
    parts = [" · ".join(facts)]
    problems = []
    if outcome == "passed":
        summary = counts + (" (main's, reused)" if reused else "")
        if stage_status(inputs, "test") not in (None, "ok"):
            # gates.json says passed, the command did not: believe the failure.
            severity, summary = FAIL, f"{counts}; the test stage still failed"
            problems.append((FAIL, "test stage failed after its gates passed (see the job log)"))
    elif outcome == "failed":
        nfailed = max(_count(gates.get("gates"), "failed"), len(failing))
        summary = counts
        problems.append((FAIL, md.plural(nfailed, "gate") + " failed"))
        if not failing:  # the rows of the failures are missing: say so rather than show none
            parts.append("`gates.json` says gates failed but lists no failing case.")
    else:
        summary = (
            said + (f" ({md.code(selection)})" if selection else "") + f" · {tests_text(gates)}"
        )
        if outcome in ("interrupted", "error") and exit_code is not None:
            said += f" (pytest exit {exit_code})"
        problems.append((severity, said))
        if gates.get("reason"):
            parts.append(f"Why: {md.text(gates['reason'])}.")
        parts.append(_outcome_help(outcome))
    if failing:
        parts.append(_failing_cases(failing, detail))
    passing = [c for c in cases if c.get("outcome") == "passed"]
    if passing:
        parts.append(_passing_groups(passing, detail))
    return Section("test", title, severity, summary, "\n\n".join(p for p in parts if p), problems)


def _outcome_help(outcome: str) -> str:
    return {
        "no-gates-selected": "The selection ran no gate case, so it says nothing about "
        "correctness. `nox -s test -- --list` prints the gate ids to select from.",
        "gates-skipped-need-gpu": "Every selected gate needs a GPU and this machine has none, so "
        "nothing was checked. Rerun on a GPU machine, or select the CPU twin of each case.",
        "no-tests-collected": "pytest collected nothing (pytest exit 5): the selection matched no "
        "test. `nox -s test -- --list` prints the gate ids.",
        "tests-failed-outside-gates": "Every gate that ran passed, but another test failed; "
        "see the job log.",
        "interrupted": "The run was interrupted before it finished; its figures are partial.",
        "error": "pytest could not run the tests (an internal or usage error); see the job log.",
    }.get(outcome, "")


def _failing_cases(failing: list[dict], detail: Detail) -> str:
    limit = MAX_FAILING if detail.failing_cases is None else min(detail.failing_cases, MAX_FAILING)
    shown = failing[:limit]
    rows = [
        [
            md.code(c.get("case_id", "?"), 150),
            md.text(c.get("device", "?")),
            _diff(c),
            md.sig(c.get("bound")),
            md.sig(c.get("pt_max_diff")),
            md.times(c.get("ratio")),
            md.text(
                "; ".join(str(f) for f in c.get("failures") or []) or c.get("outcome", "failed"),
                200,
            ),
        ]
        for c in shown
    ]
    parts = [
        "**Failing cases**",
        md.table(["case", "device", "max diff", "bound", "PyTorch err", "ratio", "failures"], rows),
    ]
    blocks = []
    for c in shown:
        case_id, device = _safe_id(c.get("case_id", "?")), _safe_id(c.get("device", "?"))
        lines = [
            f"- {md.code(case_id, 150)} on {md.text(device)}"
            + (f", seed {md.text(c.get('seed'))}" if c.get("seed") is not None else "")
        ]
        for failure in c.get("failures") or []:
            lines.append(f"  - {md.text(failure)}")
        lines.append(
            f"  - max diff {_diff(c)} (mean {md.sig(c.get('mean_diff'))}); gate-2 bound {md.sig(c.get('bound'))}"
            f" = 2 {md.TIMES} PyTorch's {md.sig(c.get('pt_max_diff'))} + floor {md.sig(c.get('floor'))}"
        )
        worst = c.get("worst")
        if isinstance(worst, (list, tuple)) and len(worst) == 4:
            b, h, row, col = (md.text(x) for x in worst)
            lines.append(f"  - worst element: batch {b}, head {h}, query row {row}, column {col}")
        profile = c.get("row_profile")
        if isinstance(profile, list) and profile:
            segs = [p for p in profile if isinstance(p, (list, tuple)) and len(p) == 3]
            if any(md.num(p[2]) is not None for p in segs):
                lines.append(
                    "  - error along query rows: "
                    + ", ".join(f"{md.text(p[0])}-{md.text(p[1])}: {md.sig(p[2])}" for p in segs)
                )
            elif segs:
                lines.append("  - error along query rows: not finite in any segment")
        needs = c.get("rerun_needs")
        lines.append(
            f"  - rerun: {md.code(rerun_command(c))}"
            + (f" (needs {md.text(needs, 40)})" if isinstance(needs, str) and needs else "")
        )
        twin = c.get("rerun_cpu")
        if isinstance(twin, str) and _SAFE_COMMAND.fullmatch(twin):
            lines.append(f"  - its CPU twin: {md.code(twin)}")
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
        prefix = GPU_PREFIX if any(_safe_id(c.get("device")) == "cuda" for c in failing) else ""
        parts.append(
            "Rerun all failing cases:\n\n"
            + md.fenced(f"{prefix}nox -s test -- -k '{pattern}'", "sh")
        )
    return "\n\n".join(parts)


def _diff(case: dict) -> str:
    """A case's max diff; NaN/Inf arrive as null (gates.GateResult.to_json)."""
    if md.num(case.get("max_diff")) is None and (
        md.integer(case.get("nonfinite")) or case.get("max_diff") is None
    ):
        return "NaN/Inf"
    return md.sig(case.get("max_diff"))


def _passing_groups(passing: list[dict], detail: Detail) -> str:
    if not detail.passing:
        detail.omitted.append("passing details")
        return f"_{md.plural(len(passing), 'passing case')} not shown._"
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
        worst = max(members, key=lambda c: md.num(c.get("ratio")) or 0.0)
        rows.append(
            [
                md.text(op),
                md.text(dtype),
                md.text(head_dim),
                md.text(device),
                str(len(members)),
                md.sig(max((md.num(c.get("max_diff")) or 0.0) for c in members)),
                md.times(worst.get("ratio")),
                md.code(worst.get("case_id", "?"), 150),
            ]
        )
    return "**Passing cases by group**\n\n" + md.table(
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
