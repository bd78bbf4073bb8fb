"""The one PR comment over GPU CI's legs (flashmoe_science.pipeline.report.legs): a verdict line
per GPU kind, then each kind's report; a missing leg, a leg whose job failed, a leg of another
card or with another leg's records is never a pass. Built from the report fixtures, each copied
as one leg's artifact (gpu-ci-reports-KIND/) with that leg's run id, as pr-report.yml downloads
them."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from flashmoe_science.pipeline import exitcodes, gpukinds, report
from flashmoe_science.pipeline.bench import trend
from flashmoe_science.pipeline.ci import gpuci
from flashmoe_science.pipeline.report import legs
from flashmoe_science.pipeline.report.inputs import load_inputs
from flashmoe_science.pipeline.report.sections import ICONS

# the module, which the package's render() function shadows
render_module = importlib.import_module("flashmoe_science.pipeline.report.render")

FIXTURES = Path(__file__).parents[1] / "fixtures" / "report"
SHA = "9c41e07b2d5a8f3e61b0c7d94a2e1f5b8c3d6a70"  # the fixtures' commit
RUN = "gpu-1-1"
H100_NAME = "NVIDIA H100 80GB HBM3"
# The fixtures are an L4's: the Hopper legs' records get their own card's name and capability.
HOPPER = {"h100": (H100_NAME, "9.0"), "h200": ("NVIDIA H200", "9.0")}


def add_leg(
    root: Path,
    kind: str,
    fixture: str = "passing",
    *,
    run_kind: str | None = None,
    device: str | None = None,
) -> Path:
    """`fixture` as the `kind` leg's artifact: its records carry the run id of `run_kind` (the
    leg's own by default) and, for a Hopper kind, its card's device name and compute capability
    unless `device` names another card (which keeps the fixture's 8.9)."""
    leg = root / gpukinds.artifact_name(kind)
    shutil.copytree(FIXTURES / fixture, leg)
    for name in ("expected.md", "base_build.json"):
        (leg / name).unlink(missing_ok=True)
    run_id = gpukinds.leg_run_id(RUN, run_kind or kind)
    capability = HOPPER[kind][1] if kind in HOPPER and device is None else None
    device = device or (HOPPER[kind][0] if kind in HOPPER else None)
    for path in leg.glob("*.json"):
        doc = json.loads(path.read_text())
        if isinstance(doc.get("provenance"), dict):
            doc["provenance"]["run_id"] = run_id
        for stage in (doc.get("stages") or {}).values():
            stage["provenance"]["run_id"] = run_id
        if device and isinstance(doc.get("gpu"), dict):
            doc["gpu"]["name"] = device
            doc["gpu"]["capability"] = capability or doc["gpu"]["capability"]
        path.write_text(json.dumps(doc))
    return leg


def jobs_file(root: Path, **results: str) -> Path:
    path = root.parent / "jobs.tsv"
    lines = ["Approve the commit to test (trusted)\tsuccess"]
    lines += [f"{gpukinds.job_name(kind)}\t{result}" for kind, result in results.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def comment(root: Path, *extra: str) -> tuple[int, str]:
    out = root.parent / "comment.md"
    url = "https://github.com/o/r/actions/runs/1"
    code = report.main(
        [
            *("--legs", str(root), "--output", str(out), "--no-step-summary"),
            *("--tested-sha", SHA, "--run-id", RUN, "--run-url", url, *extra),
        ]
    )
    return code, out.read_text()


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "gpu-ci-reports"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _no_step_summary(monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.delenv("FLASHMOE_JOB_START", raising=False)


def verdict_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("- ")][:2]


def test_passing_legs_make_one_comment_with_a_verdict_line_per_kind(root):
    add_leg(root, "l4")
    add_leg(root, "h100")
    add_leg(root, "h200")
    code, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="success", h200="success"))
    )
    assert code == exitcodes.OK
    lines = text.split("\n")
    assert lines[0] == "## ✅ flashmoe-science: l4 passed, h100 passed, h200 passed"
    assert lines[1] == report.MARKER and text.count(report.MARKER) == 1, "one comment, one marker"
    assert [line for line in text.splitlines() if line.startswith("- ")][:3] == [
        "- ✅ **l4** (NVIDIA L4, sm_89): passed",
        "- ✅ **h100** (NVIDIA H100, sm_90a): passed",
        "- ✅ **h200** (NVIDIA H200, sm_90a): passed",
    ]
    assert text.count("**tested** `9c41e07b2d5a`") == 1, "the trusted header once, on top"
    # then each kind's details, collapsed when it passed, in the order of the verdict lines
    l4 = text.index("<details><summary>✅ <b>l4</b> (NVIDIA L4, sm_89): passed</summary>")
    h100 = text.index("<details><summary>✅ <b>h100</b> (NVIDIA H100, sm_90a): passed</summary>")
    assert max(text.index(line) for line in verdict_lines(text)) < l4 < h100
    assert "**run** `gpu-1-1-l4`" in text[l4:h100] and "**run** `gpu-1-1-h100`" in text[h100:]
    assert "`gpu-ci-reports-h100` artifact of [this run]" in text[h100:]
    assert text.count("<details") == text.count("</details>")


