#!/usr/bin/env python3
"""Read back the repository settings of scripts/runner/SETTINGS.md that the REST API exposes.

Usage: scripts/runner/check-settings.py OWNER/REPO [--org ORG --runner-group NAME] [--fixture FILE]

Each line names the checklist item (SETTINGS.md's number), its status and, for a wrong setting, what
to change. A token comes from GH_TOKEN, GITHUB_TOKEN or `gh auth token`; GITHUB_API_URL overrides
the API's address. --fixture FILE answers from a JSON object instead of the network: keys are API
paths ("repos/OWNER/REPO/actions/permissions/workflow"), values the response bodies; a missing key
answers 404, a value {"__status__": 403} that status. Exit status: 0 when nothing is wrong (a
setting that could not be read is a "skip"), 1 when a setting is wrong, 2 for wrong arguments.
Standard library only: it runs with any python3.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

SETTINGS = "scripts/runner/SETTINGS.md"
READ_HINT = "needs a token with Administration: Read-only (GH_TOKEN, or `gh auth login`)"


class Api:
    """GET requests against the GitHub API, or against a fixture's answers."""

    def __init__(self, base: str, token: str | None, fixture: dict[str, Any] | None) -> None:
        self.base, self.token, self.fixture = base.rstrip("/"), token, fixture

    def get(self, path: str) -> tuple[int, Any]:
        if self.fixture is not None:
            if path not in self.fixture:
                return 404, None
            body = self.fixture[path]
            if isinstance(body, dict) and "__status__" in body:
                return int(body["__status__"]), None
            return 200, body
        request = urllib.request.Request(f"{self.base}/{path}")
        request.add_header("Accept", "application/vnd.github+json")
        request.add_header("X-GitHub-Api-Version", "2022-11-28")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            return exc.code, None


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def line(self, status: str, item: int, what: str, fix: str = "") -> None:
        print(f"{status:<5} {item}  {what}")
        if fix:
            print(f"         fix: {fix}")
        self.failed += status == "FAIL"

    def unreadable(self, item: int, what: str, status: int) -> None:
        hint = READ_HINT if status in (401, 403, 404) else "the API answered an error"
        self.line("skip", item, f"{what}: could not read it (HTTP {status}): {hint}")


def check_fork_approval(api: Api, repo: str, report: Report) -> None:
    status, body = api.get(f"repos/{repo}/actions/permissions/fork-pr-contributor-approval")
    if status != 200:
        return report.unreadable(1, "fork pull request approval", status)
    policy = body.get("approval_policy")
    if policy == "all_external_contributors":
        report.line("ok", 1, "fork pull request approval: all external contributors")
    else:
        report.line(
            "FAIL",
            1,
            f"fork pull request approval is {policy!r}, not 'all_external_contributors'",
            "Settings -> Actions -> General -> 'Require approval for all external contributors'",
        )


def check_workflow_token(api: Api, repo: str, report: Report) -> None:
    status, body = api.get(f"repos/{repo}/actions/permissions/workflow")
    if status != 200:
        return report.unreadable(2, "default workflow token", status)
    default = body.get("default_workflow_permissions")
    approve = body.get("can_approve_pull_request_reviews")
    if default == "read" and approve is False:
        report.line("ok", 2, "default workflow token: read-only, cannot approve pull requests")
        return
    wrong = []
    if default != "read":
        wrong.append(f"default_workflow_permissions is {default!r}, not 'read'")
    if approve is not False:
        wrong.append(f"can_approve_pull_request_reviews is {approve!r}, not false")
    report.line(
        "FAIL",
        2,
        "default workflow token: " + "; ".join(wrong),
        "Settings -> Actions -> General -> Workflow permissions: 'Read repository contents and "
        "packages permissions', and untick 'Allow GitHub Actions to create and approve pull requests'",
    )


