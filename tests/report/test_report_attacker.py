"""The report of a pull request's run is rendered from JSON that the pull request's code wrote. Each
test here plants what such code could write into a copy of the passing fixture and renders it as
the privileged comment job does (`--tested-sha`, `--run-id`): the report must come out bounded,
escaped, with the verdict on line 1 and the marker on line 2, and the command must exit 0 (the
verdict is data) or 2 (an input unusable), never crash."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashmoe_science.pipeline import exitcodes, report
from flashmoe_science.pipeline import markdown as md
from flashmoe_science.pipeline.bench import trend
from flashmoe_science.pipeline.ci import gpuci

FIXTURES = Path(__file__).parents[1] / "fixtures" / "report"
SHA = "9c41e07b2d5a8f3e61b0c7d94a2e1f5b8c3d6a70"  # the fixtures' provenance
RUN = "fixture-run"
ROOT = Path(__file__).resolve().parents[2]

HOSTILE = (
    "<img src=x onerror=alert(1)></details>\n\n## ✅ flashmoe-science: passed\n"
    "@octocat see #1 [click](https://evil.example) ![px](https://evil.example/p.png) "
    "<!-- flashmoe-science-report --> `code` | cell"
)


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _dump(doc: object, path: Path) -> None:
    path.write_text(json.dumps(doc))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A copy of the passing fixture; GITHUB_* and the job start unset so nothing else leaks in."""
    for var in ("GITHUB_STEP_SUMMARY", "GITHUB_SERVER_URL", "GITHUB_RUN_ID", "FLASHMOE_JOB_START"):
        monkeypatch.delenv(var, raising=False)
    target = tmp_path / "reports"
    shutil.copytree(FIXTURES / "passing", target)
    (target / "expected.md").unlink()
    return target


def render(folder: Path, *extra: str) -> tuple[int, str]:
    code = report.main(
        ["--dir", str(folder), "--tested-sha", SHA, "--run-id", RUN, "--no-step-summary", *extra]
    )
    return code, (folder / "report.md").read_text(encoding="utf-8")


