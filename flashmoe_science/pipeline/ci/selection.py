"""Change-aware selection: whether a GPU CI leg runs the full matrix or reuses main's verdict.

A pull request that changes no gate input (every path but those NEUTRAL lists: the report, the
trusted CI steps, docs, the runners' setup, and their tests) does not rebuild or rerun the CUDA
gates. Its leg reuses the verdict main recorded for the same key, and the report says so and
links main's run. Everything else runs the full matrix (build, test, bench):

    a gate input changed     csrc/, the loader, the build, the gates, the library, tests/, the
                             package's shared modules, pyproject.toml, ... (the changed paths
                             against the base, as `git diff BASE...HEAD` lists them)
    --full                   asked for (workflow_dispatch's `full`)
    not a pull request       a push to main records its own verdict; a scheduled or manual run
    no base, a dirty tree    nothing to compare with, or code that is not the commit's
    no verdict for the key   main never passed with these very inputs on this kind of card

The key names what a verdict is about: the kernel build's key (torch, CUDA, architectures, defines:
_loader.build_key), nvcc's release, and a digest of the commit's gate inputs (git's blob ids), so
a verdict is reused only for the same files built the same way.

Where main's verdicts live: the bench-history branch, verdicts/KIND/KEY.json
(historybranch.Branch.store_verdict), written only by bench-history.yml after a push to main whose
GPU CI run passed, from that run's selection.json and gates.json (verdict_record). A pull
request's run only reads the branch (the checkout's origin/bench-history): no run ever reads what
a pull request's run wrote. The branch has no protection (bench-history.yml pushes to it), so
whoever can push to the repository can write a verdict there too (scripts/runner/SETTINGS.md,
item 10).

`python -m flashmoe_science select` writes reports/selection.json ("flashmoe-science/selection/1":
mode, reason, base, changed and gate_inputs (the changed paths, the gate inputs among them), key,
kind, and main: the verdict reused) and, when it reuses, reports/gates.json with main's counts and
a `reused` block. It writes mode=full or mode=reuse to $GITHUB_OUTPUT. Exit 0 whatever it decides
(an error on the way is a full run, said), 2 for wrong arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import exitcodes, gpukinds
from .. import markdown as md
from ..paths import REPO_ROOT, report_dir, require_gpu_from_env
from ..provenance import clear_outputs, commit, provenance
from .historybranch import BRANCH, VERDICTS_DIR

SCHEMA = "flashmoe-science/selection/1"
VERDICT_SCHEMA = "flashmoe-science/verdict/1"
RECORD = "selection.json"
FULL, REUSE = "full", "reuse"
HISTORY_REF = f"origin/{BRANCH}"  # the checkout's copy of main's history branch
MAX_LISTED = 200  # changed paths kept in selection.json
MAX_VERDICT_BYTES = 1 << 20

# The paths whose change cannot change a CUDA gate's verdict on the GPU runner. Anything else is a
# gate input: a new folder, a shared module, a test of the kernels all run the full matrix. A
# folder ends with "/". The tests listed here run on every pull request's CPU CI.
NEUTRAL = (
    # the report and the trusted CI steps: they render and judge the records, no gate runs them
    "flashmoe_science/pipeline/report/",
    "flashmoe_science/pipeline/ci/gpuci.py",
    "flashmoe_science/pipeline/ci/runner_requirements.py",
    "requirements/report.txt",
    # their tests (tests/ci/ holds the trusted steps' and the workflows', tests/report/ the report's)
    "tests/fixtures/report/",
    "tests/report/",
    "tests/ci/",
    "tests/actjobs.py",
    # the workflows (a pull request's GPU job runs main's), the runners' setup, act, documentation
    ".github/",
    "scripts/runner/",
    "scripts/act/",
    "docs/",
    "README.md",
    "benches/NOTES.md",
    "benches/notes/",
)


def is_gate_input(path: str) -> bool:
    """Whether a change to `path` can change a CUDA gate's verdict (see NEUTRAL)."""
    return not any(
        path.startswith(neutral) if neutral.endswith("/") else path == neutral
        for neutral in NEUTRAL
    )


