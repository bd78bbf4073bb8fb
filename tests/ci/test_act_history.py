"""bench-history.yml's job, run for real under nektos/act on this machine (scripts/act/run-job.sh,
host mode), with stand-ins for what GitHub provides: a local bare repository as the remote that
holds the `bench-history` branch ($FLASHMOE_HISTORY_REMOTE), the GPU CI run's artifact as a folder
(the download-artifact stand-in) and the stub API of tests/actjobs.py (the alert's commit comment).

Each run's bench.json is the report fixture's, re-measured: its own commit, run and date, every
median moved by under 1% (main's noise), or one case slowed well outside its history's band.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from actjobs import REPO, ROOT, Api, artifact_routes, run_job, skip_unless_act_runs

from flashmoe_science.pipeline import gpukinds
from flashmoe_science.pipeline.bench import records as benchrecords
from flashmoe_science.pipeline.bench import trend
from flashmoe_science.pipeline.ci import historybranch

pytestmark = [
    skip_unless_act_runs(),
    pytest.mark.skipif(
        subprocess.run(["python3", "-c", "import jsonschema"], capture_output=True).returncode,
        reason="the offline job validates bench.json with python3's jsonschema, which is missing",
    ),
]

FIXTURE_BENCH = ROOT / "tests" / "fixtures" / "report" / "passing" / "bench.json"
WORKFLOW = "bench-history.yml"
SLOW_CASE = "dec-fp16-d128-h32kv8-b8-q1-k4096"  # one of the charted key cases


def sha_of(n: int) -> str:
    return f"{n:04x}" + "c0ffee" * 6


def run_id_of(n: int) -> int:
    return 9000 + n


def bench_doc(n: int, slow: float = 1.0) -> dict:
    """The fixture's bench.json as main's n-th run measured it: `slow` scales SLOW_CASE."""
    doc = json.loads(FIXTURE_BENCH.read_text())
    sha = sha_of(n)
    doc["commit"] = {"sha": sha, "dirty": False}
    doc["provenance"] = {
        "commit": {"sha": sha, "dirty": False, "fingerprint": None},
        "run_id": f"gpu-{run_id_of(n)}-1",
    }
    doc["timestamp"] = f"2026-11-{n:02d}T06:00:00+00:00"
    for i, case in enumerate(doc["cases"]):
        ours = case["ours"]
        if ours.get("status") != "ok":
            continue
        noise = 1 + 0.003 * ((3 * n + 2 * i) % 5 - 2)  # within ±0.6%, different per run and case
        factor = noise * (slow if case["id"] == SLOW_CASE else 1.0)
        for key in ("median_ms", "q1_ms", "q3_ms"):
            ours[key] = round(ours[key] * factor, 6)
        ours["samples_ms"] = [round(v * factor, 6) for v in ours["samples_ms"]]
    return doc


def keys_of_chart(summary: str) -> list[str]:
    listed = next(line for line in summary.splitlines() if line.startswith("Lines, in order: "))
    return re.findall(r"`([^`]+)`", listed)


def push_event(n: int, *, event: str = "push", conclusion: str = "success") -> dict:
    """The workflow_run event of GPU CI's run on main's n-th push."""
    return {
        "action": "completed",
        "repository": {
            "full_name": REPO,
            "name": "flashmoe-science",
            "default_branch": "main",
            "owner": {"login": "local"},
        },
        "workflow_run": {
            "id": run_id_of(n),
            "run_attempt": 1,
            "name": "GPU CI",
            "event": event,
            "conclusion": conclusion,
            "head_sha": sha_of(n),
            "head_branch": "main",
            "head_repository": {"full_name": REPO},
            "html_url": f"https://github.com/{REPO}/actions/runs/{run_id_of(n)}",
            "pull_requests": [],
        },
    }


@pytest.fixture
def remote(tmp_path) -> Path:
    path = tmp_path / "remote.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(path)], check=True)
    return path


def git(remote: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "--git-dir", str(remote), *args], capture_output=True, text=True, check=True
    )
    return done.stdout


def history_commits(remote: Path) -> list[str]:
    found = subprocess.run(
        ["git", "--git-dir", str(remote), "rev-list", historybranch.BRANCH],
        capture_output=True,
        text=True,
    )
    return found.stdout.split() if found.returncode == 0 else []


def seed(remote: Path, tmp_path: Path, runs: range) -> None:
    """Main's earlier runs, stored with the package (the code the job runs)."""
    for n in runs:
        doc = bench_doc(n)
        point = trend.point_of(benchrecords.from_json(doc), sha_of(n))
        scratch = tmp_path / f"seed-{n}"
        scratch.mkdir()
        historybranch.Branch(scratch, str(remote)).store(point, json.dumps(doc).encode(), "l4")


