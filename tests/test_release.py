"""The release workflow (.github/workflows/release.yml), read as data: it cannot run here (it
publishes to PyPI), so its structure is what is checked. The rules every workflow follows (pins,
timeouts, read-only defaults) are checked for it too, by tests/test_workflows.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev dependency group)")

ROOT = Path(__file__).resolve().parents[1]
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
    assert re.search(r"^python -m build --outdir dist/", commands, re.MULTILINE)
    assert "twine check --strict dist/*" in commands
    assert re.search(r"pip\" install build==[\d.]+ twine==[\d.]+", commands)  # pinned tools
    upload = next(
        s for s in dist["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")
    )
    assert upload["with"]["name"] == "dist" and upload["with"]["if-no-files-found"] == "error"
    assert 'GITHUB_REF_NAME#v}" = "$version"' in commands  # a tag that lies about the version fails


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
    # .ci/run runs the same check, on a wheel it builds
    assert re.search(
        rf"^{re.escape(WHEELCHECK)}$", (ROOT / ".ci" / "run").read_text(), re.MULTILINE
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
