"""The release workflow (.github/workflows/release.yml), read as data: it cannot run here (it
publishes to PyPI), so its structure is what is checked. The rules every workflow follows (pins,
timeouts, read-only defaults) are checked for it too, by tests/ci/test_workflows.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev dependency group)")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
PUBLISH_ACTION = "pypa/gh-action-pypi-publish@"
WHEELCHECK = "python -m flashmoe_science.pipeline.build.wheelcheck"


@pytest.fixture(scope="module")
def release() -> dict:
    return yaml.safe_load((WORKFLOWS / "release.yml").read_text())


def runs(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def uses(job: dict) -> list[str]:
    return [step["uses"] for step in job["steps"] if "uses" in step]


def test_runs_on_version_tags_only(release):
    on = release.get("on", release.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["push"] == {"tags": ["v*"]}
    assert set(on) <= {"push", "workflow_dispatch"}
    assert release["permissions"] == {"contents": "read"}


def test_builds_the_sdist_and_wheel_and_checks_them(release):
    dist = release["jobs"]["dist"]
    commands = runs(dist)
    assert re.search(r"^python -m build --no-isolation --outdir dist/", commands, re.MULTILINE)
    assert "twine check --strict dist/*" in commands
    upload = next(
        s for s in dist["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")
    )
    assert upload["with"]["name"] == "dist" and upload["with"]["if-no-files-found"] == "error"
    assert 'GITHUB_REF_NAME#v}" = "$version"' in commands  # a tag that lies about the version fails


def test_the_build_tools_are_hash_locked_and_the_build_fetches_nothing(release):
    """A compromised build dependency must not get to replace the wheel: build, twine and the
    setuptools that builds come from the hash-locked requirements/release.txt (wheels only, one
    index), and the build runs without isolation, so no newer setuptools is fetched for it."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    dist = release["jobs"]["dist"]
    commands = runs(dist)
    assert "scripts/runner/install-locked.sh requirements/release.txt" in commands
    assert not re.search(r"\bpip\b", commands), "no other install"
    assert re.search(r"python -m build --no-isolation", commands)
    lock = (ROOT / "requirements" / "release.txt").read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock, re.M))
    assert {"build", "twine", "setuptools"} <= set(pins)
    import tomllib

    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for text in wanted:  # the locked tools are the build backend pyproject asks for
        requirement = Requirement(text)
        assert requirement.specifier.contains(Version(pins[requirement.name])), text


def step_named(job: dict, start: str) -> dict:
    return next(s for s in job["steps"] if s.get("name", "").startswith(start))