def leg_doc(doc: dict, kind: str) -> dict:
    """`doc` as the `kind` leg measured it: that leg's run id and card."""
    leg = json.loads(json.dumps(doc))
    leg["provenance"]["run_id"] = gpukinds.leg_run_id(doc["provenance"]["run_id"], kind)
    leg["gpu"]["name"] = gpukinds.KINDS[kind].card
    return leg


def run_history(
    tmp_path: Path, remote: Path, n: int, doc: dict, verdicts: bool = False, **event
) -> tuple:
    """bench-history.yml under act for main's n-th push with `doc` as each leg's bench.json
    (leg_doc) and, with `verdicts`, each leg's selection.json and gates.json of a full run;
    (exit status, log, step summary, the API's commit comments)."""
    work = tmp_path / f"run-{n}"
    for kind in gpukinds.KINDS:
        reports = work / "artifacts" / gpukinds.artifact_name(kind)
        reports.mkdir(parents=True)
        (reports / "bench.json").write_text(json.dumps(leg_doc(doc, kind)))
        if verdicts:
            block = leg_doc(doc, kind)["provenance"]
            counts = {"selected": 3, "ran": 3, "passed": 3, "failed": 0, "skipped": 0}
            records = {
                "selection.json": {"provenance": block, "mode": "full", "key": f"k-{kind}"},
                "gates.json": {
                    "provenance": block,
                    "outcome": "passed",
                    "gates": counts,
                    "tests": {**counts, "errors": 0},
                },
            }
            for name, record in records.items():
                (reports / name).write_text(json.dumps(record))
    api = Api({("POST", f"commits/{sha_of(n)}/comments"): (201, {"id": 1})})
    try:
        rc, log, out = run_job(
            work,
            api,
            WORKFLOW,
            "history",
            "workflow_run",
            push_event(n, **event),
            work / "artifacts",
            env={"FLASHMOE_HISTORY_REMOTE": str(remote)},
        )
    finally:
        api.close()
    summary = (out / "step-summary.md").read_text() if (out / "step-summary.md").exists() else ""
    return rc, log, summary, api.called("POST", "commits/")


@pytest.mark.slow
def test_each_push_adds_a_commit_with_its_bench_json_and_the_trend_grows(tmp_path, remote):
    """Pushes 1 and 2 (on an empty branch, then on it) and 6 run under act; main's runs 3 to 5 of
    the l4 leg are stored as the job stores them (seed), so its sixth run has five before it."""
    for n in (1, 2, 6):
        if n == 6:
            seed(remote, tmp_path, range(3, 6))
        before = len(history_commits(remote))
        doc = bench_doc(n)
        rc, log, summary, comments = run_history(tmp_path, remote, n, doc)
        assert rc == 0, log[-4000:]
        assert not comments
        commits = history_commits(remote)
        assert len(commits) == before + len(gpukinds.KINDS), "a commit per push and GPU kind"
        name = trend.point_name(trend.point_of(benchrecords.from_json(doc), sha_of(n)))
        newest = commits[: len(gpukinds.KINDS)]
        for commit, kind in zip(newest, reversed(gpukinds.KINDS), strict=True):  # newest first
            added = git(remote, "show", "--name-only", "--format=", commit).split()
            assert sorted(added) == [f"points/{kind}/{name}", f"runs/{kind}/{name}"]
            stored = json.loads(git(remote, "show", f"{commit}:runs/{kind}/{name}"))
            assert stored == leg_doc(doc, kind), "the leg's bench.json, as its GPU job wrote it"
            assert f"{sha_of(n)[:12]} ({kind}) stored on bench-history" in log
            assert f"## ✅ main's benchmark history at {sha_of(n)[:12]} ({kind} leg)" in summary
    # Five stored runs before the sixth: a noise band per case, the chart of the key cases over
    # the six commits, and the sixth run set beside main's distribution.
    assert "xychart-beta" in summary and "main, last 6 commits" in summary
    assert f'x-axis ["{sha_of(1)[:7]}", ' in summary and f'"{sha_of(6)[:7]}"]' in summary
    keys = sorted(case["id"] for case in bench_doc(1)["cases"])[: trend.KEY_CASES]
    assert SLOW_CASE in keys
    assert "Lines, in order: " + ", ".join(f"`{case}`" for case in keys) in summary
    assert "| case | main median ms | noise band ms | this run ms | vs main | vs base |" in summary
    row = next(line for line in summary.splitlines() if line.startswith(f"| `{SLOW_CASE}`"))
    assert "(n=5)" in row and "⚠️" not in row
    assert "left main's noise band" not in log


