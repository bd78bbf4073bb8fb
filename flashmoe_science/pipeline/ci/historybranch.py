"""The `bench-history` branch: main's benchmark runs over time, read and written with git.

Each push to main whose GPU CI run passed adds one commit per GPU kind (pipeline.gpukinds: one
leg of the GPU job each) to the branch, which holds nothing else (it starts without a parent):

    points/<kind>/<date>-<sha12>.json   the leg's trend point (pipeline.bench.trend: our median per case)
    runs/<kind>/<date>-<sha12>.json     the leg's bench.json as its GPU job wrote it (samples included)
    verdicts/<kind>/<key>.json          the leg's gate verdict under its selection key, which a pull
                                        request that changes no gate input reuses (ci/selection.py)

A kind's history is its folder alone: an h100 run is never set beside an l4 one. Points at the
top level of points/ are from before the kinds (L4 runners only) and count as LEGACY_KIND's. A
second run of the same commit (a re-run of its workflow) replaces that commit's files of its kind. Git rather
than the contents API: both files land in one commit, the newest points come in one shallow fetch,
and when two writers race the second push is rejected and retried on the new tip, never
overwriting.

The remote is $FLASHMOE_HISTORY_REMOTE when set (any URL or path git takes: a stand-in), else
$GITHUB_SERVER_URL/$GITHUB_REPOSITORY.git. The token ($GH_TOKEN) reaches git as an HTTP header for
that server through the environment (GIT_CONFIG_*, the header actions/checkout uses), never in a
URL, an argument or a file. Every command runs in a scratch repository of its own, with no global
or system git config and no hooks, so no checkout's configuration takes part.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path

from .. import gpukinds
from ..bench import trend

BRANCH = "bench-history"
POINTS_DIR = "points"
RUNS_DIR = "runs"
VERDICTS_DIR = "verdicts"  # ci/selection.py reads them back by this name
MAX_RUN_BYTES = 16 << 20  # a bench.json of the full matrix is ~100 KB
PUSH_ATTEMPTS = 5  # pushes to main land minutes apart: a race is rare, five in a row is a fault
BOT = ("github-actions[bot]", "41898282+github-actions[bot]@users.noreply.github.com")
_NAME = re.compile(r"^[0-9]{8}T[0-9]{6}-[0-9a-f]{7,12}\.json$")
_REPO = re.compile(r"^[\w.-]+/[\w.-]+$")


class HistoryError(RuntimeError):
    """The branch could not be read or written; the message says what to check."""


def _said(stderr: bytes, limit: int = 400) -> str:
    """What git wrote to stderr, on one line (the end, where the reason is)."""
    return " ".join(stderr.decode(errors="replace").split())[-limit:]


def remote_url(env: Mapping[str, str] | None = None) -> str:
    """Where the branch lives: $FLASHMOE_HISTORY_REMOTE, else this repository on its server."""
    env = os.environ if env is None else env
    if env.get("FLASHMOE_HISTORY_REMOTE"):
        return env["FLASHMOE_HISTORY_REMOTE"]
    repo = env.get("GITHUB_REPOSITORY", "")
    if not _REPO.match(repo):
        raise HistoryError(
            f"GITHUB_REPOSITORY={repo!r} is not OWNER/NAME: set it, or set "
            "FLASHMOE_HISTORY_REMOTE to the repository that keeps the bench-history branch"
        )
    server = (env.get("GITHUB_SERVER_URL") or "https://github.com").rstrip("/")
    return f"{server}/{repo}.git"


def git_environment(remote: str, token: str | None) -> dict[str, str]:
    """The environment git runs in: no config but this, the token as a header for the remote's
    server only (an https remote), English messages (the push's rejection is read)."""
    settings = [
        ("core.hooksPath", "/dev/null"),
        ("gc.auto", "0"),
        # A stalled connection fails in a minute instead of holding the job to its limit.
        ("http.lowSpeedLimit", "1000"),
        ("http.lowSpeedTime", "60"),
    ]
    parts = urllib.parse.urlsplit(remote)
    if token and parts.scheme == "https" and parts.netloc:
        basic = base64.b64encode(f"x-access-token:{token}".encode()).decode()
        settings.append(
            (f"http.https://{parts.netloc}/.extraheader", f"AUTHORIZATION: basic {basic}")
        )
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("GIT_", "LC_", "LANG"))
    }
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_AUTHOR_NAME=BOT[0],
        GIT_AUTHOR_EMAIL=BOT[1],
        GIT_COMMITTER_NAME=BOT[0],
        GIT_COMMITTER_EMAIL=BOT[1],
        LC_ALL="C",
        GIT_CONFIG_COUNT=str(len(settings)),
    )
    for i, (key, value) in enumerate(settings):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


