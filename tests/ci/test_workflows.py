"""Static checks of .github/workflows: the rules that keep a self-hosted GPU runner on a public
repository safe, and the wiring between the workflows. GitHub cannot be reached from here, so these
run where the workflows are written; cpu-ci.yml also runs actionlint, and pre-commit runs zizmor and
check-jsonschema on every change."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from flashmoe_science.pipeline import gpukinds

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev dependency group)")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
ACTIONLINT = ROOT / ".github" / "actionlint.yaml"
# Labels actionlint knows without configuration (GitHub's own runner labels).
BUILTIN_SELF_HOSTED = {"self-hosted", "linux", "macos", "windows", "x64", "arm", "arm64"}
SHA_PIN = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}$")
DIGEST_PIN = re.compile(r"^docker://[\w./:-]+@sha256:[0-9a-f]{64}$")
IMAGE_DIGEST_PIN = re.compile(r"^[\w./:-]+@sha256:[0-9a-f]{64}$")
# What a `run:` in the report job must never do: run code from the repository or the artifact.
EXECUTES_CODE = re.compile(
    r"(\./|\bscripts/|\bpython[0-9.]*\b|\bnox\b|\bpip\b|\bpytest\b|\bmake\b|\bbash\b|\bsh\s|"
    r"\bsource\b|^\s*\.\s|\bnpm\b|\bnode\b|\bchmod\b|\bgit\s+(clone|checkout|fetch)\b|\bgh\s+pr\s+checkout\b)",
    re.MULTILINE,
)


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def triggers(workflow: dict) -> dict:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return on or {}


def all_workflows() -> dict[str, dict]:
    return {
        path.name: yaml.safe_load(path.read_text()) for path in sorted(WORKFLOWS.glob("*.y*ml"))
    }


def all_jobs():
    for name, workflow in all_workflows().items():
        for job_id, job in workflow["jobs"].items():
            yield name, workflow, job_id, job


def runs_on_labels(job: dict) -> list[str]:
    labels = job.get("runs-on", [])
    if isinstance(labels, dict):
        labels = labels.get("labels", [])
    return [labels] if isinstance(labels, str) else list(labels)


def is_self_hosted(job: dict) -> bool:
    return "self-hosted" in runs_on_labels(job)


def legs(job: dict) -> list[dict]:
    """A job's matrix legs (its `include` entries); [{}] for a job without a matrix."""
    matrix = (job.get("strategy") or {}).get("matrix") or {}
    assert set(matrix) <= {"include"}, "legs are listed with include only"
    return matrix.get("include") or [{}]