@pytest.mark.parametrize("slow", [1.0, 1.6], ids=["normal", "planted-regression"])
def test_a_case_slowed_outside_its_noise_band_raises_the_alert(tmp_path, remote, slow):
    seed(remote, tmp_path, range(1, 9))  # main's l4 history; the h100 leg has none yet
    before = history_commits(remote)
    rc, log, summary, comments = run_history(tmp_path, remote, 9, bench_doc(9, slow))
    assert len(history_commits(remote)) == len(before) + len(gpukinds.KINDS), "every leg stored"
    h100 = summary[summary.index("(h100 leg)") :]
    summary = summary[: summary.index("(h100 leg)")]  # the l4 leg's section
    assert "⚠️" not in h100, "the h100 leg is never set beside the l4 history"
    row = next(line for line in summary.splitlines() if line.startswith(f"| `{SLOW_CASE}`"))
    if slow == 1.0:
        assert rc == 0, log[-4000:]
        assert not comments and "⚠️" not in summary
        assert "every case inside main's noise band" in log
        return
    assert rc != 0, "the alert fails the job"
    assert summary.startswith(f"## ⚠️ main's benchmark history at {sha_of(9)[:12]}")
    assert "⚠️ slower" in row and "(n=8)" in row
    chart = summary[summary.index("xychart-beta") :]
    line = chart.splitlines()[4 + keys_of_chart(summary).index(SLOW_CASE)]
    assert float(line.split(",")[-1].rstrip("]")) > 1.5, "the chart shows the step up"
    assert len(comments) == 1, "the alert is posted on the pushed commit"
    assert comments[0]["body"].startswith("## ⚠️ main's benchmark history")
    assert SLOW_CASE in comments[0]["body"]
    assert f"1 case left main's noise band: {SLOW_CASE}" in log
    rows = [line for line in summary.splitlines() if line.startswith("| `")]
    assert len(rows) == 10 and sum("⚠️" in line for line in rows) == 1, "only the planted case"


def test_each_legs_gate_verdict_is_stored_under_its_key_linking_the_run(tmp_path, remote):
    """What a pull request that changes no gate input reuses (ci/selection.py): written here,
    by the job that runs only after main's passing pushes, never by a pull request's run."""
    rc, log, _, _ = run_history(tmp_path, remote, 1, bench_doc(1), verdicts=True)
    assert rc == 0, log[-4000:]
    for kind in gpukinds.KINDS:
        stored = json.loads(git(remote, "show", f"bench-history:verdicts/{kind}/k-{kind}.json"))
        assert (stored["sha"], stored["kind"], stored["outcome"]) == (sha_of(1), kind, "passed")
        assert stored["run_url"] == f"https://github.com/{REPO}/actions/runs/{run_id_of(1)}"
        assert stored["run_id"] == gpukinds.leg_run_id(f"gpu-{run_id_of(1)}-1", kind)


def test_a_bench_json_of_another_commit_or_run_is_not_stored(tmp_path, remote):
    seed(remote, tmp_path, range(1, 3))
    before = history_commits(remote)
    doc = bench_doc(3)
    doc["provenance"]["run_id"] = "gpu-1-1"  # an earlier run's file, left in the artifact
    rc, log, _, comments = run_history(tmp_path, remote, 3, doc)
    assert rc != 0
    assert (
        f"bench.json was written by run gpu-1-1-l4, not gpu-{run_id_of(3)}-1-l4: not stored" in log
    )
    assert history_commits(remote) == before and not comments