class Branch:
    """The history branch of one remote, through a scratch bare repository in `scratch`."""

    def __init__(self, scratch: Path, remote: str, token: str | None = None):
        self.remote = remote
        self.git_dir = Path(scratch) / "bench-history.git"
        self._env = git_environment(remote, token)
        self.git("init", "--quiet", "--bare", str(self.git_dir), git_dir=False)

    def git(
        self,
        *args: str,
        stdin: bytes | None = None,
        git_dir: bool = True,
        check: bool = True,
        index: Path | None = None,
    ) -> subprocess.CompletedProcess:
        command = ["git", *(["--git-dir", str(self.git_dir)] if git_dir else []), *args]
        env = {**self._env, "GIT_INDEX_FILE": str(index)} if index else self._env
        try:
            done = subprocess.run(command, input=stdin, capture_output=True, env=env, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HistoryError(f"git {args[0]} did not run: {exc}; is git installed?") from exc
        if check and done.returncode != 0:
            raise HistoryError(
                f"git {args[0]} failed (exit {done.returncode}): {_said(done.stderr)}"
            )
        return done

    def _text(self, *args: str, index: Path | None = None) -> str:
        return self.git(*args, index=index).stdout.decode().strip()

    def tip(self) -> str | None:
        """Fetch the branch's newest commit (shallow); None when the remote has no such branch."""
        listed = self.git("ls-remote", "--heads", self.remote, f"refs/heads/{BRANCH}", check=False)
        if listed.returncode != 0:
            raise HistoryError(
                f"cannot reach {self.remote}: {_said(listed.stderr)}; next: check the "
                "job's token (contents: read, or write to store) and the remote's address"
            )
        if not listed.stdout.strip():
            return None
        self.git("fetch", "--quiet", "--no-tags", "--depth=1", self.remote, f"+{BRANCH}:{BRANCH}")
        return self._text("rev-parse", "--verify", f"{BRANCH}^{{commit}}")

    def files(self, tip: str, folder: str) -> list[str]:
        """The names of the plain files (no links, no folders) in `folder` at `tip`, sorted."""
        listing = self.git("ls-tree", "-z", tip, f"{folder}/").stdout.decode()
        names = []
        for entry in filter(None, listing.split("\0")):
            meta, path = entry.split("\t", 1)
            mode, kind, _ = meta.split()
            if mode == "100644" and kind == "blob":
                names.append(path.removeprefix(f"{folder}/"))
        return sorted(names)

    def fetch_points(
        self, out: Path, keep: int = trend.KEEP, kind: str = gpukinds.LEGACY_KIND
    ) -> int:
        """The newest `keep` points of `kind` on the branch into `out`; how many were written."""
        folders = [f"{POINTS_DIR}/{gpukinds.kind_of(kind).label}"]
        if kind == gpukinds.LEGACY_KIND:
            folders.append(POINTS_DIR)
        tip = self.tip()
        out.mkdir(parents=True, exist_ok=True)
        if tip is None:
            return 0
        found = sorted(
            (name, folder)
            for folder in folders
            for name in self.files(tip, folder)
            if _NAME.match(name)
        )
        written = 0
        for name, folder in found[-keep:] if keep else []:
            spec = f"{tip}:{folder}/{name}"
            if int(self._text("cat-file", "-s", spec)) > trend.MAX_POINT_BYTES:
                continue  # load_points would refuse it: not worth the download
            (out / name).write_bytes(self.git("cat-file", "blob", spec).stdout)
            written += 1
        return written

    def store(
        self,
        point: trend.Point,
        bench_json: bytes,
        kind: str,
        on_retry: Callable | None = None,
    ) -> str:
        """Commit one leg's point and bench.json under its kind (replacing an earlier run of the
        same commit and kind) and push; retried on a new tip when another writer got there first.
        The stored commit's id."""
        kind = gpukinds.kind_of(kind).label
        if len(bench_json) > MAX_RUN_BYTES:
            raise HistoryError(f"bench.json is {len(bench_json)} bytes, over {MAX_RUN_BYTES}")
        name = trend.point_name(point)
        payload = {
            f"{POINTS_DIR}/{kind}/{name}": (json.dumps(point.to_json(), indent=1) + "\n").encode(),
            f"{RUNS_DIR}/{kind}/{name}": bench_json,
        }
        return self._push(payload, point.sha[:12], f"bench history ({kind}): {name[:-5]}", on_retry)

    def store_verdict(self, verdict: dict, kind: str, on_retry: Callable | None = None) -> str:
        """Commit one leg's gate verdict (selection.verdict_record) as verdicts/KIND/KEY.json,
        replacing an earlier run's of the same key, and push. The stored commit's id."""
        kind = gpukinds.kind_of(kind).label
        key = str(verdict.get("key") or "")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", key):
            raise HistoryError(f"a verdict's key must name a file, not {key[:80]!r}")
        payload = {
            f"{VERDICTS_DIR}/{kind}/{key}.json": (json.dumps(verdict, indent=1) + "\n").encode()
        }
        sha = str(verdict.get("sha") or "")[:12]
        return self._push(payload, None, f"gate verdict ({kind}) of {sha}: {key}", on_retry)

    def _push(
        self,
        payload: dict[str, bytes],
        sha12: str | None,
        message: str,
        on_retry: Callable | None,
    ) -> str:
        """Commit `payload` on the branch's tip and push; retried on a new tip when another
        writer got there first."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            tip = self.tip()
            commit = self._commit(tip, payload, sha12, message)
            if commit == tip:
                return tip  # this very run is stored already
            pushed = self.git(
                "push", "--quiet", self.remote, f"{commit}:refs/heads/{BRANCH}", check=False
            )
            if pushed.returncode == 0:
                return commit
            why = _said(pushed.stderr)
            if not re.search(r"rejected|fetch first|non-fast-forward|stale info", why):
                raise HistoryError(
                    f"git push to {self.remote} failed: {why}; next: the job "
                    "needs `permissions: contents: write`, and the branch no protection rule"
                )
            if on_retry:
                on_retry(attempt)
        raise HistoryError(
            f"{BRANCH} moved under every one of {PUSH_ATTEMPTS} pushes; rerun the job"
        )

    def _commit(
        self, tip: str | None, payload: dict[str, bytes], sha12: str | None, message: str
    ) -> str:
        """A commit of `tip`'s tree with `payload` in it and, given `sha12`, that commit's earlier
        files of the same folders out; `tip` itself when nothing changes."""
        index = self.git_dir / "history.index"
        index.unlink(missing_ok=True)
        self.git("read-tree", *([tip] if tip else ["--empty"]), index=index)
        listed = self.git("ls-files", "-z", index=index).stdout.decode().split("\0")
        folders = {path.rsplit("/", 1)[0] for path in payload}
        earlier = [
            p
            for p in listed
            if sha12
            and p.endswith(f"-{sha12}.json")
            and p not in payload
            and p.rsplit("/", 1)[0] in folders
        ]
        lines = [f"0 {'0' * 40}\t{path}" for path in earlier]  # mode 0: out of the index
        for path, data in payload.items():
            blob = self.git("hash-object", "-w", "--stdin", stdin=data).stdout.decode().strip()
            lines.append(f"100644 {blob}\t{path}")
        self.git("update-index", "--index-info", stdin="\n".join(lines).encode(), index=index)
        tree = self._text("write-tree", index=index)
        if tip and tree == self._text("rev-parse", f"{tip}^{{tree}}"):
            return tip
        return self._text("commit-tree", tree, *(["-p", tip] if tip else []), "-m", message)