def expand(text: str, leg: dict) -> str:
    """`text` with the leg's ${{ matrix.KEY }} filled in."""
    return re.sub(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", lambda m: str(leg[m.group(1)]), text)


def leg_labels(job: dict) -> list[list[str]]:
    """The runner labels each leg of a job asks for."""
    return [[expand(label, leg) for label in runs_on_labels(job)] for leg in legs(job)]


def steps(job: dict) -> list[dict]:
    return job.get("steps", [])


EVENTS = ("pull_request_target", "push", "schedule")
_BY_EVENT = re.compile(r"^\$\{\{ github\.event_name == '(\w+)' && (\d+) \|\| (\d+) \}\}$")


def minutes(limit, event: str) -> int:
    """A timeout-minutes for one event: a number, or `${{ github.event_name == 'E' && A || B }}`
    (the one form the workflows use: the scheduled run's longer limits)."""
    if isinstance(limit, int):
        return limit
    match = _BY_EVENT.match(str(limit))
    assert match, f"timeout-minutes {limit!r} is neither a number nor the one event switch"
    return int(match[2]) if event == match[1] else int(match[3])


def test_the_workflows_exist():
    assert {"gpu-ci.yml", "pr-report.yml", "cpu-ci.yml"} <= set(all_workflows())


def test_pull_request_target_only_where_main_decides_what_runs():
    # GPU CI is the one workflow on pull_request_target: its trusted jobs run main's code, and the
    # PR's code runs only in the GPU job, on the commit `approve` allowed (tests/ci/test_trust.py).
    for name, workflow in all_workflows().items():
        if "pull_request_target" in triggers(workflow):
            assert name == "gpu-ci.yml", name


def test_every_job_has_a_timeout_and_explicit_permissions():
    for name, workflow, job_id, job in all_jobs():
        assert "timeout-minutes" in job, f"{name}:{job_id} has no timeout-minutes"
        assert "permissions" in job or "permissions" in workflow, (
            f"{name}:{job_id} has implicit permissions"
        )
        for event in EVENTS:
            for step in steps(job):
                limit = step.get("timeout-minutes")
                if limit is not None:
                    assert minutes(limit, event) < minutes(job["timeout-minutes"], event), (
                        f"{name}:{job_id}: step {step.get('name')} as long as its job ({event})"
                    )


def test_the_test_stage_stops_itself_before_its_step_is_killed():
    """The GPU job's test step sets the stage's time limit (timelimit.py) inside its timeout, with
    room for the stacks, the names and the record: a hung run names its tests in the log."""
    from flashmoe_science.pipeline.gates import timelimit

    test = next(s for s in steps(load("gpu-ci.yml")["jobs"]["gpu"]) if s.get("id") == "test")
    limit = test["env"][timelimit.LIMIT_VAR]
    for event in EVENTS:
        margin = 60 * minutes(test["timeout-minutes"], event) - minutes(limit, event)
        assert timelimit.GRACE_S + 15 <= margin <= 60, (event, margin)


def test_long_gpu_steps_have_timeouts_that_leave_room_for_the_upload():
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    for step in steps(job):
        assert "timeout-minutes" in step, (
            f"gpu step {step.get('name') or step.get('uses')} has no timeout"
        )
    for event in EVENTS:
        total = sum(minutes(step["timeout-minutes"], event) for step in steps(job))
        assert total < minutes(job["timeout-minutes"], event), event


def test_the_gpu_stages_limits_fit_the_h200_budget_with_margin():
    """Each stage may take at most the whole job's budget (stages.BUDGET_S, on an H200) and a
    half; the test stage, whose budget is its own, between one and a half and three times it:
    a stage that drifts over its budget is cut off, not waited for. The scheduled run, with the
    tests marked long, gives its test stage longer."""
    from flashmoe_science.pipeline import stages

    job = load("gpu-ci.yml")["jobs"]["gpu"]
    limits = {s["name"]: s["timeout-minutes"] for s in steps(job) if "name" in s}
    for name in ("env", "select", "build", "test", "bench", "report"):
        assert minutes(limits[name], "pull_request_target") * 60 <= 1.5 * stages.BUDGET_S["job"]
    sanitize = next(n for n in limits if n.startswith("sanitize"))
    assert minutes(limits[sanitize], "push") * 60 <= 1.5 * stages.BUDGET_S["job"]
    test = minutes(limits["test"], "pull_request_target") * 60
    assert 1.5 * stages.BUDGET_S["test"] <= test <= 3 * stages.BUDGET_S["test"]
    assert minutes(limits["test"], "schedule") >= 30, "the long tests have the time they need"
    assert minutes(job["timeout-minutes"], "pull_request_target") <= 90


def test_cpu_ci_runs_the_long_tests_daily_and_only_then():
    """The tests marked long leave the CPU test stage of every pull request and push (3 minutes on
    2 cores, issue 44) for CPU CI's daily scheduled run of main's head, which selects them
    (FLASHMOE_LONG_TESTS, the stage's --long) with the time they need, in a concurrency group of
    its own (never replacing a push's waiting run of the same commit), and reports and uploads
    as every run does. tests/gates/test_testing.py runs the selection itself."""
    workflow = load("cpu-ci.yml")
    assert "schedule" in triggers(workflow)
    assert "schedule" in workflow["concurrency"]["group"]
    job = workflow["jobs"]["cpu-tests"]
    assert job["env"]["FLASHMOE_LONG_TESTS"] == (
        "${{ github.event_name == 'schedule' && '1' || '0' }}"
    )
    test = next(s for s in steps(job) if str(s.get("run", "")).strip() == "nox -s env build test")
    assert minutes(test["timeout-minutes"], "schedule") >= 30, "the long tests have the time"
    assert minutes(test["timeout-minutes"], "push") == 20
    tail = [str(s.get("run") or s.get("uses")) for s in steps(job)[steps(job).index(test) :]]
    assert any("flashmoe_science report" in step for step in tail)
    assert any(step.startswith("actions/upload-artifact@") for step in tail)


def test_a_setup_step_that_skips_the_environment_check_comes_before_the_env_stage():
    """setup_environment.sh --no-check leaves the environment check to the job's env stage (it
    ran twice in a row, ~4 s of every GPU job): every job whose setup passes it runs `nox -s env`
    in a later step."""
    skipping = 0
    for name, _, job_id, job in all_jobs():
        runs = [str(step.get("run", "")) for step in steps(job)]
        for index, run in enumerate(runs):
            if "setup_environment.sh" in run and "--no-check" in run:
                skipping += 1
                later = " ".join(runs[index + 1 :])
                assert "nox -s env" in later, f"{name}:{job_id} never checks its environment"
    assert skipping >= 2, "the GPU job and the CPU tests job skip it"


def test_workflow_permissions_are_read_only_or_none():
    for name, workflow in all_workflows().items():
        assert workflow.get("permissions") in ({}, {"contents": "read"}), name


def test_every_action_and_image_is_pinned():
    for name, _, job_id, job in all_jobs():
        for step in steps(job):
            uses = step.get("uses")
            if uses:
                assert SHA_PIN.match(uses) or DIGEST_PIN.match(uses), (
                    f"{name}:{job_id}: {uses} is not pinned"
                )
        container = job.get("container")
        if container:
            image = container if isinstance(container, str) else container["image"]
            assert IMAGE_DIGEST_PIN.match(image), (
                f"{name}:{job_id}: image {image} is not pinned by digest"
            )


def test_pinned_actions_say_which_version():
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for line in path.read_text().splitlines():
            match = re.search(r"uses:\s*(\S+@[0-9a-f]{40})(.*)$", line)
            if match:
                assert re.search(r"#\s*v\d", match.group(2)), (
                    f"{path.name}: {line.strip()} lacks a # vX comment"
                )


def test_checkouts_do_not_persist_credentials():
    for name, _, job_id, job in all_jobs():
        for step in steps(job):
            if str(step.get("uses", "")).startswith("actions/checkout@"):
                assert step.get("with", {}).get("persist-credentials") is False, f"{name}:{job_id}"


def test_gpu_checkout_has_full_history_for_the_base():
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    checkout = next(s for s in steps(job) if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0


def test_gpu_runner_labels_are_declared_for_actionlint():
    declared = set(yaml.safe_load(ACTIONLINT.read_text())["self-hosted-runner"]["labels"])
    for name, _, job_id, job in all_jobs():
        if is_self_hosted(job):
            for labels in leg_labels(job):
                custom = set(labels) - BUILTIN_SELF_HOSTED
                assert custom <= declared, f"{name}:{job_id}: undeclared labels {custom - declared}"
    assert leg_labels(load("gpu-ci.yml")["jobs"]["gpu"]) == [
        ["self-hosted", "linux", "x64", "gpu", kind] for kind in gpukinds.KINDS
    ]


def test_the_gpu_job_is_a_matrix_of_the_gpu_kinds_each_built_for_its_card():
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    assert job["strategy"]["fail-fast"] is False, "a failing leg must not cancel the other"
    assert [(leg["gpu"], leg["arch"]) for leg in legs(job)] == [
        (kind.label, kind.arch) for kind in gpukinds.KINDS.values()
    ]
    assert [leg["arch"] for leg in legs(job)] == ["8.9", "9.0a", "9.0a"], "l4, h100 and h200"
    # every build of a leg (build, test, bench's head and base) takes the leg's arch
    assert job["env"]["TORCH_CUDA_ARCH_LIST"] == "${{ matrix.arch }}"
    assert job["env"]["FLASHMOE_GPU_KIND"] == "${{ matrix.gpu }}"
    for leg in legs(job):
        kind = leg["gpu"]
        assert expand(job["name"], leg) == gpukinds.job_name(kind), "what the jobs API lists"
        run_id = expand(job["env"]["FLASHMOE_RUN_ID"], leg)
        assert run_id == gpukinds.leg_run_id(
            "gpu-${{ github.run_id }}-${{ github.run_attempt }}", kind
        )
        upload = next(
            s for s in steps(job) if s.get("uses", "").startswith("actions/upload-artifact@")
        )
        assert expand(upload["with"]["name"], leg) == gpukinds.artifact_name(kind)
    # the build stage takes the arch from TORCH_CUDA_ARCH_LIST when no --arch is given
    build = next(s["run"] for s in steps(job) if s.get("name") == "build")
    assert "--arch" not in build
    # the planted-bug tests' unit is built here, beside the job's, not in the test stage
    # (the script itself: test_a_pull_requests_build_step_builds_its_base_beside)
    assert "args=(--backend cuda --plants)" in build


def test_the_gate_needs_every_leg_and_reads_each_legs_result():
    gate = load("gpu-ci.yml")["jobs"]["gpu-gate"]
    assert set(gate["needs"]) == {"approve", "gpu"}
    assert gate["permissions"]["actions"] == "read", "the run's jobs name each leg"
    step = next(s for s in steps(gate) if "gpuci gate" in s.get("run", ""))
    assert step["env"]["RUN_ID"] == "${{ github.run_id }}" and '--run-id "$RUN_ID"' in step["run"]


def test_concurrency_cancels_superseded_prs_but_never_main():
    gpu = load("gpu-ci.yml")["concurrency"]
    assert "github.event.pull_request.number || inputs.pr || github.sha" in gpu["group"]
    assert gpu["cancel-in-progress"] == "${{ github.event_name == 'pull_request_target' }}"
    cpu = load("cpu-ci.yml")["concurrency"]
    assert "github.event.pull_request.number || github.sha" in cpu["group"]
    assert cpu["cancel-in-progress"] == "${{ github.event_name == 'pull_request' }}"


def test_gpu_job_uploads_reports_even_when_a_stage_fails():
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    upload = next(s for s in steps(job) if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "${{ always() }}"
    assert upload["with"]["path"] == "reports/"
    report = next(s for s in steps(job) if s.get("name") == "report")
    assert report["if"] == "${{ always() }}"
    names = [s.get("name") for s in steps(job)]
    assert (
        names.index("env")
        < names.index("build")
        < names.index("test")
        < names.index("bench")
        < names.index("report")
    )
    assert all(
        re.search(
            r"\bnox -s " + stage + r"\b",
            next(s["run"] for s in steps(job) if s.get("name") == stage),
        )
        for stage in ("env", "build", "test", "bench", "report")
    )


def test_a_leg_that_reuses_mains_verdict_skips_build_test_and_bench():
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    names = [s.get("name") for s in steps(job)]
    assert names.index("env") < names.index("select") < names.index("build")
    select = next(s for s in steps(job) if s.get("name") == "select")
    assert select["id"] == "select" and re.search(r"\bnox -s select\b", select["run"])
    # only a pull request may reuse, and workflow_dispatch's `full` forces the matrix
    assert select["env"]["PR"] == "${{ needs.approve.outputs.pr }}"
    assert select["env"]["FULL"] == "${{ inputs.full }}"
    assert "--pull-request" in select["run"] and "--full" in select["run"]
    assert select["env"]["BASE"] == "${{ steps.changes.outputs.base }}"
    for name in ("build", "test"):
        step = next(s for s in steps(job) if s.get("name") == name)
        assert step["if"] == "${{ steps.select.outputs.mode != 'reuse' }}", name
    bench = next(s for s in steps(job) if s.get("name") == "bench")
    assert "steps.build.outcome == 'success'" in bench["if"], "no build, no bench"


@pytest.mark.parametrize(
    ("event", "has_base", "expected"),
    [
        ({"PR": "7", "BASE_REF": "main"}, True, "-s bench -- --pr --base origin/main"),
        # act on a copy without history (scripts/act/gpu-job.sh): no base to compare with
        ({"PR": "7", "BASE_REF": "main", "ACT": "true"}, False, "-s bench -- --pr"),
        ({"PR": "", "BASE_REF": ""}, True, "-s bench --"),  # a push to main, the nightly run
    ],
)
def test_a_pull_request_benches_one_case_per_family_against_its_base(
    tmp_path, event, has_base, expected
):
    """The bench step's script, run with stand-ins for nox and git: a pull request times the --pr
    subset against its base (the job's minutes); main's pushes and the scheduled run the whole
    matrix, with the history it records."""
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    bench = next(s for s in steps(job) if s.get("name") == "bench")
    assert bench["env"]["PR"] == "${{ needs.approve.outputs.pr }}"
    assert bench["env"]["BASE_REF"] == "${{ needs.approve.outputs.base_ref }}"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nox").write_text('#!/bin/sh\necho "nox $*"\n')
    (bindir / "git").write_text(f"#!/bin/sh\nexit {0 if has_base else 1}\n")
    for tool in ("nox", "git"):
        (bindir / tool).chmod(0o755)
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", bench["run"]],
        env={"PATH": f"{bindir}:/usr/bin:/bin", **event},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"nox {expected}"


def run_with_nox_stand_in(tmp_path, script: str, env: dict) -> str:
    """Runs a step's script as the runner's bash does, with `nox` a stand-in that prints its
    command line; returns that line."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nox").write_text('#!/bin/sh\necho "nox $*"\n')
    (bindir / "nox").chmod(0o755)
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
        env={"PATH": f"{bindir}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"BASE_REF": "main"}, "nox -s build -- --backend cuda --plants --base origin/main"),
        ({"BASE_REF": ""}, "nox -s build -- --backend cuda --plants"),
    ],
    ids=["pull-request", "push-or-schedule"],
)
def test_a_pull_requests_build_step_builds_its_base_beside(tmp_path, env, expected):
    """The build step's script, run with a stand-in for nox: a pull request's base (what its bench
    step compares with, the same `origin/` ref) builds beside the head and the plant unit."""
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    step = next(s for s in steps(job) if s.get("name") == "build")
    bench = next(s for s in steps(job) if s.get("name") == "bench")
    assert step["env"]["BASE_REF"] == bench["env"]["BASE_REF"]
    assert (
        '--base "origin/$BASE_REF"' in step["run"] and '--base "origin/$BASE_REF"' in bench["run"]
    )
    assert run_with_nox_stand_in(tmp_path, step["run"], env) == expected


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        ("pull_request_target", "nox -s test -- --require-gpu --no-cpu-twins"),
        ("push", "nox -s test -- --require-gpu --no-cpu-twins"),
        ("schedule", "nox -s test -- --require-gpu"),
    ],
)
def test_the_gpu_test_stage_leaves_the_cpu_twins_to_cpu_ci_but_on_schedule(
    tmp_path, event, expected
):
    """The test step's script, run with a stand-in for nox: CPU CI runs the CPU implementation's
    tests on every pull request and push (cpu-ci.yml), so the GPU leg leaves them out there; the
    scheduled run keeps them on the GPU machine's torch."""
    assert {"pull_request", "push"} <= set(triggers(load("cpu-ci.yml")))
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    test = next(s for s in steps(job) if s.get("name") == "test")
    assert test["env"]["EVENT"] == "${{ github.event_name }}"
    assert run_with_nox_stand_in(tmp_path, test["run"], {"EVENT": event}) == expected


def test_no_run_reads_what_a_pull_requests_run_wrote():
    """No cache anywhere (a pull request's run could write one another run reads); the only job
    that writes to the repository (main's verdicts and bench history) runs after main's pushes."""
    writers = []
    for name, _, job_id, job in all_jobs():
        for step in steps(job):
            assert not str(step.get("uses", "")).startswith("actions/cache"), (name, job_id)
        if (job.get("permissions") or {}).get("contents") == "write":
            writers.append((name, job_id))
    assert writers == [("bench-history.yml", "history")]
    history = load("bench-history.yml")["jobs"]["history"]
    assert "github.event.workflow_run.event == 'push'" in history["if"]
    assert "github.event.workflow_run.conclusion == 'success'" in history["if"]
    step = next(s for s in steps(history) if "gpuci history" in s.get("run", ""))
    assert '--run-url "$RUN_URL"' in step["run"], "each verdict links main's run"


def test_sanitize_runs_only_when_csrc_changed_beside_the_test_stage_and_before_the_bench():
    """Started before the test stage (it needs the build, not a quiet GPU), waited for after it
    and before the bench (which needs the GPU to itself); the wait's step carries the verdict."""
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    names = [s.get("name") for s in steps(job)]
    start = next(s for s in steps(job) if s.get("id") == "sanitize_start")
    wait = next(s for s in steps(job) if s.get("id") == "sanitize")
    assert start["run"].strip() == "nox -s sanitize -- --background"
    assert wait["run"].strip() == "nox -s sanitize -- --wait"
    assert "steps.changes.outputs.csrc == 'true'" in start["if"]
    assert "steps.build.outcome == 'success'" in start["if"]
    assert (
        "steps.sanitize_start.outcome == 'success'" in wait["if"] and "!cancelled()" in wait["if"]
    )
    assert wait["continue-on-error"] is False
    assert (
        names.index("build")
        < names.index(start["name"])
        < names.index("test")
        < names.index(wait["name"])
        < names.index("bench")
    )


def test_report_job_never_checks_out_or_runs_pr_code():
    workflow = load("pr-report.yml")
    assert set(triggers(workflow)) == {"workflow_run"}
    assert workflow["permissions"] == {}
    for job_id, job in workflow["jobs"].items():
        assert not is_self_hosted(job), job_id
        assert job["permissions"] == {
            "contents": "read",
            "actions": "read",
            "pull-requests": "write",
        }, job_id
        for step in steps(job):
            uses = step.get("uses", "")
            assert not uses.startswith(("./", "docker://")), f"{job_id}: {uses}"
            assert uses.split("@")[0] in (
                "",
                "actions/checkout",
                "actions/download-artifact",
                "marocchino/sticky-pull-request-comment",
            )
            if uses.startswith("actions/checkout@"):  # the default branch: no ref, no repository
                assert set(step.get("with", {})) == {"persist-credentials"}, step
            if uses.startswith("actions/download-artifact@"):  # outside the workspace
                assert step["with"]["path"].startswith("${{ runner.temp }}/"), step
            run = step.get("run", "")
            assert "${{" not in run, (
                f"{job_id}: step {step.get('name')} inlines an expression (use env:)"
            )
            # Nothing from the artifact runs: only main's own code and tools read it.
            assert not re.search(r"\$(ARTIFACT|APPROVAL)\S*\.(sh|py)\b|source |\bbash \$", run), run
            assert "$ARTIFACT/report.md" not in run, "the artifact's report.md is never posted"


def test_report_job_reads_the_gpu_artifact_and_updates_one_comment():
    gpu = load("gpu-ci.yml")
    report = load("pr-report.yml")
    assert triggers(report)["workflow_run"]["workflows"] == [gpu["name"]]
    assert triggers(report)["workflow_run"]["types"] == ["completed"]
    uploads = {
        s["with"]["name"]: s
        for job in gpu["jobs"].values()
        for s in steps(job)
        if s.get("uses", "").startswith("actions/upload-artifact@")
    }
    job = report["jobs"]["comment"]
    # No download-artifact: by name or pattern it takes the newest artifact of a name, which PR
    # code can upload. The trusted fetch takes the one of each exact name, checked first.
    assert not [s for s in steps(job) if s.get("uses", "").startswith("actions/download-artifact@")]
    fetch = next(s for s in steps(job) if s.get("id") == "fetch")
    assert fetch["run"].startswith("python3 -m flashmoe_science.pipeline.ci.gpuci fetch-run")
    assert '--run-id "$RUN"' in fetch["run"] and '--out "$RUNNER_TEMP/gpu-ci"' in fetch["run"]
    assert fetch["env"] == {
        "GH_TOKEN": "${{ github.token }}",
        "RUN": "${{ github.event.workflow_run.id }}",
    }
    assert "continue-on-error" not in fetch, "a refused approval stops the job: nothing is posted"
    assert set(uploads) >= {"gpu-ci-reports-${{ matrix.gpu }}", "gpu-ci-approval"}
    sticky = next(
        s
        for s in steps(job)
        if s.get("uses", "").startswith("marocchino/sticky-pull-request-comment@")
    )
    assert sticky["with"]["header"] == "flashmoe-science-report"
    assert sticky["with"]["number"] == "${{ steps.pr.outputs.number }}"
    # the PR number comes from the trusted approval, and the PR is checked against the API
    resolve_step = next(s for s in steps(job) if s.get("id") == "pr")
    assert (
        resolve_step["env"]["APPROVAL"] == "${{ runner.temp }}/gpu-ci/gpu-ci-approval/approval.json"
    )
    resolve = resolve_step["run"]
    code = "\n".join(line for line in resolve.splitlines() if not line.strip().startswith("#"))
    assert '"$APPROVAL"' in code and "pr.json" not in code
    assert "pulls/$claimed" in resolve
    render_step = next(s for s in steps(job) if s.get("id") == "body")
    assert render_step["env"]["ARTIFACTS"] == "${{ runner.temp }}/gpu-ci/legs"
    render = render_step["run"]
    assert "python3 -m flashmoe_science report --legs" in render and "--tested-sha" in render
    assert "--dir" not in render, "one comment over every leg, not one leg's report"
    jobs = next(s for s in steps(job) if s.get("id") == "jobs")
    assert "actions/runs/$RUN/jobs" in jobs["run"] and jobs["continue-on-error"] is True
    assert '--jobs "$RUNNER_TEMP/jobs.tsv"' in render


def test_history_stores_every_leg_under_its_kind():
    job = load("bench-history.yml")["jobs"]["history"]
    download = next(
        s for s in steps(job) if s.get("uses", "").startswith("actions/download-artifact@")
    )
    assert download["with"]["pattern"] == gpukinds.ARTIFACT_PREFIX + "*"
    step = next(s for s in steps(job) if "gpuci history" in s.get("run", ""))
    assert '--reports "$REPORTS"' in step["run"]


def test_gpu_job_writes_the_pr_number_as_data():
    job = load("gpu-ci.yml")["jobs"]["gpu"]
    step = next(s for s in steps(job) if "reports/pr.json" in s.get("run", ""))
    assert step["env"]["PR_NUMBER"] == "${{ needs.approve.outputs.pr }}"
    assert "${{" not in step["run"]


def test_no_run_step_inlines_untrusted_event_fields():
    untrusted = re.compile(r"\$\{\{\s*github\.(event\.|head_ref|base_ref)")
    for name, _, job_id, job in all_jobs():
        for step in steps(job):
            assert not untrusted.search(step.get("run", "")), f"{name}:{job_id}: {step.get('name')}"


def test_zizmor_ignores_are_justified():
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for line in path.read_text().splitlines():
            match = re.search(r"#\s*zizmor:\s*ignore\[[\w-]+\](.*)$", line)
            if match:
                assert len(match.group(1).strip()) > 10, (
                    f"{path.name}: unjustified ignore: {line.strip()}"
                )
