"""Which code and which run a pipeline record describes.

Every JSON file a stage writes under the report directory carries `provenance()`: the commit (sha,
whether the tree was dirty, and a fingerprint of the uncommitted change), and the run id. The report
compares them with the checkout it renders for, so inputs left behind by another commit (a bisect
step, an older run) show as stale instead of as a pass.

The run id is FLASHMOE_RUN_ID when set: the workflows set it to the GitHub run, and then the report
calls any record of another run stale. Locally it is unset: each command records an id of its own,
and the report judges the records by the code they describe (commit and uncommitted change), so
`nox -s build test bench` followed later by `nox -s report` on the same tree is one verdict.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import subprocess
import uuid
from pathlib import Path

from .paths import REPO_ROOT, report_dir

RUN_ID_VAR = "FLASHMOE_RUN_ID"
_PROCESS_RUN_ID = None


def new_run_id() -> str:
    """'20261126T141500Z-3fa2c1': sortable by start time, unique enough for one machine."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def run_id() -> str:
    """This run's id: FLASHMOE_RUN_ID, else one id for the life of this process."""
    global _PROCESS_RUN_ID
    value = os.environ.get(RUN_ID_VAR, "").strip()
    if value:
        return value
    if _PROCESS_RUN_ID is None:
        _PROCESS_RUN_ID = new_run_id()
    return _PROCESS_RUN_ID


def _git(tree: Path, *args: str) -> bytes | None:
    try:
        result = subprocess.run(
            ["git", *args], cwd=tree, capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def commit(tree: Path = REPO_ROOT) -> dict:
    """{"sha": full sha or None (not a git checkout), "dirty": bool, "fingerprint": str or None}.

    In a checkout the fingerprint hashes the uncommitted change (tracked diff against HEAD plus
    untracked files that git does not ignore), so two runs over the same dirty tree agree and any
    edit between them does not. It is None for a clean tree. Outside one it is the tree's
    source_fingerprint, so records of the same files still agree there.

    A tree that git does not track is not a checkout, even inside one: an installed copy in a
    virtual environment or an unpacked archive under someone's repository would otherwise be
    described by that repository's commit. Only the tree's own files count toward "dirty"."""
    sha = _git(tree, "rev-parse", "--verify", "HEAD")
    if sha is None or not _git(tree, "ls-files", "-z", "--", "."):
        return {"sha": None, "dirty": False, "fingerprint": source_fingerprint(tree)}
    diff = _git(tree, "diff", "HEAD", "--binary", "--no-ext-diff", "--", ".") or b""
    untracked = _git(tree, "ls-files", "--others", "--exclude-standard", "-z", "--", ".") or b""
    if not diff and not untracked:
        return {"sha": sha.decode().strip(), "dirty": False, "fingerprint": None}
    digest = hashlib.sha256(diff)
    for name in sorted(n for n in untracked.split(b"\0") if n):
        digest.update(b"\0" + name + b"\0")
        path = tree / os.fsdecode(name)
        with contextlib.suppress(OSError):  # vanished or unreadable: its name still counts
            digest.update(path.read_bytes())
    return {"sha": sha.decode().strip(), "dirty": True, "fingerprint": digest.hexdigest()[:16]}


# What the code of a tree outside git is: the package, the kernels and the build's configuration.
SOURCE_PARTS = ("flashmoe_science", "csrc", "pyproject.toml", "noxfile.py")


def source_fingerprint(tree: Path) -> str | None:
    """A hash of SOURCE_PARTS' files under `tree` (names and contents, caches left out), or None
    when it has none of them."""
    digest = hashlib.sha256()
    found = False
    for part in SOURCE_PARTS:
        top = tree / part
        files = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in files:
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            found = True
            digest.update(b"\0" + path.relative_to(tree).as_posix().encode() + b"\0")
            with contextlib.suppress(OSError):  # vanished or unreadable: its name still counts
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16] if found else None


def provenance(tree: Path = REPO_ROOT) -> dict:
    """The block every record carries: {"commit": commit(tree), "run_id": run_id()}."""
    return {"commit": commit(tree), "run_id": run_id()}


def same_code(a: dict | None, b: dict | None) -> bool:
    """True when two commit blocks describe the same code: same sha and uncommitted change, or, for
    trees outside git, the same source fingerprint."""
    if not a or not b:
        return False
    if not a.get("sha") and not b.get("sha"):
        return bool(a.get("fingerprint")) and a.get("fingerprint") == b.get("fingerprint")
    if not a.get("sha") or not b.get("sha"):
        return False
    return (a.get("sha"), bool(a.get("dirty")), a.get("fingerprint")) == (
        b.get("sha"),
        bool(b.get("dirty")),
        b.get("fingerprint"),
    )


def describe_commit(block: dict | None) -> str:
    """'3fa2c1d4e5f6' / '3fa2c1d4e5f6 (dirty 9b1c2d3e)' / 'no commit (files 9b1c2d3e)' /
    'unknown commit'."""
    if block and not block.get("sha") and block.get("fingerprint"):
        return f"no commit (files {block['fingerprint']})"
    if not block or not block.get("sha"):
        return "unknown commit"
    text = str(block["sha"])[:12]
    if block.get("dirty"):
        text += f" (dirty {block.get('fingerprint') or '?'})"
    return text


def clear_outputs(*names: str) -> None:
    """Remove this stage's files from the report directory before it runs, so a stage that fails
    or stops early never leaves an older run's file behind to be read as its result."""
    directory = report_dir()
    for name in names:
        (directory / name).unlink(missing_ok=True)