@dataclasses.dataclass
class Decision:
    mode: str  # FULL, or REUSE when main's verdict for the key may stand in (if there is one)
    reason: str  # one line
    gate_inputs: list[str] = dataclasses.field(default_factory=list)  # changed gate inputs


def decide(changed: Sequence[str] | None, *, full: bool = False, pull_request: bool = True):
    """FULL or REUSE from the changed paths alone (None: no base to diff against)."""
    if full:
        return Decision(FULL, "the full matrix was asked for (--full)")
    if not pull_request:
        return Decision(FULL, "not a pull request: main's runs record their own verdict")
    if changed is None:
        return Decision(FULL, "no base to compare with")
    inputs = [path for path in changed if is_gate_input(path)]
    if inputs:
        return Decision(FULL, f"gate inputs changed: {md.first(inputs, 3)}", inputs)
    return Decision(
        REUSE,
        f"no gate input changed ({md.plural(len(changed), 'changed path')}, none a kernel, "
        "build, gate or test file)",
    )


def _git(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=tree, capture_output=True, timeout=120, check=False)


def changed_paths(base: str | None, tree: Path = REPO_ROOT) -> list[str] | None:
    """The paths HEAD changes since its merge base with `base`; None without a usable base."""
    if not base or _git(tree, "rev-parse", "--quiet", "--verify", f"{base}^{{commit}}").returncode:
        return None
    # --no-renames: a file moved out of csrc/ is a change to csrc/, not only to where it landed
    diff = _git(tree, "diff", "--no-renames", "--name-only", "-z", f"{base}...HEAD")
    if diff.returncode:
        return None
    return sorted(name for name in diff.stdout.decode(errors="replace").split("\0") if name)


def gate_inputs_digest(tree: Path = REPO_ROOT, rev: str = "HEAD") -> str | None:
    """A digest of the gate inputs of `rev` (each path with git's blob id); None outside git."""
    listed = _git(tree, "ls-tree", "-r", "-z", "--full-tree", rev)
    if listed.returncode:
        return None
    digest = hashlib.sha256()
    for entry in sorted(filter(None, listed.stdout.decode(errors="replace").split("\0"))):
        meta, _, path = entry.partition("\t")
        if is_gate_input(path):
            digest.update(f"{path}\0{meta.split()[-1]}\0".encode())
    return digest.hexdigest()[:16]


def verdict_key(build_key: str, nvcc: str | None, digest: str) -> str:
    """'torch2.14.1-cu13.0-sm90a-nvcc13.0-g0123456789abcdef'."""
    return f"{build_key}-nvcc{nvcc or 'none'}-g{digest}"


_KEY = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def cuda_build() -> tuple[str, str | None]:
    """(the build key, nvcc's release) of the build this machine's test stage makes."""
    from ..build import unit

    config = unit.resolve_config(backend="cuda" if require_gpu_from_env() else "auto")
    return config.key, config.toolkit.version if config.backend == "cuda" else None


def read_verdict(tree: Path, ref: str, kind: str, key: str) -> tuple[dict | None, str]:
    """Main's verdict for `key` on `kind` from the history branch at `ref`, or (None, why not)."""
    if not _KEY.match(key):
        return None, f"the key {key!r} is not one the history branch names a file by"
    if _git(tree, "rev-parse", "--quiet", "--verify", f"{ref}^{{commit}}").returncode:
        return None, f"no {ref} in this checkout (main's verdicts are read from it)"
    spec = f"{ref}:{VERDICTS_DIR}/{kind}/{key}.json"
    size = _git(tree, "cat-file", "-s", spec)
    if size.returncode:
        return None, f"main recorded no verdict for this key on {kind}"
    if int(size.stdout or 0) > MAX_VERDICT_BYTES:
        return None, f"main's verdict for this key is over {MAX_VERDICT_BYTES} bytes: not read"
    try:
        doc = json.loads(_git(tree, "cat-file", "blob", spec).stdout)
    except ValueError:
        return None, "main's verdict for this key is not JSON"
    why = verdict_problem(doc, kind, key)
    return (None, why) if why else (doc, "")