def test_a_failed_leg_fails_the_comment_and_says_which(root):
    add_leg(root, "l4")
    add_leg(root, "h100", "failing_gates")
    add_leg(root, "h200")
    code, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="failure", h200="success"))
    )
    assert code == exitcodes.OK
    assert text.startswith("## ❌ flashmoe-science: l4 passed, h100 failed, h200 passed\n")
    l4_line, h100_line = verdict_lines(text)
    assert l4_line == "- ✅ **l4** (NVIDIA L4, sm_89): passed"
    assert h100_line.startswith(
        "- ❌ **h100** (NVIDIA H100, sm_90a): its job failed (its records: "
    )
    assert "3 gates failed" in h100_line
    assert "<details open><summary>❌ <b>h100</b>" in text, "a failing kind opens"


def test_a_leg_whose_job_failed_is_a_failure_even_when_its_records_pass(root):
    add_leg(root, "l4")
    add_leg(root, "h100")
    add_leg(root, "h200")
    _, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="timed_out", h200="success"))
    )
    assert text.startswith("## ❌ flashmoe-science: l4 passed, h100 failed, h200 passed\n")
    assert verdict_lines(text)[1] == (
        "- ❌ **h100** (NVIDIA H100, sm_90a): its job timed out (its records: passed)"
    )


@pytest.mark.parametrize(
    ("jobs", "said"),
    [
        (None, "no report: the leg did not run, or uploaded no `gpu-ci-reports-h100`"),
        (
            {"h100": "cancelled"},
            "no report: its job was cancelled, and there is no `gpu-ci-reports-h100`",
        ),
        ({}, "no report: no job of this leg in the run, and there is no `gpu-ci-reports-h100`"),
    ],
    ids=["jobs-unread", "cancelled", "no-such-job"],
)
def test_a_missing_leg_is_named_and_never_a_pass(root, jobs, said):
    add_leg(root, "l4")
    add_leg(root, "h200")
    extra = (
        []
        if jobs is None
        else ["--jobs", str(jobs_file(root, l4="success", h200="success", **jobs))]
    )
    code, text = comment(root, *extra)
    assert code == exitcodes.OK, "a missing leg is the verdict's business, not an input error"
    assert text.startswith("## ❌ flashmoe-science: l4 passed, h100 failed, h200 passed\n")
    assert verdict_lines(text)[1] == f"- ❌ **h100** (NVIDIA H100, sm_90a): {said}"
    assert "<b>h100</b>" not in text, "no details to show"
    if jobs is None:
        assert "the run's jobs were not read" in text
        assert verdict_lines(text)[0].endswith("passed (the job's own result was not read)")


def test_no_leg_at_all_is_every_kind_missing(tmp_path):
    code, text = comment(tmp_path / "no-artifacts")
    assert code == exitcodes.OK
    assert text.startswith("## ❌ flashmoe-science: l4 failed, h100 failed, h200 failed\n")
    assert all("no report" in line for line in verdict_lines(text))


def test_another_legs_records_are_stale_not_a_pass(root):
    add_leg(root, "l4")
    add_leg(root, "h100", run_kind="l4")  # the l4 leg's files in the h100 artifact
    add_leg(root, "h200")
    code, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="success", h200="success"))
    )
    assert code == exitcodes.USAGE
    assert text.startswith("## 🕰️ flashmoe-science: l4 passed, h100 stale, h200 passed\n")
    assert "not a verdict on this commit" in verdict_lines(text)[1]
    assert "from run gpu-1-1-l4, not this run (gpu-1-1-h100)" in text


def test_a_leg_that_ran_on_another_card_is_a_warning(root):
    add_leg(root, "l4")
    add_leg(root, "h100", device="NVIDIA L4")  # a runner labelled h100 with an L4 in it
    add_leg(root, "h200")
    _, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="success", h200="success"))
    )
    assert text.startswith("## ⚠️ flashmoe-science: l4 passed, h100 warned, h200 passed\n")
    assert verdict_lines(text)[1] == (
        "- ⚠️ **h100** (NVIDIA H100, sm_90a): ran on the wrong card: NVIDIA L4 is sm_89, not "
        "sm_90a (its records: passed)"
    )


def test_each_leg_sees_its_own_kinds_history_and_a_kind_without_one_says_so(root, tmp_path):
    add_leg(root, "l4")
    add_leg(root, "h100")
    add_leg(root, "h200")
    history = tmp_path / "history"
    (history / "h100").mkdir(parents=True)
    (history / "l4").mkdir()
    medians = {"fwd-fp16-d64-h8-b1-s128-full": 0.02}
    for i in range(6):
        point = trend.Point(f"{i:07x}0", f"2026-11-0{i + 1}T00:00:00+00:00", "NVIDIA L4", medians)
        (history / "l4" / trend.point_name(point)).write_text(json.dumps(point.to_json()))
    _, text = comment(root, "--history", str(history))
    h100 = text[text.index("<b>h100</b>") :]
    l4 = text[text.index("<b>l4</b>") : text.index("<b>h100</b>")]
    assert "Main's last 6 stored runs on NVIDIA L4" in l4
    assert "No stored main runs of the `h100` leg yet" in h100
    assert "another GPU kind's runs are never used" in h100 and "stored run" not in h100