@pytest.mark.parametrize(
    "event", [{"event": "pull_request_target"}, {"conclusion": "failure"}], ids=["pr", "failed"]
)
def test_only_a_passing_push_to_main_is_kept(tmp_path, remote, event):
    rc, log, _, comments = run_history(tmp_path, remote, 1, bench_doc(1), **event)
    assert rc == 0, log[-3000:]
    assert history_commits(remote) == [] and not comments and "stored on" not in log


def test_the_pr_report_shows_mains_trend_from_the_branch(tmp_path, remote):
    # pr-report.yml's comment job reads each kind's points back from the same remote: main's l4
    # runs for the l4 leg, none for the h100 leg, which says so.
    seed(remote, tmp_path, range(1, 8))
    artifacts = tmp_path / "artifacts"
    tested = json.loads((ROOT / "tests/fixtures/report/passing/bench.json").read_text())["commit"]
    tested = tested["sha"]
    for kind in gpukinds.KINDS:
        reports = artifacts / gpukinds.artifact_name(kind)
        shutil.copytree(ROOT / "tests" / "fixtures" / "report" / "passing", reports)
        for name in ("expected.md", "base_build.json"):
            (reports / name).unlink()
        for name in ("stages.json", "env.json", "build.json", "gates.json", "bench.json"):
            doc = json.loads((reports / name).read_text())
            doc["provenance"]["run_id"] = gpukinds.leg_run_id("gpu-1-1", kind)
            for stage in (doc.get("stages") or {}).values():
                stage["provenance"]["run_id"] = gpukinds.leg_run_id("gpu-1-1", kind)
            if isinstance(doc.get("gpu"), dict):
                doc["gpu"]["name"] = gpukinds.KINDS[kind].card
                doc["gpu"]["capability"] = gpukinds.KINDS[kind].capability
            (reports / name).write_text(json.dumps(doc))
    (artifacts / "gpu-ci-approval").mkdir()
    (artifacts / "gpu-ci-approval" / "approval.json").write_text(
        json.dumps({"run": True, "pr": 7, "sha": tested, "run_id": "1"})
    )
    jobs = [{"name": gpukinds.job_name(kind), "conclusion": "success"} for kind in gpukinds.KINDS]
    uploaded = {path.name: path for path in sorted(artifacts.iterdir())}
    api = Api(
        {
            **artifact_routes(uploaded, run=1, jobs=jobs),  # the report job fetches them itself
            ("GET", "pulls/7/files"): (200, [{"filename": "csrc/flash_fwd.cu"}]),
            ("GET", "pulls/7"): (
                200,
                {"number": 7, "head": {"sha": tested}, "base": {"repo": {"full_name": REPO}}},
            ),
        }
    )
    try:
        rc, log, out = run_job(
            tmp_path,
            api,
            "pr-report.yml",
            "comment",
            "workflow_run",
            None,
            env={"FLASHMOE_HISTORY_REMOTE": str(remote)},
        )
    finally:
        api.close()
    assert rc == 0, log[-4000:]
    assert "fetch-points: 7 points of bench-history (l4)" in log
    assert "fetch-points: 0 points of bench-history (h100)" in log
    assert "fetch-points: 0 points of bench-history (h200)" in log
    comment = (out / "artifacts" / "comments" / "flashmoe-science-report-7.md").read_text()
    assert comment.startswith("## ✅ flashmoe-science: l4 passed, h100 passed, h200 passed\n")
    l4 = comment[comment.index("<b>l4</b>") : comment.index("<b>h100</b>")]
    h100 = comment[comment.index("<b>h100</b>") : comment.index("<b>h200</b>")]
    section = l4[l4.index("Performance history (main)") :]
    assert "7 stored runs of main" in l4
    assert "xychart-beta" in section and "main, last 7 commits" in section
    assert "| case | main median ms | noise band ms | this run ms | vs main | vs base |" in section
    row = next(line for line in section.splitlines() if line.startswith(f"| `{SLOW_CASE}`"))
    assert "(n=7)" in row and "no change" in row  # main's distribution and the interleaved base
    assert "No stored main runs of the `h100` leg yet" in h100 and "main, last" not in h100