def verdict_problem(doc: object, kind: str, key: str) -> str | None:
    """Why a stored verdict cannot stand in for this run; None when it can."""
    if not isinstance(doc, dict) or doc.get("schema") != VERDICT_SCHEMA:
        return f"main's verdict is not a {VERDICT_SCHEMA} record"
    if doc.get("key") != key or doc.get("kind") != kind:
        return "main's verdict names another key or kind than its file"
    if doc.get("outcome") != "passed":
        return "main's verdict for this key is not a pass"
    if not re.fullmatch(r"[0-9a-f]{40}", str(doc.get("sha"))):
        return "main's verdict names no commit"
    if not str(doc.get("run_url") or "").startswith("https://"):
        return "main's verdict links no run"
    for block in ("gates", "tests"):
        counts = doc.get(block)
        if not isinstance(counts, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()
        ):
            return f"main's verdict has no {block} counts"
    if not doc["gates"].get("ran"):
        return "main's verdict ran no gate"
    return None


def verdict_record(
    selection: dict, gates: dict, *, sha: str, run_id: str, run_url: str, kind: str
) -> dict:
    """What the history branch keeps of one leg of main's passing run (the leg's selection.json
    and gates.json), or ValueError: nothing measured on another commit or in another run, and
    never a verdict that was itself reused."""
    for name, doc in ((RECORD, selection), ("gates.json", gates)):
        block = (doc or {}).get("provenance") or {}
        written = block.get("commit") or {}
        if written.get("sha") != sha or written.get("dirty"):
            raise ValueError(f"{name} describes another commit than the pushed {sha[:12]}")
        if block.get("run_id") != run_id:
            raise ValueError(f"{name} was written by another run than {run_id}")
    if selection.get("mode") != FULL or gates.get("reused"):
        raise ValueError("this leg reused a verdict itself: nothing new to store")
    key = selection.get("key")
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError("selection.json names no key (a tree without git, or no CUDA build)")
    doc = {
        "schema": VERDICT_SCHEMA,
        "key": key,
        "kind": gpukinds.kind_of(kind).label,
        "sha": sha,
        "run_id": run_id,
        "run_url": run_url,
        "timestamp": gates.get("timestamp"),
        "outcome": gates.get("outcome"),
        "gates": gates.get("gates"),
        "tests": gates.get("tests"),
        "worst_max_diff": gates.get("worst_max_diff"),
        "worst_case": gates.get("worst_case"),
        "worst_ratio": gates.get("worst_ratio"),
    }
    why = verdict_problem(doc, doc["kind"], key)
    if why:
        raise ValueError(why.replace("main's verdict", "this leg's verdict"))
    return doc


# --------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------