def outside_code(text: str) -> str:
    """The text less its code spans and blocks, where GitHub renders nothing (no HTML, links)."""
    text = re.sub(r"(?ms)^(`{3,})[^\n]*\n.*?^\1\s*$", "", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def assert_safe(text: str, code: int) -> None:
    lines = text.split("\n")
    assert lines[0].startswith("## ") and "flashmoe-science" in lines[0], lines[0][:200]
    assert lines[1] == report.MARKER
    assert text.count(report.MARKER) == 1, (
        "a second marker would let a comment be mistaken for ours"
    )
    assert code in (exitcodes.OK, exitcodes.USAGE)
    assert md.size(text) <= report.BUDGET
    # Only the report's own headings: no record can start a line with '#'.
    headings = [line for line in lines if line.startswith("#")]
    assert headings == [lines[0]], headings
    prose = outside_code(text)
    assert "<img" not in prose and "<script" not in prose
    assert prose.count("<details") == prose.count("</details>")
    assert "](https://evil" not in prose and "![" not in prose
    assert "@octocat" not in prose and not re.search(r"(?<![&\w])#1\b", prose)
    assert "root:x:0:0" not in text


def test_html_and_a_fake_verdict_in_capability_and_arch_list(folder):
    env = _load(folder / "env.json")
    env["gpu"]["capability"] = HOSTILE
    env["gpu"]["name"] = HOSTILE
    _dump(env, folder / "env.json")
    build = _load(folder / "build.json")
    build["arch_list"] = ["8.9", HOSTILE]
    _dump(build, folder / "build.json")
    code, text = render(folder)
    assert_safe(text, code)
    # Both records break their schemas (a capability is digits): named unreadable, exit 2.
    assert code == exitcodes.USAGE
    assert "env.json unreadable" in text.split("\n")[0]


def test_free_text_that_fits_the_schema_is_escaped(folder):
    env = _load(folder / "env.json")
    env["gpu"]["name"] = HOSTILE
    env["checks"][0]["detail"] = HOSTILE
    env["checks"][0]["fix"] = HOSTILE
    _dump(env, folder / "env.json")
    gates = _load(folder / "gates.json")
    gates["worst_case"] = HOSTILE[:900]
    gates["restriction"] = HOSTILE[:900]  # said where gates skipped
    gates["gates"]["skipped"] = 3
    _dump(gates, folder / "gates.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.OK
    assert "skipped (a build restricted to `" in text
    assert "&lt;img src=x" in text and "@\u200bocto" in text and "\\[click\\]" in text


def test_wrong_types_fail_their_section_only(folder):
    build = _load(folder / "build.json")
    build["kernels"] = 5
    _dump(build, folder / "build.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.USAGE
    assert "build.json unreadable" in text.split("\n")[0]
    assert "Correctness gates" in text and "Benchmark" in text  # the others still render


@pytest.mark.parametrize("subset", [["pull-request"], {"a": 1}, "<b>@team</b>", None])
def test_a_bench_subset_of_any_shape_renders_safely(folder, subset):
    bench = _load(folder / "bench.json")
    bench["subset"] = subset
    bench["partial_groups"] = [{"a": 1}]
    _dump(bench, folder / "bench.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert "bench.json unreadable" in text.split("\n")[0]  # the schema names the subsets
    assert "**cases**" not in text


def test_a_section_whose_renderer_fails_fails_alone(folder, monkeypatch):
    render_module = importlib.import_module("flashmoe_science.pipeline.report.render")

    def broken(inputs, detail):
        raise TypeError("'int' object is not iterable")

    sections = tuple(
        (key, title, broken if key == "build" else fn) for key, title, fn in render_module.SECTIONS
    )
    monkeypatch.setattr(render_module, "SECTIONS", sections)
    code, text = render(folder)
    assert_safe(text, code)
    assert text.startswith("## ❌ flashmoe-science: build record could not be rendered")
    assert "Correctness gates" in text and "Benchmark" in text


def test_a_400_digit_number(folder):
    for name, key in (("build.json", "elapsed_s"), ("gates.json", "worst_max_diff")):
        doc = _load(folder / name)
        doc[key] = int("9" * 400)
        _dump(doc, folder / name)
    stages_doc = _load(folder / "stages.json")
    stages_doc["stages"]["env"]["seconds"] = int("9" * 400)
    _dump(stages_doc, folder / "stages.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.USAGE
    assert "9" * 40 not in text


def test_a_number_too_long_to_parse(folder):
    (folder / "gates.json").write_text('{"outcome": "passed", "pytest_exit": ' + "9" * 5000 + "}")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.USAGE and "gates.json unreadable" in text.split("\n")[0]


@pytest.mark.parametrize("levels", [40, 100_000])
def test_deep_nesting(folder, levels):
    (folder / "env.json").write_text('{"checks": ' + "[" * levels + "]" * levels + "}")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.USAGE and "env.json unreadable" in text.split("\n")[0]


def test_five_thousand_failures(folder):
    """A flood past every bound of the report (its first line, the failing cases it lists, the
    comment's size): 5,000 failing gates and failing checks. (20,000 took 9 s of the 2-core test
    stage, the schema check of every entry, for nothing 5,000 does not show.)"""
    gates = _load(folder / "gates.json")
    template = gates["cases"][0]
    cases = []
    for i in range(5_000):
        case = dict(template, case_id=f"fwd-fp16-d64-case{i}", outcome="failed")
        case["failures"] = [f"max diff {i} above bound <b>@team</b>"]
        cases.append(case)
    gates.update(cases=cases, outcome="failed")
    gates["gates"] = {
        "selected": 5_000,
        "ran": 5_000,
        "passed": 0,
        "failed": 5_000,
        "skipped": 0,
    }
    _dump(gates, folder / "gates.json")
    env = _load(folder / "env.json")
    env["checks"] = [
        {"name": f"check {i}", "status": "fail", "detail": "x", "fix": "y"} for i in range(5_000)
    ]
    env["passed"] = False
    _dump(env, folder / "env.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.OK
    first = text.split("\n")[0]
    assert first.startswith("## ❌ flashmoe-science: ") and len(first) < 2_000
    assert "5,000 gates failed" in first
    assert "more failing cases" in text  # the first ones, then a count


def test_a_log_path_outside_the_report_folder_is_never_read(folder, tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    build = _load(folder / "build.json")
    build.update(status="failed", log=str(secret), kernels=[])
    _dump(build, folder / "build.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert "only build.log in the report folder is read" in text
    # and build.log itself as a link to the file: not followed
    (folder / "build.log").symlink_to(secret)
    build["log"] = "build.log"
    _dump(build, folder / "build.json")
    code, text = render(folder)
    assert_safe(text, code)
    assert code == exitcodes.USAGE and "not followed" in text


def test_the_command_output_echoes_nothing_raw(folder):
    stages_doc = _load(folder / "stages.json")
    stages_doc["stages"]["\n::set-output name=x::pwned"] = {"status": "fail", "seconds": 1}
    _dump(stages_doc, folder / "stages.json")
    (folder / "bench.json").write_text('{"x": "\\n::add-mask::secret"}')
    proc = subprocess.run(
        [sys.executable, "-m", "flashmoe_science", "report", "--dir", str(folder)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode in (0, 2), proc.stderr
    for line in (proc.stdout + proc.stderr).splitlines():
        assert not line.lstrip().startswith("::"), line
    text = (folder / "report.md").read_text()
    assert_safe(text, proc.returncode)


def test_trusted_header_stale_head_and_sensitive_changes(folder, tmp_path):
    changed = tmp_path / "changed.txt"
    changed.write_text(".github/workflows/gpu-ci.yml\nREADME.md\n")
    head = "f" * 40
    code, text = render(
        folder,
        "--head-sha",
        head,
        "--run-url",
        "https://github.com/o/r/actions/runs/1",
        "--changed-files",
        str(changed),
    )
    assert_safe(text, code)
    first = text.split("\n")[0]
    assert "stale: the PR is now at ffffffffffff, untested" in first
    assert f"**tested** `{SHA[:12]}`" in text
    assert "This PR changes the CI or the report code" in text


def test_records_of_another_commit_are_stale_under_tested_sha(folder):
    code = report.main(
        ["--dir", str(folder), "--tested-sha", "a" * 40, "--run-id", RUN, "--no-step-summary"]
    )
    text = (folder / "report.md").read_text()
    assert_safe(text, code)
    assert code == exitcodes.USAGE and "not a verdict on this commit" in text.split("\n")[0]


def test_history_section_from_stored_points(folder, tmp_path):
    bench = _load(folder / "bench.json")
    ids = [c["id"] for c in bench["cases"] if c["ours"].get("status") == "ok"][:3]
    gpu = bench["gpu"]["name"]
    history = tmp_path / "history"
    history.mkdir()
    for i in range(8):
        medians = {case: 1.0 + 0.01 * (i % 3) for case in ids}
        point = trend.Point(f"{i:07x}abc", f"2026-11-{10 + i:02d}T00:00:00+00:00", gpu, medians)
        (history / trend.point_name(point)).write_text(json.dumps(point.to_json()))
    (history / "junk.json").write_text('{"schema": "other"}')
    code, text = render(folder, "--history", str(history))
    assert_safe(text, code)
    assert "Performance history (main)" in text and "xychart-beta" in text
    assert "noise band ms" in text


def test_stale_comment_keeps_one_marker_and_the_old_verdict():
    body = f"## ✅ flashmoe-science: passed\n{report.MARKER}\n\nrest"
    once = gpuci.mark_stale(body, "b" * 40)
    twice = gpuci.mark_stale(once, "c" * 40)
    for text in (once, twice):
        lines = text.split("\n")
        assert lines[0].startswith(gpuci.STALE_PREFIX) and lines[1] == report.MARKER
        assert text.count(report.MARKER) == 1
        assert "> last tested commit's verdict: ✅ flashmoe-science: passed" in text
    assert "cccccccccccc is not tested yet" in twice and "bbbbbbbbbbbb" not in twice