def check_reviewers(
    api: Api, repo: str, name: str, item: int, report: Report, say_ok: bool = True
) -> dict | None:
    """The environment `name` exists and waits for required reviewers; its body, or None (said)."""
    status, body = api.get(f"repos/{repo}/environments/{name}")
    fix = f"Settings -> Environments -> `{name}`: add the maintainers as required reviewers"
    if status == 404:
        report.line(
            "FAIL",
            item,
            f"environment `{name}` does not exist (GitHub would create it unprotected)",
            fix,
        )
        return None
    if status != 200:
        report.unreadable(item, f"environment `{name}`", status)
        return None
    rules = [r for r in body.get("protection_rules") or [] if r.get("type") == "required_reviewers"]
    reviewers = [r for rule in rules for r in rule.get("reviewers") or []]
    if not reviewers:
        report.line("FAIL", item, f"environment `{name}` has no required reviewers", fix)
        return None
    if not all(rule.get("prevent_self_review") for rule in rules):
        report.line(
            "warn",
            item,
            f"environment `{name}`: {len(reviewers)} required reviewer(s), but self-review is "
            "allowed",
            f"tick 'Prevent self-review' on the `{name}` environment",
        )
        return body
    if say_ok:
        report.line("ok", item, f"environment `{name}`: {len(reviewers)} required reviewer(s)")
    return body


def check_environment(api: Api, repo: str, report: Report) -> None:
    check_reviewers(api, repo, "gpu", 3, report)


RELEASE_TAGS = "v*"  # release.yml runs on these tags and publishes from the `pypi` environment


def check_pypi_environment(api: Api, repo: str, report: Report) -> None:
    """`pypi` waits for reviewers and deploys from v* tags only (item 11)."""
    body = check_reviewers(api, repo, "pypi", 11, report, say_ok=False)
    if body is None:
        return
    fix = (
        "Settings -> Environments -> `pypi` -> Deployment branches and tags: 'Selected branches "
        f"and tags', one rule: tag `{RELEASE_TAGS}`"
    )
    policy = body.get("deployment_branch_policy") or {}
    if not policy.get("custom_branch_policies"):
        report.line("FAIL", 11, "environment `pypi` deploys from any branch or tag", fix)
        return
    status, listed = api.get(f"repos/{repo}/environments/pypi/deployment-branch-policies")
    if status != 200:
        return report.unreadable(11, "deployment policies of `pypi`", status)
    policies = [
        (p.get("type", "branch"), p.get("name")) for p in listed.get("branch_policies") or []
    ]
    others = [f"{kind} {name}" for kind, name in policies if (kind, name) != ("tag", RELEASE_TAGS)]
    if others or not policies:
        shown = ", ".join(others) or "nothing"
        report.line(
            "FAIL", 11, f"environment `pypi` deploys from {shown}, not tags {RELEASE_TAGS}", fix
        )
    else:
        report.line(
            "ok",
            11,
            f"environment `pypi`: required reviewers, deploys from tags {RELEASE_TAGS} only",
        )


TAG_RULES = {"creation", "update", "deletion"}


def check_tag_ruleset(api: Api, repo: str, report: Report) -> None:
    """An active ruleset restricts creating, moving and deleting v* tags (item 12): who can push a
    release tag starts release.yml."""
    fix = (
        "Settings -> Rules -> Rulesets -> New tag ruleset: active, target tags matching "
        f"`{RELEASE_TAGS}`, restrict creations, updates and deletions; bypass: the maintainers"
    )
    status, rulesets = api.get(f"repos/{repo}/rulesets?includes_parents=true&per_page=100")
    if status != 200:
        return report.unreadable(12, "rulesets", status)
    probe = "refs/tags/v1.0.0"
    for summary in rulesets or []:
        if summary.get("target") != "tag" or summary.get("enforcement") != "active":
            continue
        status, ruleset = api.get(f"repos/{repo}/rulesets/{int(summary.get('id'))}")
        if status != 200:
            report.unreadable(12, f"ruleset {summary.get('name')!r}", status)
            continue
        refs = (ruleset.get("conditions") or {}).get("ref_name") or {}
        covered = any(
            pattern == "~ALL" or fnmatch.fnmatchcase(probe, pattern)
            for pattern in refs.get("include") or []
        ) and not any(fnmatch.fnmatchcase(probe, p) for p in refs.get("exclude") or [])
        rules = {str(rule.get("type")) for rule in ruleset.get("rules") or []}
        if covered and rules >= TAG_RULES:
            report.line("ok", 12, f"ruleset {summary.get('name')!r} restricts {RELEASE_TAGS} tags")
            return
    report.line(
        "FAIL",
        12,
        f"no active tag ruleset restricts creating, moving and deleting {RELEASE_TAGS} tags",
        fix,
    )