def select(
    *,
    base: str | None,
    pull_request: bool,
    full: bool,
    kind: str | None,
    build: tuple[str, str | None] | None,
    tree: Path | None = None,
    ref: str = HISTORY_REF,
) -> dict:
    """Decide, write selection.json (and, when reusing, gates.json) and return selection.json.
    `tree`: the checkout (default: this one)."""
    from ..gates import plugin as gate_plugin

    tree = tree or REPO_ROOT
    clear_outputs(RECORD)
    changed = changed_paths(base, tree)
    decision = decide(changed, full=full, pull_request=pull_request)
    key = None
    digest = gate_inputs_digest(tree)
    if digest and build and not commit(tree).get("dirty"):
        key = verdict_key(build[0], build[1], digest)
    main_verdict = None
    if decision.mode == REUSE:
        why = None
        if kind is None:
            why = f"no GPU kind (${gpukinds.KIND_VAR}) to read main's verdict of"
        elif key is None:
            why = "no key: uncommitted changes, no git, or no CUDA build to name"
        else:
            main_verdict, why = read_verdict(tree, ref, kind, key)
        if main_verdict is None:
            decision = Decision(FULL, f"{decision.reason}, but {why}")
    doc = {
        "schema": SCHEMA,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "provenance": provenance(tree),
        "mode": decision.mode,
        "reason": decision.reason,
        "base": base or None,
        "changed": None if changed is None else changed[:MAX_LISTED],
        "gate_inputs": decision.gate_inputs[:MAX_LISTED],
        "key": key,
        "kind": kind,
        "main": main_verdict,
    }
    if main_verdict is not None:
        clear_outputs(gate_plugin.RECORD)
        gate_plugin.write_record(
            outcome=gate_plugin.PASSED,
            pytest_exit=0,
            selected=gate_plugin.selection(None, None, False, []),
            gates=main_verdict["gates"],
            tests=main_verdict["tests"],
            reused={
                name: main_verdict.get(name)
                for name in ("sha", "run_id", "run_url", "key", "timestamp")
            },
            worst=main_verdict,
            tree=tree,
        )
    path = report_dir() / RECORD
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science select",
        description="Decide whether this GPU CI leg runs the full matrix or reuses the verdict "
        "main recorded for the same key (no gate input changed).",
        epilog="Writes reports/selection.json (and gates.json when it reuses), and mode=full or "
        "mode=reuse to $GITHUB_OUTPUT. Exit 0 whatever it decides.",
        allow_abbrev=False,
    )
    parser.add_argument("--base", default="", help="what to diff against (empty: no base)")
    parser.add_argument(
        "--pull-request",
        action="store_true",
        help="this run tests a pull request (only those may reuse main's verdict)",
    )
    parser.add_argument("--full", action="store_true", help="run the full matrix whatever changed")
    parser.add_argument(
        "--kind",
        default=os.environ.get(gpukinds.KIND_VAR) or None,
        help=f"the GPU kind of this leg (default: ${gpukinds.KIND_VAR})",
    )
    parser.add_argument(
        "--history-ref",
        default=HISTORY_REF,
        help=f"where main's verdicts are read from (default: {HISTORY_REF})",
    )
    parser.add_argument(
        "--build-key",
        default=None,
        metavar="KEY[:NVCC]",
        help="the kernel build's key and nvcc release (default: the build this machine makes)",
    )
    return parser


def write_outputs(values: Mapping[str, str]) -> None:
    path = os.environ.get("GITHUB_OUTPUT")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write("".join(f"{k}={v}\n" for k, v in values.items()))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    if args.kind is not None:
        try:
            args.kind = gpukinds.kind_of(args.kind).label
        except ValueError as exc:
            print(f"select: {exc}", file=sys.stderr)
            return exitcodes.USAGE
    build = None
    if args.build_key:
        key, _, nvcc = args.build_key.partition(":")
        build = (key, nvcc or None)
    else:
        try:
            build = cuda_build()
        except Exception as exc:  # no CUDA build to name: no reuse, said, never a failed stage
            print(f"select: no build key ({md.flat(exc, 200)}): the full matrix", flush=True)
    doc = select(
        base=args.base or None,
        pull_request=args.pull_request,
        full=args.full,
        kind=args.kind,
        build=build,
        ref=args.history_ref,
    )
    if doc["main"]:
        main = doc["main"]
        print(
            f"select: reuse main's verdict ({main['sha'][:12]}, {main['run_url']}): "
            f"{doc['reason']}; key {doc['key']}"
        )
    else:
        print(f"select: the full matrix: {doc['reason']}")
    write_outputs({"mode": doc["mode"]})
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