def run_step(step: dict, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """A `run:` step as the runner runs it (bash -eo pipefail), with `env` (its own env: given)."""
    script = cwd / f"step-{abs(hash(step['run']))}.sh"
    script.write_text(step["run"])
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("attack", [None, "replaced", "added", "removed"])
def test_publish_uploads_only_the_files_the_dist_job_built(release, tmp_path, attack):
    """`publish` downloads `dist` by name, and a later job can delete that artifact and upload
    another (any job holds the runtime token; `check` installs from the index). The dist job's
    SHA-256 of its files is a job output, which no later job can change: publish checks the
    downloaded files against it before the upload step, and stops on any difference."""
    dist_job, publish = release["jobs"]["dist"], release["jobs"]["publish"]
    assert dist_job["outputs"] == {"sha256": "${{ steps.digest.outputs.sha256 }}"}
    built = tmp_path / "built"
    (built / "dist").mkdir(parents=True)
    (built / "dist" / "flashmoe_science-0.1.0-py3-none-any.whl").write_bytes(b"the wheel")
    (built / "dist" / "flashmoe_science-0.1.0.tar.gz").write_bytes(b"the sdist")
    output = tmp_path / "github-output"
    recorded = run_step(
        step_named(dist_job, "Record the files' SHA-256"), built, {"GITHUB_OUTPUT": str(output)}
    )
    assert recorded.returncode == 0, recorded.stderr
    match = re.fullmatch(r"sha256<<(\w+)\n(.*)\n\1\n", output.read_text(), re.S)
    sha256 = match[2]
    assert len(sha256.splitlines()) == 2

    downloaded = tmp_path / "downloaded"
    shutil.copytree(built, downloaded)
    wheel = downloaded / "dist" / "flashmoe_science-0.1.0-py3-none-any.whl"
    if attack == "replaced":
        wheel.write_bytes(b"a wheel with a payload")
    elif attack == "added":
        (downloaded / "dist" / "flashmoe_science-0.1.1-py3-none-any.whl").write_bytes(b"x")
    elif attack == "removed":
        wheel.unlink()
    names = [s.get("name", s.get("uses", "")) for s in publish["steps"]]
    check = step_named(publish, "The files are the ones the dist job built")
    assert names.index(check["name"]) < next(
        i for i, s in enumerate(publish["steps"]) if s.get("uses", "").startswith(PUBLISH_ACTION)
    ), "checked before the upload"
    assert check["env"] == {"DIST_SHA256": "${{ needs.dist.outputs.sha256 }}"}
    verified = run_step(check, downloaded, {"DIST_SHA256": sha256})
    if attack is None:
        assert verified.returncode == 0, verified.stdout + verified.stderr
    else:
        assert verified.returncode != 0, verified.stdout
        assert "::error::" in verified.stdout and "nothing is published" in verified.stdout
    assert run_step(check, downloaded, {"DIST_SHA256": ""}).returncode != 0


def test_checks_the_built_wheel_as_ci_does(release):
    check = release["jobs"]["check"]
    assert check["needs"] == "dist"
    download = next(
        s for s in check["steps"] if s.get("uses", "").startswith("actions/download-artifact@")
    )
    assert download["with"] == {"name": "dist", "path": "dist/"}
    assert f"{WHEELCHECK} --wheel dist/*.whl" in runs(check)
    # the CPU torch, never the multi-GB CUDA one
    assert "--cpu" in runs(check) and "download.pytorch.org/whl/cpu" in runs(check)
    # every pull request runs the same check, on a wheel it builds: cpu-ci.yml's CPU job (which
    # .ci/run runs under act)
    cpu_job = yaml.safe_load((WORKFLOWS / "cpu-ci.yml").read_text())
    assert re.search(
        rf"^python3? {re.escape(WHEELCHECK.removeprefix('python '))}$",
        runs(cpu_job["jobs"]["cpu-tests"]),
        re.MULTILINE,
    )


def test_publishes_with_trusted_publishing_after_the_checks(release):
    publish = release["jobs"]["publish"]
    assert set(publish["needs"]) == {"dist", "check"}
    assert publish["if"] == "${{ startsWith(github.ref, 'refs/tags/v') }}"
    assert publish["permissions"] == {"id-token": "write"}  # nothing else, at job level only
    assert publish["environment"]["name"] == "pypi"
    (action,) = [u for u in uses(publish) if u.startswith(PUBLISH_ACTION)]
    assert re.fullmatch(PUBLISH_ACTION + r"[0-9a-f]{40}", action)
    step = next(s for s in publish["steps"] if s.get("uses") == action)
    assert step["with"] == {"packages-dir": "dist/"}  # no password, no token: OIDC
    assert not any("checkout" in u for u in uses(publish))  # publishes the checked files only
    assert "secrets." not in (WORKFLOWS / "release.yml").read_text()


def test_actions_are_pinned_as_in_the_other_workflows(release):
    pins: dict[str, set[str]] = {}
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for name, sha in re.findall(r"uses:\s*([\w./-]+)@([0-9a-f]{40})", path.read_text()):
            pins.setdefault(name, set()).add(sha)
    for job in release["jobs"].values():
        for use in uses(job):
            name, _, ref = use.partition("@")
            assert re.fullmatch(r"[0-9a-f]{40}", ref), use
            assert pins[name] == {ref}, f"{name} is pinned to {sorted(pins[name])} across workflows"