def check_label(api: Api, repo: str, report: Report) -> None:
    status, _ = api.get(f"repos/{repo}/labels/safe-to-test")
    if status == 200:
        report.line("ok", 4, "label `safe-to-test` exists (who holds Triage or above: not checked)")
    elif status == 404:
        report.line(
            "FAIL",
            4,
            "label `safe-to-test` does not exist: fork pull requests cannot be started",
            f"gh label create safe-to-test --repo {repo} --description 'run the GPU CI on this PR'",
        )
    else:
        report.unreadable(4, "label `safe-to-test`", status)


def check_runners(api: Api, repo: str, org: str | None, group: str | None, report: Report) -> None:
    status, body = api.get(f"repos/{repo}/actions/runners")
    if status != 200:
        report.unreadable(5, "repository runners", status)
    else:
        gpu = [
            r
            for r in body.get("runners") or []
            if "gpu" in {label.get("name", "").lower() for label in r.get("labels") or []}
        ]
        if gpu:
            names = ", ".join(f"{r.get('name')} ({r.get('status')})" for r in gpu)
            report.line("ok", 5, f"{len(gpu)} `gpu` runner(s) registered to {repo} only: {names}")
        elif group is None:
            report.line(
                "warn",
                5,
                f"no `gpu` runner registered to {repo} (an organisation runner? pass --org and "
                "--runner-group to check its group)",
            )
    if group is None:
        return
    status, body = api.get(f"orgs/{org}/actions/runner-groups")
    if status != 200:
        return report.unreadable(5, f"runner groups of {org}", status)
    found = [g for g in body.get("runner_groups") or [] if g.get("name") == group]
    if not found:
        report.line(
            "FAIL", 5, f"{org} has no runner group {group!r}", "pass the group's exact name"
        )
        return
    info = found[0]
    problems = []
    if info.get("visibility") != "selected":
        problems.append(f"visibility is {info.get('visibility')!r}, not 'selected'")
    else:
        status, repos = api.get(f"orgs/{org}/actions/runner-groups/{info.get('id')}/repositories")
        if status != 200:
            report.unreadable(5, f"repositories of runner group {group!r}", status)
        else:
            others = [
                r.get("full_name")
                for r in repos.get("repositories") or []
                if r.get("full_name", "").lower() != repo.lower()
            ]
            if others:
                problems.append(f"shared with {', '.join(others)}")
    if not info.get("restricted_to_workflows"):
        problems.append("not restricted to selected workflows")
    else:
        foreign = [w for w in info.get("selected_workflows") or [] if not w.startswith(f"{repo}/")]
        if foreign:
            problems.append(f"selected workflows of other repositories: {', '.join(foreign)}")
    if problems:
        report.line(
            "FAIL",
            5,
            f"runner group {group!r}: " + "; ".join(problems),
            f"Organization settings -> Actions -> Runner groups -> {group}: selected repository "
            f"{repo} only, selected workflows {repo}/.github/workflows/gpu-ci.yml@refs/heads/main",
        )
    else:
        report.line("ok", 5, f"runner group {group!r}: {repo} only, selected workflows only")


