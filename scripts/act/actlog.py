"""Helpers for scripts/act/run-job.sh (standard library only).

    actlog.py render LOG SUMMARY   act's --json log on stdin -> readable lines on stdout; the raw log
                                   to LOG; the job's step summaries, in step order, to SUMMARY
    actlog.py event EVENT REPO SHA  a fake event payload for EVENT (pull_request and
                                    pull_request_target: PR #1 onto main)

act runs each step with its own $GITHUB_STEP_SUMMARY file (under the host workspace, which it
deletes when the job ends) and reports what the step wrote as a log entry with command=summary:
that entry is where the job's summary is read from.
"""

from __future__ import annotations

import json
import sys

# act repeats these for every expression it evaluates when the tree has no .git (a copy of the
# working tree): show each once.
ONCE = ("not located inside a git repository", "unable to get git revision")


def render(log_path: str, summary_path: str) -> int:
    seen: set[str] = set()
    # Written as it comes, so a run that is killed still leaves the summaries so far.
    with (
        open(log_path, "w", encoding="utf-8") as log,
        open(summary_path, "w", encoding="utf-8") as out,
    ):
        for line in sys.stdin:
            log.write(line)
            log.flush()
            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if not isinstance(entry, dict) or "msg" not in entry:
                print(line.rstrip("\n"), flush=True)
                continue
            msg = str(entry["msg"]).rstrip("\n")
            job = entry.get("jobID") or entry.get("job") or "act"
            if entry.get("command") == "summary":
                content = str(entry.get("content", ""))
                if content.strip():
                    out.write(("\n" if out.tell() else "") + content.rstrip("\n") + "\n")
                    out.flush()
                first = content.strip().splitlines()[0] if content.strip() else ""
                lines = len(content.splitlines())
                print(
                    f"[{job}]   ⚙  Summary ({lines} lines, printed at the end): {first}", flush=True
                )
                continue
            if any(text in msg for text in ONCE):
                if msg in seen:
                    continue
                seen.add(msg)
            if entry.get("raw_output"):
                for part in msg.splitlines() or [""]:
                    print(f"[{job}]   | {part}", flush=True)
                continue
            # Step banners carry the whole `run:` script: its first line names the step well enough.
            head, _, rest = msg.partition("\n")
            level = entry.get("level", "info")
            tail = " [...]" if rest.strip() and level == "info" else ("\n" + rest if rest else "")
            prefix = "" if level in ("info", "debug") else f"{level}: "
            print(f"[{job}] {prefix}{head}{tail}", flush=True)
    return 0


def event(name: str, repo: str, sha: str) -> int:
    owner = repo.split("/")[0]
    repository = {
        "full_name": repo,
        "name": repo.split("/")[-1],
        "owner": {"login": owner},
        "default_branch": "main",
    }
    payload: dict = {"repository": repository, "sender": {"login": "act"}}
    if name in ("pull_request", "pull_request_target"):
        payload.update(
            action="synchronize",
            number=1,
            pull_request={
                "number": 1,
                "title": "local run under nektos/act",
                "head": {"ref": "act-local", "sha": sha, "repo": {"full_name": repo}},
                "base": {"ref": "main", "sha": "", "repo": {"full_name": repo}},
                "labels": [],
            },
        )
    elif name == "push":
        payload.update(ref="refs/heads/main", before="0" * 40, after=sha)
    elif name == "workflow_dispatch":
        payload.update(ref="refs/heads/main", inputs={})
    elif name == "workflow_run":
        payload.update(
            action="completed",
            workflow_run={
                "id": 1,
                "run_attempt": 1,
                "event": "pull_request_target",
                "conclusion": "success",
                "head_sha": sha,
                "head_branch": "act-local",
                "head_repository": {"full_name": repo},
                "html_url": f"https://github.com/{repo}/actions/runs/1",
                "pull_requests": [],
            },
        )
    json.dump(payload, sys.stdout, indent=2)
    print()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "render":
        return render(argv[1], argv[2])
    if len(argv) == 4 and argv[0] == "event":
        return event(argv[1], argv[2], argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
