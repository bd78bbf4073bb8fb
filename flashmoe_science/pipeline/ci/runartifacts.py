"""A GPU CI run's artifacts as the trusted report job (pr-report.yml) takes them: through the REST
API, by exact name (never a pattern), each checked before a byte of it is read.

    the approval  the run's one artifact named gpu-ci-approval, created no later than the approve
                  job completed (the jobs API). PR code runs only after that job, and can reach the
                  runtime token that uploads artifacts (upload-artifact's `overwrite` deletes and
                  uploads again): a second approval, or one created later, is refused. Its run_id
                  must be the run's own.
    each leg      the one artifact named gpu-ci-reports-KIND (two of a name: refused), at most
                  MAX_ZIP_BYTES as listed and as downloaded, with the digest the API lists,
                  extracted with no path outside its folder, no link, at most MAX_FILES files and
                  MAX_TREE_BYTES in all. A leg refused shows as such in the comment (FETCH_NOTES).

fetch_run writes OUT/gpu-ci-approval/approval.json, OUT/legs/gpu-ci-reports-KIND/ for each leg it
took, and OUT/legs/FETCH_NOTES, one line per leg it refused. `gh` is a gpuci.GitHub.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import io
import json
import shutil
import stat
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from .. import gpukinds
from .. import markdown as md

# Written beside the legs' folders: one line per leg whose artifact was refused (two of a name,
# over a size cap, a path outside its folder); report.legs shows them in the comment.
FETCH_NOTES = "fetch-notes.txt"

APPROVAL = "gpu-ci-approval"
APPROVAL_FILE = "approval.json"
APPROVE_JOB = "Approve the commit to test (trusted)"  # gpu-ci.yml's approve job, by its name
MAX_ZIP_BYTES = 64 * 2**20  # a leg's zip, as listed and as downloaded
MAX_TREE_BYTES = 256 * 2**20  # what one zip may unpack to
MAX_FILES = 5_000
MAX_APPROVAL_BYTES = 64 * 2**10


class Refused(Exception):
    """An artifact that is not taken; the message says why, in one line."""


@dataclasses.dataclass
class Fetched:
    approval: dict
    legs: list[str]  # the artifact names taken
    notes: list[str]  # one line per leg refused


def parse_time(value: object) -> dt.datetime | None:
    """An API timestamp ("2026-12-01T10:00:30Z") as an aware datetime; None if it is not one."""
    try:
        when = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def _named(artifacts: list[dict], name: str) -> list[dict]:
    return [a for a in artifacts if a.get("name") == name and not a.get("expired")]


def _download(gh: Any, artifact: dict, limit: int) -> bytes:
    listed = artifact.get("size_in_bytes")
    if not isinstance(listed, int) or listed > limit:
        raise Refused(f"{md.flat(listed, 30)} bytes as listed, over the cap of {limit}")
    try:
        blob = gh.download(f"actions/artifacts/{int(artifact['id'])}/zip", limit)
    except (RuntimeError, ValueError, OSError) as exc:  # gpuci.ApiError is a RuntimeError
        raise Refused(f"not downloaded ({md.flat(exc, 160)})") from None
    digest = str(artifact.get("digest") or "")
    if digest.startswith("sha256:") and hashlib.sha256(blob).hexdigest() != digest[7:]:
        raise Refused("its zip does not have the digest the API lists")
    return blob


def extract(blob: bytes, dest: Path, max_bytes: int | None = None) -> int:
    """Unpack a zip into `dest` (created): plain files and folders only, every path inside it, at
    most `max_bytes` (MAX_TREE_BYTES) in all. Returns the bytes written; Refused (with `dest`
    removed) otherwise."""
    max_bytes = MAX_TREE_BYTES if max_bytes is None else max_bytes
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            infos = archive.infolist()
            if len(infos) > MAX_FILES:
                raise Refused(f"{len(infos)} entries, over the cap of {MAX_FILES}")
            dest.mkdir(parents=True)
            total = 0
            for info in infos:
                name = info.filename
                parts = PurePosixPath(name).parts
                if not parts or name.startswith("/") or "\\" in name or ".." in parts:
                    raise Refused(f"an entry outside its folder ({md.flat(name, 80)})")
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise Refused(f"a symbolic link ({md.flat(name, 80)})")
                target = dest.joinpath(*parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                # The sizes an entry declares are the zip's claims: count what it unpacks to.
                with archive.open(info) as src, target.open("xb") as out:
                    while chunk := src.read(1 << 16):
                        total += len(chunk)
                        if total > max_bytes:
                            raise Refused(f"unpacks to more than {max_bytes} bytes")
                        out.write(chunk)
            return total
    except (zipfile.BadZipFile, OSError, RuntimeError, ValueError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise Refused(f"not a usable zip ({md.flat(exc, 120)})") from None
    except Refused:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def check_approval(artifacts: list[dict], jobs: list[dict]) -> dict:
    """The approval artifact to take, or Refused: exactly one, created when the approve job of the
    run had not yet completed."""
    found = _named(artifacts, APPROVAL)
    if len(found) != 1:
        raise Refused(
            f"the run has {len(found)} artifacts named {APPROVAL}, not one: it was uploaded again "
            "after the approve job (PR code can), or the approve job did not upload it"
        )
    approve = [job for job in jobs if job.get("name") == APPROVE_JOB]
    ended = parse_time(approve[0].get("completed_at")) if len(approve) == 1 else None
    if ended is None:
        raise Refused(f"the run's jobs show no completed {APPROVE_JOB!r} job to date the approval")
    created = parse_time(found[0].get("created_at"))
    if created is None or created > ended:
        raise Refused(
            f"{APPROVAL} was created at {md.flat(found[0].get('created_at'), 40)}, after the "
            f"approve job ended ({approve[0].get('completed_at')}): PR code replaced it"
        )
    return found[0]


def fetch_run(gh: Any, run_id: str, out: Path) -> Fetched:
    """The run's approval and legs into `out` (see the module's docstring). Refused when the
    approval is not taken: nothing is posted from such a run."""
    artifacts = gh.run_artifacts(run_id)
    artifact = check_approval(artifacts, gh.run_jobs(run_id))
    folder = out / APPROVAL
    extract(_download(gh, artifact, MAX_APPROVAL_BYTES), folder, MAX_APPROVAL_BYTES)
    path = folder / APPROVAL_FILE
    try:
        approval = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        approval = None
    if not isinstance(approval, dict):
        raise Refused(f"{APPROVAL} holds no readable {APPROVAL_FILE}")
    if str(approval.get("run_id")) != str(run_id):
        raise Refused(
            f"{APPROVAL} names run {md.flat(approval.get('run_id'), 30)}, not this run {run_id}"
        )
    legs_dir = out / "legs"
    legs_dir.mkdir(parents=True, exist_ok=True)
    taken, notes = [], []
    for kind in gpukinds.KINDS:
        name = gpukinds.artifact_name(kind)
        found = _named(artifacts, name)
        try:
            if len(found) > 1:
                raise Refused(f"{len(found)} artifacts of that name (one was uploaded again)")
            if found:
                extract(_download(gh, found[0], MAX_ZIP_BYTES), legs_dir / name)
                taken.append(name)
        except Refused as exc:
            notes.append(f"{name} refused, not read: {exc}")
    (legs_dir / FETCH_NOTES).write_text("".join(f"{n}\n" for n in notes), encoding="utf-8")
    return Fetched(approval, taken, notes)