def check_sha_pinning(api: Api, repo: str, report: Report) -> None:
    status, body = api.get(f"repos/{repo}/actions/permissions")
    if status != 200:
        return report.unreadable(6, "actions permissions", status)
    if body.get("sha_pinning_required"):
        report.line("ok", 6, "actions must be pinned to a full commit SHA")
    else:
        report.line(
            "warn",
            6,
            "actions need not be pinned to a full commit SHA",
            "Settings -> Actions -> General: 'Require actions to be pinned to a full-length commit SHA'",
        )


GATE_STATUS = "flashmoe-science/gpu"  # the commit status gpu-gate sets on a PR's head commit
GATE_JOB = (
    "gpu-gate"  # the job's own check run: attached to main's commit under pull_request_target
)
ACTIONS_APP_ID = 15368  # GitHub Actions, whose token sets the status


def check_required_gate(api: Api, repo: str, report: Report) -> None:
    """main requires the commit status GATE_STATUS (a ruleset's required status checks, or branch
    protection's), and not the check GATE_JOB: on a PR's head that check can only come from the
    PR's own `pull_request` workflow (a fork names a job `gpu-gate`), or never comes at all."""
    fix = (
        f"Settings -> Rules -> Rulesets for main -> Require status checks to pass: add "
        f"`{GATE_STATUS}` (source GitHub Actions), and remove `{GATE_JOB}`"
    )
    status, rules = api.get(f"repos/{repo}/rules/branches/main")
    required: list[tuple[str, object]] = []  # (context, the app it is pinned to, or None)
    if status == 200:
        for rule in rules or []:
            if rule.get("type") == "required_status_checks":
                for check in (rule.get("parameters") or {}).get("required_status_checks") or []:
                    required.append((str(check.get("context")), check.get("integration_id")))
    status2, protection = api.get(f"repos/{repo}/branches/main/protection/required_status_checks")
    if status2 == 200:
        required += [(str(c), None) for c in protection.get("contexts") or []]
        required += [
            (str(c.get("context")), c.get("app_id")) for c in protection.get("checks") or []
        ]
    gate = [app for context, app in required if context == GATE_STATUS]
    if not required and status != 200 and status2 not in (200, 404):
        return report.unreadable(8, "required status checks of main", status2)
    if any(context == GATE_JOB for context, _ in required):
        report.line(
            "FAIL",
            8,
            f"main requires the check `{GATE_JOB}`: under pull_request_target it lands on main's "
            "commit, so on a PR's head only the PR's own workflow can post it (a fork's job named "
            f"{GATE_JOB} passes it) or nothing does",
            fix,
        )
    elif not gate:
        report.line("FAIL", 8, f"main does not require the commit status `{GATE_STATUS}`", fix)
    elif any(app not in (None, -1, ACTIONS_APP_ID) for app in gate):
        report.line(
            "FAIL",
            8,
            f"`{GATE_STATUS}` is required from app {gate}, not GitHub Actions ({ACTIONS_APP_ID}), "
            "whose token gpu-gate sets it with: it would never count",
            fix,
        )
    else:
        report.line("ok", 8, f"main requires the commit status `{GATE_STATUS}`")


HISTORY_BRANCH = "bench-history"  # bench-history.yml pushes main's benchmark runs there
# Rule types that leave the workflow token's fast-forward pushes of plain commits alone.
HARMLESS_RULES = {"deletion", "non_fast_forward", "required_linear_history"}


