"""The trusted steps of GPU CI: which commit may run on the GPU runner, whether the required gate
passes, and the history of main's benchmarks. gpu-ci.yml, bench-history.yml and pr-report.yml run
these from the default branch's code (never a pull request's), on GitHub-hosted runners.

    approve       decide, from the event, whether the GPU job runs and on which commit:
                  push to main, the scheduled run (main's head) and workflow_dispatch run (a
                  dispatch naming a PR runs that PR's head
                  only if it is the commit given); a same-repository PR runs on each push; a fork PR
                  runs only on the `safe-to-test` label applied by someone with write access, for
                  the head commit at labelling time, and only when that head was pushed at least
                  SETTLE_MINUTES before the label (else it says so on the PR); so does a pull
                  request a bot opened or pushed (Dependabot's bring new locked versions). The label is removed as soon as it is read, and
                  on every new push, so each commit needs its own approval; a new push also marks
                  the PR's report comment stale. Writes run, sha, pr, base_ref, environment and
                  reason to $GITHUB_OUTPUT.
    gate          the required check: passes only if every leg of the GPU job (one per GPU kind,
                  pipeline.gpukinds) ran and passed on the PR's head commit (in this run, or an
                  earlier one that set the commit status); names the legs that did not; sets the
                  commit status STATUS_CONTEXT on that commit either way.
    history       each leg of main's pushed run against its kind's stored history (pipeline.bench.trend),
                  then stored on the `bench-history` branch under the kind (pipeline.ci.historybranch);
                  an alert (a commit comment, exit 1) when a case left its history's noise band.
                  Each leg's gate verdict is stored there too, under its selection key, for the
                  pull requests that change no gate input (ci/selection.py).
    fetch-points  download the newest points of each kind on the `bench-history` branch into
                  OUT/KIND/.
    fetch-run     a run's approval and each leg's reports for the report job, by exact name and
                  checked first (pipeline.ci.runartifacts): one approval, uploaded before the
                  approve job ended, naming this run; legs under the size caps.

The GitHub API is $FLASHMOE_GITHUB_API, else $GITHUB_API_URL, else https://api.github.com, with
the token in $GH_TOKEN. Nothing taken from the event is printed unescaped: a workflow log line that
starts with `::` is a command to the runner.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from .. import gpukinds
from .. import markdown as md
from ..bench import records as benchrecords
from ..bench import trend
from . import historybranch, runartifacts, selection

LABEL = "safe-to-test"
STATUS_CONTEXT = "flashmoe-science/gpu"
WRITE_ROLES = ("admin", "maintain", "write")
BOT = "github-actions[bot]"
REPORT_MARKER = "<!-- flashmoe-science-report -->"
STALE_PREFIX = "## 🕰️ flashmoe-science: stale:"
# A head pushed less than this before its label is refused: the maintainer reviewed the page as it
# was, and a push just before the click would run unreviewed (the dispatch path is SHA-exact).
SETTLE_MINUTES = 5
# gpu-ci.yml's run-name for pull_request_target: the PR, its head and the action, which the approve
# job of a labelled run reads back from the runs a change of the head started.
RUN_NAME = re.compile(
    r"^GPU CI: PR #([1-9][0-9]{0,9}) at ([0-9a-f]{40}) \((opened|reopened|synchronize|labeled)\)$"
)
HEAD_CHANGES = ("opened", "reopened", "synchronize")
WORKFLOW = "gpu-ci.yml"
_SHA = re.compile(r"^[0-9a-f]{40}$")
_NUMBER = re.compile(r"^[1-9][0-9]{0,9}$")


class ApiError(RuntimeError):
    def __init__(self, status: int, what: str):
        super().__init__(f"GitHub API {what}: HTTP {status}")
        self.status = status


def log_safe(value: object, limit: int = 200) -> str:
    """A value for the workflow log: one line, and no `::` a runner would read as a command."""
    return md.flat(value, limit).replace("::", ": :")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # the caller follows it, without the token
        return None


def _read_at_most(response, limit: int) -> bytes:
    data = response.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"more than {limit} bytes: not read")
    return data


class GitHub:
    """The few REST calls the trusted steps make (urllib: no dependency on the runner)."""

    def __init__(self, repo: str, token: str | None = None, api: str | None = None):
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo or ""):
            raise ValueError(f"GITHUB_REPOSITORY={repo!r} is not OWNER/NAME")
        self.repo = repo
        self.token = token if token is not None else os.environ.get("GH_TOKEN", "")
        self.api = (
            api
            or os.environ.get("FLASHMOE_GITHUB_API")
            or os.environ.get("GITHUB_API_URL")
            or "https://api.github.com"
        ).rstrip("/")

    def call(self, method: str, path: str, body: dict | None = None) -> object:
        url = f"{self.api}/repos/{self.repo}/{path}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", "application/vnd.github+json")
        request.add_header("X-GitHub-Api-Version", "2022-11-28")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                raw = response.read(8 << 20)
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, f"{method} {path}") from None
        return json.loads(raw) if raw.strip() else None

    def download(self, path: str, limit: int) -> bytes:
        """The bytes at an API path that answers with a redirect (an artifact's zip): at most
        `limit` of them, else ValueError. The redirect goes to a signed URL on another host, which
        gets no token."""
        request = urllib.request.Request(f"{self.api}/repos/{self.repo}/{path}")
        request.add_header("Accept", "application/vnd.github+json")
        request.add_header("X-GitHub-Api-Version", "2022-11-28")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.build_opener(_NoRedirect).open(request, timeout=60) as response:
                return _read_at_most(response, limit)
        except urllib.error.HTTPError as exc:
            location = exc.headers.get("Location") if exc.code in (301, 302, 303, 307) else None
            if not location:
                raise ApiError(exc.code, f"GET {path}") from None
        scheme = urllib.parse.urlsplit(self.api).scheme
        if urllib.parse.urlsplit(location).scheme not in ("https", scheme):
            raise ApiError(0, f"GET {path}: a redirect to {log_safe(location, 60)}")
        try:
            with urllib.request.urlopen(urllib.request.Request(location), timeout=120) as response:
                return _read_at_most(response, limit)
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, f"GET {path} (its redirect)") from None

    def _listed(self, path: str, key: str, pages: int = 10) -> list[dict]:
        """The `key` list of a paged listing, page by page (100 a page) until a short page."""
        items: list[dict] = []
        joiner = "&" if "?" in path else "?"
        for page in range(1, pages + 1):
            doc = self.call("GET", f"{path}{joiner}per_page=100&page={page}")
            listed = (doc or {}).get(key) if isinstance(doc, dict) else None
            if not isinstance(listed, list) or not listed:
                break
            items += [item for item in listed if isinstance(item, dict)]
            if len(listed) < 100:  # the last page
                break
        return items

    def workflow_runs(self, workflow: str, event: str, pages: int = 10) -> list[dict]:
        """A workflow's runs of one event, newest first ({display_title, created_at, ...})."""
        quoted = urllib.parse.quote(workflow, safe="")
        return self._listed(
            f"actions/workflows/{quoted}/runs?event={event}", "workflow_runs", pages
        )

    def run_artifacts(self, run_id: str) -> list[dict]:
        """A workflow run's artifacts ({id, name, size_in_bytes, created_at, digest, ...})."""
        if not re.fullmatch(r"[0-9]{1,20}", run_id or ""):
            raise ValueError(f"run id {log_safe(run_id, 40)!r} is not a number")
        return self._listed(f"actions/runs/{run_id}/artifacts", "artifacts")

    def permission(self, user: str) -> str:
        quoted = urllib.parse.quote(user, safe="")
        doc = self.call("GET", f"collaborators/{quoted}/permission")
        return str((doc or {}).get("permission") or "none") if isinstance(doc, dict) else "none"

    def remove_label(self, number: int, label: str = LABEL) -> bool:
        try:
            self.call("DELETE", f"issues/{number}/labels/{urllib.parse.quote(label, safe='')}")
        except ApiError as exc:
            if exc.status == 404:  # not on the PR: nothing to remove
                return False
            raise
        return True

    def run_jobs(self, run_id: str) -> list[dict]:
        """The jobs of a workflow run's latest attempt ({name, status, conclusion, ...})."""
        if not re.fullmatch(r"[0-9]{1,20}", run_id or ""):
            raise ValueError(f"run id {log_safe(run_id, 40)!r} is not a number")
        return self._listed(f"actions/runs/{run_id}/jobs?filter=latest", "jobs")

    def report_comment(self, number: int) -> dict | None:
        """The PR's report comment: the bot's own comment holding the marker (a comment anyone
        else wrote with the marker in it is not ours)."""
        for page in range(1, 11):
            comments = self.call("GET", f"issues/{number}/comments?per_page=100&page={page}")
            if not isinstance(comments, list) or not comments:
                return None
            for comment in comments:
                user = (comment.get("user") or {}).get("login")
                if user == BOT and REPORT_MARKER in str(comment.get("body") or ""):
                    return comment
        return None


# --------------------------------------------------------------------------------------------------
# approve
# --------------------------------------------------------------------------------------------------


def mark_stale(body: str, new_sha: str) -> str:
    """The report comment with its verdict replaced by a stale line naming the untested commit;
    the old verdict stays below, as what the last tested commit got."""
    lines = body.split("\n")
    old = lines[0]
    if old.startswith(STALE_PREFIX):  # already stale: keep the original verdict line
        old = lines[2] if len(lines) > 2 and lines[2].startswith("> last tested") else old
        lines = lines[3:] if len(lines) > 2 and lines[2].startswith("> last tested") else lines[1:]
    else:
        lines = lines[1:]
    if lines and lines[0] == REPORT_MARKER:
        lines = lines[1:]
    head = [
        f"{STALE_PREFIX} {new_sha[:12]} is not tested yet (a maintainer labels `{LABEL}` to run it)",
        REPORT_MARKER,
        "> last tested commit's verdict: " + old.lstrip("# ").strip(),
    ]
    return "\n".join(head + lines)


def head_pushed(gh: GitHub, number: int) -> tuple[str, dt.datetime] | None:
    """(head, when) of the newest GPU CI run that a change of PR `number`'s head started (opened,
    reopened, synchronize), read from the runs' names (RUN_NAME): GitHub's own clock, which a
    commit's dates are not. None when no such run is listed."""
    found = []
    for run in gh.workflow_runs(WORKFLOW, "pull_request_target"):
        match = RUN_NAME.match(str(run.get("display_title") or ""))
        when = runartifacts.parse_time(run.get("created_at"))
        if match and int(match[1]) == number and match[3] in HEAD_CHANGES and when:
            found.append((when, match[2]))
    if not found:
        return None
    when, head = max(found)
    return head, when


def unsettled(gh: GitHub, number: int, head_sha: str, labelled: dt.datetime) -> str | None:
    """Why the labelled head is too fresh to run (pushed less than SETTLE_MINUTES before the
    label, or its push not on record yet); None when it may run."""
    try:
        pushed = head_pushed(gh, number)
    except (ApiError, ValueError) as exc:
        return f"the runs that date the head are unreadable ({log_safe(exc, 80)})"
    if pushed is None or pushed[0] != head_sha:
        return f"no GPU CI run records the push of {head_sha[:12]} yet (it was pushed just now)"
    minutes = (labelled - pushed[1]).total_seconds() / 60
    if minutes < SETTLE_MINUTES:
        return f"{head_sha[:12]} was pushed {max(minutes, 0):.0f} min before the label"
    return None


def refused_comment(head_sha: str, why: str) -> str:
    return (
        f"🕰️ **GPU CI did not start**: {why}. A head must be at least {SETTLE_MINUTES} minutes "
        f"old when `{LABEL}` is applied, so that the commit reviewed is the commit that runs. "
        f"Check that `{head_sha[:12]}` is the commit you reviewed, then label again (or run GPU CI "
        "from the Actions tab with this PR's number and that commit's SHA)."
    )


def is_bot(user: object) -> bool:
    """A GitHub App's account (dependabot[bot], github-actions[bot], ...), not a person."""
    if not isinstance(user, dict):
        return False
    return user.get("type") == "Bot" or str(user.get("login") or "").endswith("[bot]")


def decide(
    event_name: str,
    event: dict,
    repo: str,
    sha: str,
    gh: GitHub,
    inputs: dict,
    labelled: dt.datetime | None = None,
) -> dict:
    """What the GPU job does for this event: {"run", "sha", "pr", "base_ref", "environment",
    "reason"}. May remove the label, mark the report stale and say on the PR why a label started
    nothing (see the module's docstring). `labelled`: when the label was applied (this run's
    start), default now."""
    out = {"run": "false", "sha": "", "pr": "", "base_ref": "", "environment": "gpu-trusted"}
    if event_name == "push":
        ref = str(event.get("ref") or "")
        if ref != "refs/heads/main":
            return {**out, "reason": "a push to a branch other than main"}
        return {**out, "run": "true", "sha": sha, "reason": "a push to main"}
    if event_name == "schedule":  # GitHub runs it on the default branch's head, with main's files
        return {**out, "run": "true", "sha": sha, "reason": "the scheduled run of main"}
    if event_name == "workflow_dispatch":
        pr, wanted = str(inputs.get("pr") or "").strip(), str(inputs.get("sha") or "").strip()
        if not pr:
            return {**out, "run": "true", "sha": sha, "reason": "a manual run of the branch"}
        if not _NUMBER.match(pr) or not _SHA.match(wanted):
            return {**out, "reason": "inputs pr (a number) and sha (40 hex digits) are required"}
        pull = gh.call("GET", f"pulls/{pr}")
        head = (pull or {}).get("head") or {}
        if (((pull or {}).get("base") or {}).get("repo") or {}).get("full_name") != repo:
            return {**out, "reason": f"PR {pr} is not a pull request of {repo}"}
        if head.get("sha") != wanted:
            return {
                **out,
                "reason": f"PR {pr}'s head is {log_safe(head.get('sha'), 40)}, not the commit "
                "given: review the new head and dispatch again with its sha",
            }
        fork = (head.get("repo") or {}).get("full_name") != repo
        fork = fork or is_bot((pull or {}).get("user"))  # a bot's PR waits for reviewers too
        return {
            **out,
            "run": "true",
            "sha": wanted,
            "pr": pr,
            "base_ref": str(((pull or {}).get("base") or {}).get("ref") or ""),
            "environment": "gpu" if fork else "gpu-trusted",
            "reason": f"dispatched for PR {pr} at the reviewed commit",
        }
    if event_name != "pull_request_target":
        return {**out, "reason": f"event {log_safe(event_name, 40)} does not run the GPU job"}

    pull = event.get("pull_request") or {}
    number = pull.get("number")
    if not isinstance(number, int) or number <= 0:
        return {**out, "reason": "the event names no pull request"}
    head_sha = str((pull.get("head") or {}).get("sha") or "")
    same_repo = ((pull.get("head") or {}).get("repo") or {}).get("full_name") == repo
    action = event.get("action")
    # A bot's branch is gated like a fork's: its commits bring what a registry published (new
    # locked versions), and nobody reviewed them before they would run on the GPU runner.
    bot = pull.get("user") if is_bot(pull.get("user")) else None
    if bot is None and action != "labeled" and is_bot(event.get("sender")):
        bot = event.get("sender")
    trusted_branch = same_repo and bot is None
    pr_out = {
        **out,
        "pr": str(number),
        "base_ref": str((pull.get("base") or {}).get("ref") or ""),
        "environment": "gpu-trusted" if trusted_branch else "gpu",
    }
    if not _SHA.match(head_sha):
        return {**pr_out, "reason": "the event's head commit is not a commit id"}
    if action == "labeled":
        label = str((event.get("label") or {}).get("name") or "")
        if label != LABEL:
            return {**pr_out, "reason": "a label other than the one that starts a GPU run"}
        gh.remove_label(number)  # one-shot: read once, then gone
        sender = str((event.get("sender") or {}).get("login") or "")
        role = gh.permission(sender) if sender else "none"
        if role not in WRITE_ROLES:
            return {
                **pr_out,
                "reason": f"{log_safe(sender, 40)} has {log_safe(role, 20)} access; only "
                "write, maintain or admin may start a GPU run",
            }
        # A branch of this repository already runs on each push: its label is a rerun, not a
        # review of someone else's commit, so there is nothing to let settle.
        now = labelled or dt.datetime.now(dt.timezone.utc)
        why = None if trusted_branch else unsettled(gh, number, head_sha, now)
        if why is not None:
            gh.call("POST", f"issues/{number}/comments", {"body": refused_comment(head_sha, why)})
            return {**pr_out, "reason": f"{why}: the head must be {SETTLE_MINUTES} min old"}
        return {**pr_out, "run": "true", "sha": head_sha, "reason": f"labelled {LABEL}"}
    if action in ("opened", "reopened", "synchronize"):
        gh.remove_label(number)  # a new commit needs a new review
        comment = gh.report_comment(number)
        if comment is not None:
            gh.call(
                "PATCH",
                f"issues/comments/{int(comment['id'])}",
                {"body": mark_stale(str(comment.get("body") or ""), head_sha)},
            )
        if trusted_branch:
            return {
                **pr_out,
                "run": "true",
                "sha": head_sha,
                "reason": "a branch of this repository",
            }
        if same_repo:
            return {
                **pr_out,
                "reason": f"a commit from {log_safe(bot.get('login'), 40)}, a bot: a maintainer "
                f"reviews it, then labels {LABEL}",
            }
        return {
            **pr_out,
            "reason": f"a fork's new commit: a maintainer reviews it, then labels {LABEL}",
        }
    return {**pr_out, "reason": f"action {log_safe(action, 30)} does not run the GPU job"}


def _write_outputs(values: dict) -> None:
    lines = [f"{key}={md.flat(value, 300)}" for key, value in values.items()]
    path = os.environ.get("GITHUB_OUTPUT")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
    for line in lines:
        print(f"approve: {log_safe(line, 320)}")


def _event() -> tuple[str, dict]:
    name = os.environ.get("GITHUB_EVENT_NAME", "")
    path = os.environ.get("GITHUB_EVENT_PATH", "")
    try:
        event = json.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    except (OSError, ValueError) as exc:
        raise SystemExit(f"approve: cannot read the event {path}: {log_safe(exc)}") from None
    return name, event if isinstance(event, dict) else {}


def approve(record: Path | None = None) -> int:
    name, event = _event()
    repo = os.environ.get("GITHUB_REPOSITORY", "")
    inputs = {"pr": os.environ.get("INPUT_PR", ""), "sha": os.environ.get("INPUT_SHA", "")}
    gh = GitHub(repo)
    labelled = None
    run_id = os.environ.get("GITHUB_RUN_ID", "")
    if name == "pull_request_target" and event.get("action") == "labeled" and run_id.isdigit():
        try:  # this run started when the label was applied: GitHub's clock, not the runner's
            labelled = runartifacts.parse_time(
                (gh.call("GET", f"actions/runs/{run_id}") or {}).get("created_at")
            )
        except ApiError as exc:
            print(f"approve: this run's start is unreadable ({log_safe(exc)}): using now")
    result = decide(name, event, repo, os.environ.get("GITHUB_SHA", ""), gh, inputs, labelled)
    _write_outputs(result)
    if record is not None:  # the approval the report job trusts (uploaded before PR code runs)
        record.parent.mkdir(parents=True, exist_ok=True)
        doc = {"run": result["run"] == "true", "pr": int(result["pr"]) if result["pr"] else None}
        doc["sha"] = result["sha"] or None
        doc["run_id"] = os.environ.get("GITHUB_RUN_ID") or None  # the report checks it is its run
        record.write_text(json.dumps(doc) + "\n", encoding="utf-8")
    return 0


# --------------------------------------------------------------------------------------------------
# gate
# --------------------------------------------------------------------------------------------------


def leg_results(jobs: Iterable[dict]) -> dict[str, str]:
    """Each GPU kind's leg result in a run's jobs (gpukinds.JOB_NAME): its conclusion, `running`
    while it has none, `missing` when no job of that name is listed."""
    by_name = {str(job.get("name")): job for job in jobs}
    results = {}
    for kind in gpukinds.KINDS:
        job = by_name.get(gpukinds.job_name(kind))
        if job is None:
            results[kind] = "missing"
        else:
            results[kind] = str(job.get("conclusion") or job.get("status") or "running")
    return results


def _legs_text(results: dict[str, str]) -> str:
    return ", ".join(f"{kind} {log_safe(result, 20)}" for kind, result in results.items())


def gate(
    gh: GitHub,
    head_sha: str,
    tested_sha: str,
    gpu_result: str,
    run_url: str,
    run_id: str | None = None,
) -> int:
    """Set STATUS_CONTEXT on `head_sha` and return 0 only when every leg of the GPU job passed
    on it. `gpu_result` is needs.gpu.result (all legs together); the run's jobs (`run_id`) say
    which leg is which, and a leg missing from them fails the gate too."""
    if not _SHA.match(head_sha):
        print(f"gate: no head commit to judge ({log_safe(head_sha, 40)})", file=sys.stderr)
        return 1
    legs = None
    if tested_sha == head_sha and run_id:
        try:
            legs = leg_results(gh.run_jobs(run_id))
        except (ApiError, ValueError) as exc:
            print(
                f"gate: this run's jobs are unreadable ({log_safe(exc)}): judging all legs at once"
            )
    failed = {kind: result for kind, result in (legs or {}).items() if result != "success"}
    if tested_sha == head_sha and gpu_result == "success" and not failed:
        state, why = "success", "GPU job passed on this commit"
        if legs:
            why += f" ({_legs_text(legs)})"
    elif tested_sha == head_sha and (gpu_result in ("failure", "cancelled") or failed):
        named = f"; not passed: {_legs_text(failed)}" if failed else ""
        state, why = "failure", f"GPU job {log_safe(gpu_result, 20)} on this commit{named}"
    else:
        # This run did not test the head (a fork's push awaiting review, another label): the head
        # passes only if an earlier run of ours set the status to success on it.
        statuses = gh.call("GET", f"commits/{head_sha}/statuses?per_page=100") or []
        ours = [
            s
            for s in statuses
            if isinstance(s, dict)
            and s.get("context") == STATUS_CONTEXT
            and ((s.get("creator") or {}).get("login") == BOT)
        ]
        latest = ours[0] if ours else None  # newest first
        if latest and latest.get("state") == "success":
            print(f"gate: {head_sha[:12]} already passed the GPU job in an earlier run")
            return 0
        state = "pending" if not latest else str(latest.get("state"))
        why = "not tested on the GPU: a maintainer reviews it, then labels " + LABEL
        if state != "pending":
            print(f"gate: {head_sha[:12]} is {log_safe(state, 20)} from an earlier run")
            return 1
    gh.call(
        "POST",
        f"statuses/{head_sha}",
        {
            "state": state,
            "context": STATUS_CONTEXT,
            "description": why[:140],
            "target_url": run_url,
        },
    )
    print(f"gate: {head_sha[:12]}: {state} ({why})")
    if failed:
        print(f"::error::GPU legs that did not pass: {_legs_text(failed)}")
    return 0 if state == "success" else 1


# --------------------------------------------------------------------------------------------------
# main's benchmark history (the bench-history branch: pipeline.ci.historybranch)
# --------------------------------------------------------------------------------------------------


def checked_run(bench: Path, sha: str, run_id: str | None) -> benchrecords.BenchRecord:
    """The bench record of the pushed commit and of this run, or ValueError: history keeps
    nothing measured on another commit, an edited tree or in an earlier run."""
    record = benchrecords.load(bench)
    commit = record.commit
    if commit is None or commit.sha != sha:
        measured = commit.sha[:12] if commit else "an unknown commit"
        raise ValueError(f"bench.json measured {measured}, not the pushed {sha[:12]}: not stored")
    if commit.dirty:
        raise ValueError(f"bench.json measured an edited tree of {sha[:12]}: not stored")
    written_by = (record.provenance or {}).get("run_id")
    if run_id and written_by != run_id:
        raise ValueError(
            f"bench.json was written by run {log_safe(written_by, 80)}, not {run_id}: not stored"
        )
    return record


def history(
    gh: GitHub,
    branch: historybranch.Branch,
    reports: Path,
    sha: str,
    summary: Path | None,
    workdir: Path,
    run_id: str | None = None,
    run_url: str = "",
) -> int:
    """Each leg of main's pushed run (reports/gpu-ci-reports-KIND/bench.json) against its kind's
    history, then stored under its kind: history_of_leg per kind; and each leg's gate verdict
    (verdict_of_leg). 0 when every leg was stored with every case inside its band; 1 when a
    leg's bench.json is missing or unusable (the other legs are still stored), a case left its
    band, or a verdict could not be pushed."""
    code = 0
    for kind in gpukinds.KINDS:
        leg_run = gpukinds.leg_run_id(run_id, kind) if run_id else None
        code = max(code, verdict_of_leg(branch, kind, reports, sha, leg_run, run_url))
        bench = reports / gpukinds.artifact_name(kind) / "bench.json"
        if not bench.is_file():
            print(
                f"::error::history: the {kind} leg left no bench.json "
                f"({gpukinds.artifact_name(kind)}): nothing stored for {kind}"
            )
            code = 1
            continue
        try:
            found = history_of_leg(gh, branch, kind, bench, sha, summary, workdir, leg_run)
        except (ValueError, benchrecords.InvalidBenchFile) as exc:
            print(f"::error::history ({kind}): {log_safe(exc, 400)}")
            found = 1
        code = max(code, found)
    return code


def verdict_of_leg(
    branch: historybranch.Branch,
    kind: str,
    reports: Path,
    sha: str,
    run_id: str | None,
    run_url: str,
) -> int:
    """Store one leg's gate verdict (selection.verdict_record) under its key. A leg without
    one to store (no selection.json, a reused verdict, no key) is said and skipped: 0; 1 only
    when the branch could not be written."""
    folder = reports / gpukinds.artifact_name(kind)
    docs = []
    for name in (selection.RECORD, "gates.json"):
        try:
            raw = (folder / name).read_bytes() if (folder / name).is_file() else b""
            doc = json.loads(raw) if 0 < len(raw) <= 64 << 20 else None
        except ValueError:
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    if None in docs or not run_id:
        print(
            f"::warning::verdict ({kind}): no selection.json and gates.json of this run: none stored"
        )
        return 0
    try:
        record = selection.verdict_record(
            docs[0], docs[1], sha=sha, run_id=run_id, run_url=run_url, kind=kind
        )
    except ValueError as exc:
        print(f"::warning::verdict ({kind}): {log_safe(exc, 300)}: none stored")
        return 0
    try:
        commit = branch.store_verdict(record, kind)
    except historybranch.HistoryError as exc:
        print(f"::error::verdict ({kind}): {log_safe(exc, 400)}")
        return 1
    print(f"verdict: {sha[:12]} ({kind}) stored as {log_safe(record['key'], 240)} in {commit[:12]}")
    return 0


def history_of_leg(
    gh: GitHub,
    branch: historybranch.Branch,
    kind: str,
    bench: Path,
    sha: str,
    summary: Path | None,
    workdir: Path,
    run_id: str | None = None,
) -> int:
    """Set one leg of main's new run beside its kind's history (the trend with this run as the
    newest point, the noise bands; another kind's points never count), store it under the
    kind, and alert when a case left its band: a comment on the commit and exit 1. 0 when every
    case is inside."""
    record = checked_run(bench, sha, run_id)
    current = trend.point_of(record, sha)
    points_dir = workdir / "points" / kind
    shutil.rmtree(points_dir, ignore_errors=True)
    branch.fetch_points(points_dir, kind=kind)
    stored, skipped = trend.load_points(points_dir, current.gpu)
    points = [*(p for p in stored if p.sha != current.sha), current][-trend.KEEP :]
    comparison = benchrecords.to_json(record.comparison) if record.comparison else None
    body, outside = trend.markdown(points, current, comparison, skipped)
    if len(points) == 1:  # this run alone: no runner of another kind stands in for the history
        body = (
            f"The first stored main run of the {kind} leg: no earlier runs of this kind to set it "
            f"beside (another GPU kind's runs are never used).\n\n{body}"
        )
    title = f"{'⚠️' if outside else '✅'} main's benchmark history at {sha[:12]} ({kind} leg)"
    text = f"## {title}\n\n{body}\n"
    if summary:
        with summary.open("a", encoding="utf-8") as handle:
            handle.write(text)
    commit = branch.store(
        current,
        bench.read_bytes(),
        kind,
        on_retry=lambda n: print(f"history: {historybranch.BRANCH} moved; retrying ({n})"),
    )
    print(f"history: {sha[:12]} ({kind}) stored on {historybranch.BRANCH} in {commit[:12]}")
    if not outside:
        print(
            f"history ({kind}): every case inside main's noise band "
            f"({md.plural(len(points), 'run')})"
        )
        return 0
    gh.call("POST", f"commits/{sha}/comments", {"body": text[:60_000]})
    print(
        f"::error::{kind}: {md.plural(len(outside), 'case')} left main's noise band: "
        + log_safe(", ".join(outside[:10]), 400)
    )
    return 1


def fetch_run(gh: GitHub, run_id: str, out: Path) -> int:
    """runartifacts.fetch_run, said in the log: 0 when the approval was taken (a leg refused is a
    note of the comment), 1 when it was not (nothing is to be posted from that run)."""
    try:
        fetched = runartifacts.fetch_run(gh, run_id, out)
    except runartifacts.Refused as exc:
        print(
            f"::error::the approval of run {log_safe(run_id, 20)} is not taken: {log_safe(exc, 400)}"
        )
        print("gpuci: next: nothing is posted from this run; run GPU CI again for the PR")
        return 1
    print(
        f"fetch-run: the approval of run {run_id} taken; legs: {', '.join(fetched.legs) or 'none'}"
    )
    for note in fetched.notes:
        print(f"::warning::{log_safe(note, 400)}")
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science.pipeline.ci.gpuci", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("approve", help="decide whether and what the GPU job runs (event from env)")
    a.add_argument("--record", type=Path, default=None, help="also write the decision here")
    g = sub.add_parser("gate", help="the required check on the PR's head commit")
    g.add_argument("--head-sha", required=True)
    g.add_argument("--tested-sha", default="")
    g.add_argument("--gpu-result", default="skipped", help="needs.gpu.result")
    g.add_argument("--run-id", default=None, help="this run's id: its jobs name each leg")
    g.add_argument("--run-url", default="")
    h = sub.add_parser("history", help="main's run against its history, then stored (alerts)")
    h.add_argument(
        "--reports",
        type=Path,
        required=True,
        help="the run's artifacts: one gpu-ci-reports-KIND folder per leg",
    )
    h.add_argument("--sha", required=True)
    h.add_argument("--run-id", default=None, help="the GPU CI run that must have written it")
    h.add_argument("--summary", type=Path, default=None, help="append the section here")
    h.add_argument("--run-url", default="", help="the GPU CI run's page, kept with each verdict")
    h.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    r = sub.add_parser(
        "fetch-run", help="a run's approval and legs, by exact name, checked (runartifacts)"
    )
    r.add_argument("--run-id", required=True, help="the GPU CI run")
    r.add_argument("--out", type=Path, required=True, help="OUT/gpu-ci-approval/, OUT/legs/")
    f = sub.add_parser("fetch-points", help="download the newest trend points of each kind")
    f.add_argument("--out", type=Path, required=True, help="written: OUT/KIND/ for each kind")
    f.add_argument("--keep", type=int, default=trend.KEEP)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.command == "fetch-points" and args.keep < 1:
        parser.error(f"--keep must be at least 1 (points to fetch), not {args.keep}")
    try:
        if args.command == "approve":
            return approve(args.record)
        gh = GitHub(os.environ.get("GITHUB_REPOSITORY", ""))
        if args.command == "fetch-run":
            return fetch_run(gh, args.run_id, args.out)
        if args.command == "gate":
            return gate(
                gh, args.head_sha, args.tested_sha, args.gpu_result, args.run_url, args.run_id
            )
        with tempfile.TemporaryDirectory() as tmp:
            remote = historybranch.remote_url()
            branch = historybranch.Branch(Path(tmp), remote, os.environ.get("GH_TOKEN"))
            if args.command == "fetch-points":
                for kind in gpukinds.KINDS:
                    count = branch.fetch_points(args.out / kind, args.keep, kind)
                    print(
                        f"fetch-points: {count} points of {historybranch.BRANCH} ({kind}) "
                        f"-> {args.out / kind}"
                    )
                return 0
            workdir = args.workdir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            return history(
                gh,
                branch,
                args.reports,
                args.sha,
                args.summary,
                workdir,
                args.run_id,
                args.run_url,
            )
    except (
        ApiError,
        ValueError,
        OSError,
        benchrecords.InvalidBenchFile,
        historybranch.HistoryError,
    ) as exc:
        print(f"gpuci {args.command}: {log_safe(exc, 600)}", file=sys.stderr)
        print("gpuci: next: check the job's token permissions and the API address", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
