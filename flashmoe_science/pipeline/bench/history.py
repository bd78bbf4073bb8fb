"""Stored benchmark results: the fallback reference when the base cannot be timed side by side.

Every full default-matrix run of a clean tree appends its raw samples to
<build root>/bench-history/<gpu-model>.json (the last HISTORY_KEEP runs; --history DIR or
FLASHMOE_BENCH_HISTORY moves it; CI can cache that folder). The stored run used for a base is the
base's own, else the newest one of an ancestor of the base.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .. import paths
from . import stats
from .machine import machine_slug
from .records import BenchRecord, CaseVerdict, Gpu, Measured, MissingVerdict

HISTORY_SCHEMA = "flashmoe-science/bench-history/1"
HISTORY_KEEP = 20


def history_dir(override: str | None = None) -> Path:
    return Path(
        override or os.environ.get("FLASHMOE_BENCH_HISTORY") or paths.build_root() / "bench-history"
    )


def history_path(directory: Path, gpu: Gpu | None) -> Path:
    return directory / f"{machine_slug(gpu.name if gpu else None)}.json"


def load_history(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError):
        return []


def record_history(record: BenchRecord, directory: Path) -> Path:
    """Append this run's raw samples to the GPU model's history (atomically; keeps HISTORY_KEEP)."""
    path = history_path(directory, record.gpu)
    entry = {
        "commit": record.commit.sha,
        "timestamp": record.timestamp,
        "torch": record.torch,
        "cuda": record.cuda,
        "samples_ms": {
            c.id: c.ours.samples_ms for c in record.cases if isinstance(c.ours, Measured)
        },
    }
    entries = [*load_history(path), entry][-HISTORY_KEEP:]
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as tmp:
        json.dump({"schema": HISTORY_SCHEMA, "machine": path.stem, "entries": entries}, tmp)
    os.replace(tmp.name, path)
    return path


def is_ancestor(maybe_ancestor: str, sha: str) -> bool:
    done = subprocess.run(
        ["git", "merge-base", "--is-ancestor", maybe_ancestor, sha],
        cwd=paths.REPO_ROOT,
        capture_output=True,
    )
    return done.returncode == 0


def stored_reference(
    entries: Sequence[dict], base_sha: str, is_ancestor=is_ancestor
) -> dict | None:
    """The stored run of base_sha itself, else the newest one on an ancestor of base_sha."""
    for entry in reversed(entries):
        if entry.get("commit") == base_sha:
            return entry
    for entry in reversed(entries):
        if entry.get("commit") and is_ancestor(entry["commit"], base_sha):
            return entry
    return None


def compare_with_stored(
    entry: dict, record: BenchRecord, threshold: float, alpha: float
) -> list[CaseVerdict | MissingVerdict]:
    results = []
    for case in record.cases:
        base = entry["samples_ms"].get(case.id)
        if not base or not isinstance(case.ours, Measured):
            reason = "not in the stored run" if not base else case.ours.reason
            results.append(MissingVerdict(case.id, reason))
            continue
        verdict = stats.decide(base, case.ours.samples_ms, threshold, alpha)
        results.append(CaseVerdict.of(case.id, verdict))
    return results