def test_the_comment_stays_under_the_budget_and_keeps_every_verdict_line(root):
    add_leg(root, "l4", "failing_gates")
    add_leg(root, "h100", "regressions")
    add_leg(root, "h200")
    _, text = comment(root, "--max-chars", "9000")
    assert len(text.encode()) <= 9000
    assert text.startswith("## ❌ flashmoe-science: l4 failed, h100 warned, h200 passed\n")
    l4_line, h100_line = verdict_lines(text)
    assert l4_line.startswith("- ❌ **l4** (") and h100_line.startswith("- ⚠️ **h100** (")


def test_a_new_push_marks_the_comment_stale_above_every_kind(root):
    add_leg(root, "l4")
    add_leg(root, "h100", "failing_gates")
    add_leg(root, "h200")
    _, text = comment(root)
    stale = gpuci.mark_stale(text, "b" * 40).split("\n")
    assert stale[0].startswith(gpuci.STALE_PREFIX) and stale[1] == report.MARKER
    assert (
        stale[2]
        == "> last tested commit's verdict: ❌ flashmoe-science: l4 passed, h100 failed, h200 passed"
    )


def test_legs_take_no_single_report_options(root, capsys):
    with pytest.raises(SystemExit) as stop:
        report.main(["--legs", str(root), "--dir", str(root)])
    assert stop.value.code == 2 and "drop --dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        report.main(["--dir", str(root), "--jobs", str(root / "jobs.tsv")])
    assert stop.value.code == 2 and "--jobs goes with --legs" in capsys.readouterr().err


def test_a_folder_of_no_kind_is_named_and_not_read(root):
    add_leg(root, "l4")
    add_leg(root, "h100")
    add_leg(root, "h200")
    shutil.copytree(root / "gpu-ci-reports-l4", root / "gpu-ci-reports-a100")
    _, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="success", h200="success"))
    )
    assert "> **Note:** not a GPU kind's artifact, not read: `gpu-ci-reports-a100`" in text
    assert "a100" not in text.split("\n")[0] and "<b>a100</b>" not in text


def test_a_legs_claims_reach_the_verdict_line_escaped(root):
    add_leg(root, "l4")
    add_leg(root, "h100", device="<img src=x> [H100](https://evil.example) ::set-env")
    add_leg(root, "h200")
    _, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="success", h200="success"))
    )
    line = verdict_lines(text)[1]
    # its name says H100, its compute capability (the fixture's 8.9) does not
    assert line.startswith("- ⚠️ **h100** (NVIDIA H100, sm_90a): ran on the wrong card: ")
    assert "is sm_89, not sm_90a" in line
    assert "<img" not in text and "](https://evil" not in text


@pytest.mark.parametrize(
    "first_line",
    [lambda line: "## ✅ flashmoe-science: passed", lambda line: None],
    ids=["claims-a-pass", "cut-off"],
)
def test_a_legs_verdict_is_its_records_not_its_reports_first_line(root, monkeypatch, first_line):
    """Line 1 of a leg's report is written for people: reshaped or lost, the leg still fails."""
    add_leg(root, "l4", "failing_gates")
    add_leg(root, "h100")
    add_leg(root, "h200")
    rendered = legs.render

    def reshaped(inputs, budget, header=True):
        text, truncated = rendered(inputs, budget, header=header)
        line, _, rest = text.partition("\n")
        changed = first_line(line)
        return (rest if changed is None else f"{changed}\n{rest}"), truncated

    monkeypatch.setattr(legs, "render", reshaped)
    _, text = comment(
        root, "--jobs", str(jobs_file(root, l4="success", h100="success", h200="success"))
    )
    assert text.startswith("## ❌ flashmoe-science: l4 failed, h100 passed, h200 passed\n")
    assert verdict_lines(text)[0] == (
        "- ❌ **l4** (NVIDIA L4, sm_89): 3 gates failed, register spills in 1 kernel; "
        "bench not compared (no base given)"
    )


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_a_reports_first_line_is_its_verdict_whatever_its_size(fixture):
    """The line a single report opens with and the verdict a leg reads are one value."""
    folder = FIXTURES / fixture
    base = folder / "base_build.json"
    inputs = load_inputs(
        folder,
        base if base.exists() else None,
        commit={"sha": SHA, "dirty": False, "fingerprint": None},
        run_id="fixture-run",
    )
    said = render_module.verdict(inputs)
    for budget, header in ((report.BUDGET, True), (report.BUDGET, False), (4_000, False)):
        text, _ = render_module.render(inputs, budget, header=header)
        line = f"## {ICONS[said.severity]} flashmoe-science: {said.sentence}"
        assert text.startswith(line + "\n" + report.MARKER + "\n"), (budget, header)