def check_history_branch(api: Api, repo: str, report: Report) -> None:
    """No ruleset or branch protection stops bench-history.yml's pushes."""
    fix = (
        f"Settings -> Rules -> Rulesets (or Branches): keep `{HISTORY_BRANCH}` out of rules that "
        "require pull requests, checks or signatures, or restrict updates"
    )
    status, rules = api.get(f"repos/{repo}/rules/branches/{HISTORY_BRANCH}")
    blocking = sorted(
        {str(rule.get("type")) for rule in (rules if status == 200 else None) or []}
        - HARMLESS_RULES
    )
    status2, protection = api.get(f"repos/{repo}/branches/{HISTORY_BRANCH}/protection")
    if status2 == 200:
        blocking += [
            key
            for key in ("required_pull_request_reviews", "required_status_checks", "restrictions")
            if (protection or {}).get(key)
        ]
        if ((protection or {}).get("required_signatures") or {}).get("enabled"):
            blocking.append("required_signatures")
    if blocking:
        report.line("FAIL", 10, f"`{HISTORY_BRANCH}` is covered by: {', '.join(blocking)}", fix)
    elif status not in (200, 404):
        report.unreadable(10, f"rules of `{HISTORY_BRANCH}`", status)
    else:
        report.line("ok", 10, f"no rule stops pushes to `{HISTORY_BRANCH}`")


def token_from_environment() -> str | None:
    for name in ("GH_TOKEN", "GITHUB_TOKEN"):
        if os.environ.get(name):
            return os.environ[name]
    gh = shutil.which("gh")
    if gh:
        run = subprocess.run([gh, "auth", "token"], capture_output=True, text=True, check=False)
        if run.returncode == 0 and run.stdout.strip():
            return run.stdout.strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/runner/check-settings.py",
        description=f"Check the repository settings of {SETTINGS} that the API exposes.",
    )
    parser.add_argument("repo", help="OWNER/REPO")
    parser.add_argument("--org", help="the organisation whose runner group serves the repository")
    parser.add_argument("--runner-group", help="that runner group's name (needs --org)")
    parser.add_argument("--fixture", help="answer from this JSON file instead of the API")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.repo):
        parser.error(f"repo must be OWNER/REPO, got {args.repo!r}")
    if bool(args.org) != bool(args.runner_group):
        parser.error("--org and --runner-group go together")

    fixture = None
    if args.fixture:
        try:
            with open(args.fixture) as f:
                fixture = json.load(f)
        except (OSError, ValueError) as exc:
            parser.error(f"--fixture {args.fixture}: {exc}")
        if not isinstance(fixture, dict):
            parser.error(f"--fixture {args.fixture}: expected a JSON object of API paths")
    api = Api(
        os.environ.get("GITHUB_API_URL", "https://api.github.com"),
        None if fixture is not None else token_from_environment(),
        fixture,
    )
    source = f"fixture {args.fixture}" if fixture is not None else api.base
    print(f"Repository settings of {args.repo} ({SETTINGS}), read from {source}:")
    report = Report()
    checks: list[Callable[[], None]] = [
        lambda: check_fork_approval(api, args.repo, report),
        lambda: check_workflow_token(api, args.repo, report),
        lambda: check_environment(api, args.repo, report),
        lambda: check_label(api, args.repo, report),
        lambda: check_runners(api, args.repo, args.org, args.runner_group, report),
        lambda: check_sha_pinning(api, args.repo, report),
        lambda: check_required_gate(api, args.repo, report),
        lambda: check_history_branch(api, args.repo, report),
        lambda: check_pypi_environment(api, args.repo, report),
        lambda: check_tag_ruleset(api, args.repo, report),
    ]
    for check in checks:
        try:
            check()
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            print(f"error: cannot reach {api.base}: {exc}", file=sys.stderr)
            print("next: check the network, or set GITHUB_API_URL", file=sys.stderr)
            return 1
        except (AttributeError, TypeError, ValueError) as exc:  # an answer of another shape
            report.line("FAIL", 0, f"unexpected answer from the API: {type(exc).__name__}: {exc}")
    print(
        "      7  the runner machine (credential, interpreter, network): not checked, see the list"
    )
    print("      13 the ARC pods' token and network policy: not checked here, see the list")
    if report.failed:
        print(f"{report.failed} setting(s) wrong: fix them before the runner takes jobs")
        return 1
    print("no wrong setting found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
