"""Change-aware selection on pull requests (flashmoe_science.pipeline.ci.selection): a change to a
kernel, build, gate or test file runs the full matrix; a change elsewhere only (the report, say)
reuses the verdict main recorded for the same key on the bench-history branch, and the report
says so and links main's run; a missing or mismatched key runs the full matrix.

Each test builds a small repository of its own (a kernel, a report module, a gate test): main, a
pull request on top, and main's history branch as a pull request's checkout holds it
(origin/bench-history), written with the package's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gitrepo import commit, git

from flashmoe_science.pipeline import exitcodes, report
from flashmoe_science.pipeline.ci import gpuci, historybranch, selection
from flashmoe_science.pipeline.gates import plugin as gate_plugin
from flashmoe_science.pipeline.paths import REPO_ROOT
from flashmoe_science.pipeline.report.sections import ICONS, NOTE

BUILD = ("torch2.14.1-cu13.0-sm90a", "13.0")  # the kernel build's key and nvcc, as a runner makes
KIND = "h200"
RUN = "gpu-41-1-h200"
RUN_URL = "https://github.com/o/flashmoe-science/actions/runs/41"
FILES = {
    "csrc/flash_fwd.cu": "// the forward kernel\nint tile = 64;\n",
    "flashmoe_science/pipeline/report/render.py": "TITLE = 'report'\n",
    "tests/gates/test_gates.py": "def test_gate():\n    pass\n",
    "README.md": "# flashmoe-science\n",
}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture
def repo(tmp_path) -> Path:
    """main (origin/main) with FILES, and a pull request branch checked out on top of it."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    write(root, FILES)
    main = commit(root, "main")
    git(root, "update-ref", "refs/remotes/origin/main", main)
    git(root, "checkout", "-q", "-b", "pr")
    return root


def main_verdict(sha: str, key: str, **changes) -> dict:
    """What bench-history.yml stores of a leg of main's passing run (selection.verdict_record)."""
    gates = {"selected": 1914, "ran": 1914, "passed": 1914, "failed": 0, "skipped": 0}
    tests = {"selected": 2900, "passed": 2890, "failed": 0, "errors": 0, "skipped": 10}
    doc = {
        "schema": selection.VERDICT_SCHEMA,
        "key": key,
        "kind": KIND,
        "sha": sha,
        "run_id": RUN,
        "run_url": RUN_URL,
        "timestamp": "2026-12-01T03:17:00Z",
        "outcome": "passed",
        "gates": gates,
        "tests": tests,
        "worst_max_diff": 0.0039,
        "worst_case": "fwd-bf16-d128-s512-causal",
        "worst_ratio": 1.4,
    }
    return {**doc, **changes}


def record_mains_verdict(root: Path, tmp_path: Path, doc: dict, kind: str = KIND) -> None:
    """Main's verdict on a bench-history branch (the package's writer, as the history job pushes
    it), fetched into the pull request's checkout as origin/bench-history."""
    remote = tmp_path / "remote.git"
    if not remote.exists():
        git(tmp_path, "init", "-q", "--bare", str(remote))
    scratch = tmp_path / f"scratch-{len(list(tmp_path.glob('scratch-*')))}"
    scratch.mkdir()
    historybranch.Branch(scratch, str(remote)).store_verdict(doc, kind)
    git(
        root,
        "fetch",
        "-q",
        str(remote),
        f"+{historybranch.BRANCH}:refs/remotes/origin/bench-history",
    )


def mains_key(root: Path, build=BUILD) -> str:
    return selection.verdict_key(*build, selection.gate_inputs_digest(root, "origin/main"))


def run_select(root: Path, **options) -> dict:
    args = dict(base="origin/main", pull_request=True, full=False, kind=KIND, build=BUILD)
    return selection.select(**{**args, **options}, tree=root)


def reports_dir() -> Path:
    from flashmoe_science.pipeline.paths import report_dir

    return report_dir()


# ---- which paths are gate inputs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "gate_input"),
    [
        ("csrc/flash_fwd.cu", True),
        ("csrc/new_kernel.cuh", True),
        ("flashmoe_science/_loader.py", True),
        ("flashmoe_science/pipeline/build/unit.py", True),
        ("flashmoe_science/pipeline/gates/forward.py", True),
        ("flashmoe_science/pipeline/ci/selection.py", True),  # the decision itself
        ("flashmoe_science/ops.py", True),
        ("tests/gates/test_gates.py", True),
        ("tests/conftest.py", True),
        ("pyproject.toml", True),
        ("a_folder_nobody_listed/x.py", True),  # unknown: the full matrix, never a guess
        ("flashmoe_science/pipeline/report/render.py", False),
        ("flashmoe_science/pipeline/ci/gpuci.py", False),
        ("tests/report/test_report.py", False),
        ("tests/fixtures/report/passing/gates.json", False),
        (".github/workflows/gpu-ci.yml", False),
        ("README.md", False),
    ],
)
def test_a_gate_input_is_anything_but_the_report_ci_and_docs(path, gate_input):
    assert selection.is_gate_input(path) is gate_input


def test_the_decision_from_the_changed_paths_alone():
    report_only = ["flashmoe_science/pipeline/report/render.py", "tests/report/test_report.py"]
    assert selection.decide(report_only).mode == selection.REUSE
    with_kernel = [*report_only, "csrc/flash_fwd.cu"]
    decision = selection.decide(with_kernel)
    assert decision.mode == selection.FULL and decision.gate_inputs == ["csrc/flash_fwd.cu"]
    assert "csrc/flash_fwd.cu" in decision.reason
    assert selection.decide(report_only, full=True).mode == selection.FULL
    assert selection.decide(report_only, pull_request=False).mode == selection.FULL
    assert selection.decide(None).mode == selection.FULL, "no base: nothing to compare with"


# ---- a pull request's leg -----------------------------------------------------------------------


def test_a_one_line_csrc_change_runs_the_full_matrix(repo, tmp_path):
    """Even with main's verdict for the base recorded: a kernel changed, so nothing is reused."""
    base = git(repo, "rev-parse", "origin/main").stdout.strip()
    record_mains_verdict(repo, tmp_path, main_verdict(base, mains_key(repo)))
    write(repo, {"csrc/flash_fwd.cu": "// the forward kernel\nint tile = 128;\n"})
    commit(repo, "a bigger tile")
    doc = run_select(repo)
    assert doc["mode"] == selection.FULL and doc["main"] is None
    assert doc["gate_inputs"] == ["csrc/flash_fwd.cu"]
    assert "gate inputs changed: csrc/flash_fwd.cu" in doc["reason"]
    assert doc["key"] != mains_key(repo), "the key follows the kernel's bytes"
    assert not (reports_dir() / gate_plugin.RECORD).exists(), "the test stage writes the gates"


def test_a_kernel_moved_into_docs_is_a_change_to_csrc(repo):
    """git reads a move as a rename; the path it left counts as changed, not only the new one."""
    (repo / "docs").mkdir()
    git(repo, "mv", "csrc/flash_fwd.cu", "docs/flash_fwd.cu")
    commit(repo, "move the forward kernel out of the unit")
    changed = selection.changed_paths("origin/main", repo)
    assert changed == ["csrc/flash_fwd.cu", "docs/flash_fwd.cu"]
    assert selection.decide(changed).mode == selection.FULL


def test_a_report_only_change_reuses_mains_verdict_and_the_report_says_so(
    repo, tmp_path, monkeypatch
):
    monkeypatch.setenv("FLASHMOE_RUN_ID", "gpu-77-1-h200")
    base = git(repo, "rev-parse", "origin/main").stdout.strip()
    record_mains_verdict(repo, tmp_path, main_verdict(base, mains_key(repo)))
    write(repo, {"flashmoe_science/pipeline/report/render.py": "TITLE = 'the report'\n"})
    head = commit(repo, "a better title")
    doc = run_select(repo)
    assert doc["mode"] == selection.REUSE, doc["reason"]
    assert doc["key"] == mains_key(repo) and doc["main"]["sha"] == base
    assert doc["changed"] == ["flashmoe_science/pipeline/report/render.py"]
    gates = json.loads((reports_dir() / gate_plugin.RECORD).read_text())
    assert gates["outcome"] == "passed" and gates["gates"]["ran"] == 1914
    assert (gates["worst_max_diff"], gates["worst_case"], gates["worst_ratio"]) == (
        0.0039,
        "fwd-bf16-d128-s512-causal",
        1.4,
    ), "main's worst figures travel with its verdict"
    assert gates["reused"] == {
        "sha": base,
        "run_id": RUN,
        "run_url": RUN_URL,
        "key": doc["key"],
        "timestamp": "2026-12-01T03:17:00Z",
    }
    assert gates["provenance"]["commit"]["sha"] == head, "this run's record, of this commit"
    code = report.main(["--dir", str(reports_dir()), "--tested-sha", head, "--no-step-summary"])
    text = (reports_dir() / "report.md").read_text()
    assert code == exitcodes.OK, text
    first = text.splitlines()[0]
    assert (
        first.startswith("## ✅ flashmoe-science: passed")
        and "gates reused from main's run" in first
    )
    link = f"[main's run]({RUN_URL}) at `{base[:12]}`"
    assert f"| {ICONS[NOTE]} | select | main's verdict reused ({link}) |" in text
    assert "1,914 of 1,914 gates passed" in text and f"the verdict of {link}" in text
    assert "| ⏭️ | build | not run: main's verdict reused |" in text, "not needed, and said"
    assert "| ⏭️ | env | not run |" in text, "the env stage runs in every leg: here it did not"


@pytest.mark.parametrize(
    "stored",
    ["another-build", "another-kind", "nothing", "not-a-pass", "key-of-another-file"],
)
def test_a_missing_or_mismatched_key_runs_the_full_matrix(repo, tmp_path, stored):
    base = git(repo, "rev-parse", "origin/main").stdout.strip()
    key = mains_key(repo)
    if stored == "another-build":  # main's verdict was reached with another torch
        record_mains_verdict(
            repo, tmp_path, main_verdict(base, mains_key(repo, ("torch2.13", "13.0")))
        )
    elif stored == "another-kind":
        record_mains_verdict(repo, tmp_path, {**main_verdict(base, key), "kind": "h100"}, "h100")
    elif stored == "not-a-pass":
        record_mains_verdict(repo, tmp_path, main_verdict(base, key, outcome="failed"))
    elif stored == "key-of-another-file":
        doc = main_verdict(base, key)
        record_mains_verdict(repo, tmp_path, doc)
        # the file of this key holds another key's verdict
        remote = tmp_path / "remote.git"
        scratch = tmp_path / "scratch-x"
        scratch.mkdir()
        branch = historybranch.Branch(scratch, str(remote))
        forged = {**doc, "key": "torch0-other"}
        branch._push({f"verdicts/{KIND}/{key}.json": json.dumps(forged).encode()}, None, "x", None)
        git(repo, "fetch", "-q", str(remote), "+bench-history:refs/remotes/origin/bench-history")
    write(repo, {"README.md": "# flashmoe-science, documented\n"})
    commit(repo, "docs")
    doc = run_select(repo)
    assert doc["mode"] == selection.FULL and doc["main"] is None, doc
    assert doc["reason"].startswith("no gate input changed"), "it would have reused"
    assert ", but " in doc["reason"]
    assert not (reports_dir() / gate_plugin.RECORD).exists()


def test_full_a_push_or_uncommitted_changes_never_reuse(repo, tmp_path):
    base = git(repo, "rev-parse", "origin/main").stdout.strip()
    record_mains_verdict(repo, tmp_path, main_verdict(base, mains_key(repo)))
    write(repo, {"README.md": "# docs\n"})
    commit(repo, "docs")
    assert run_select(repo)["mode"] == selection.REUSE
    assert run_select(repo, full=True)["mode"] == selection.FULL
    assert run_select(repo, pull_request=False)["mode"] == selection.FULL
    assert run_select(repo, base=None)["mode"] == selection.FULL
    write(repo, {"csrc/flash_fwd.cu": "// edited, not committed\n"})
    assert run_select(repo)["mode"] == selection.FULL, "the key names committed files only"


def test_the_trusted_report_refuses_a_reuse_the_prs_changes_do_not_allow(repo, tmp_path):
    """The pull request's own code decided to reuse; the default branch's report code, given the
    changed paths from the API, decides again and fails the leg when a gate input changed."""
    base = git(repo, "rev-parse", "origin/main").stdout.strip()
    record_mains_verdict(repo, tmp_path, main_verdict(base, mains_key(repo)))
    write(repo, {"README.md": "# docs\n"})
    head = commit(repo, "docs")
    assert run_select(repo)["mode"] == selection.REUSE
    changed = tmp_path / "changed.txt"
    changed.write_text("README.md\ncsrc/flash_fwd.cu\n")  # what the API says the PR changes
    args = ["--dir", str(reports_dir()), "--tested-sha", head, "--no-step-summary"]
    report.main([*args, "--changed-files", str(changed)])
    text = (reports_dir() / "report.md").read_text()
    assert text.startswith("## ❌ flashmoe-science: main's verdict reused although the PR changes")
    changed.write_text("README.md\n")
    report.main([*args, "--changed-files", str(changed)])
    assert (reports_dir() / "report.md").read_text().startswith("## ✅")


# ---- main's side: only a push to main's passing run stores a verdict ----------------------------


def leg_records(sha: str, mode: str = selection.FULL, run: str = RUN) -> tuple[dict, dict]:
    block = {"commit": {"sha": sha, "dirty": False, "fingerprint": None}, "run_id": run}
    sel = {"schema": selection.SCHEMA, "provenance": block, "mode": mode, "key": "torch2-k"}
    gates = {
        "schema": gate_plugin.SCHEMA,
        "provenance": block,
        "timestamp": "2026-12-01T03:30:00Z",
        "outcome": "passed",
        "gates": {"selected": 5, "ran": 5, "passed": 5, "failed": 0, "skipped": 0},
        "tests": {"selected": 9, "passed": 9, "failed": 0, "errors": 0, "skipped": 0},
    }
    return sel, gates


def test_the_history_job_stores_a_legs_verdict_and_a_pr_reads_it_back(repo, tmp_path):
    sha = "a" * 40
    sel, gates = leg_records(sha)
    reports = tmp_path / "artifacts"
    leg = reports / "gpu-ci-reports-h200"
    leg.mkdir(parents=True)
    (leg / "selection.json").write_text(json.dumps(sel))
    (leg / "gates.json").write_text(json.dumps(gates))
    remote = tmp_path / "history.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    (tmp_path / "w").mkdir()
    branch = historybranch.Branch(tmp_path / "w", str(remote))
    code = gpuci.verdict_of_leg(branch, KIND, reports, sha, RUN, RUN_URL)
    assert code == 0
    git(repo, "fetch", "-q", str(remote), "+bench-history:refs/remotes/origin/bench-history")
    doc, why = selection.read_verdict(repo, selection.HISTORY_REF, KIND, "torch2-k")
    assert why == "" and doc["sha"] == sha and doc["run_url"] == RUN_URL
    assert doc["gates"]["ran"] == 5 and doc["outcome"] == "passed"


@pytest.mark.parametrize(
    ("records", "said"),
    [
        (leg_records("b" * 40), "another commit"),
        (leg_records("a" * 40, run="gpu-40-1-h200"), "another run"),
        (leg_records("a" * 40, mode=selection.REUSE), "reused a verdict itself"),
    ],
    ids=["other-commit", "other-run", "reused"],
)
def test_a_verdict_of_another_commit_run_or_a_reused_one_is_never_stored(records, said):
    with pytest.raises(ValueError, match=said):
        selection.verdict_record(*records, sha="a" * 40, run_id=RUN, run_url=RUN_URL, kind=KIND)


def test_the_command_writes_its_decision_for_the_workflow(repo, tmp_path, monkeypatch):
    output = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(output))
    monkeypatch.chdir(repo)
    monkeypatch.setattr(selection, "REPO_ROOT", repo)
    args = ["--base", "origin/main", "--pull-request", "--kind", KIND, "--build-key", "k:13.0"]
    assert selection.main(args) == exitcodes.OK
    assert output.read_text() == "mode=full\n"  # no origin/bench-history here
    assert selection.main(["--kind", "a100"]) == exitcodes.USAGE


def test_no_code_that_makes_the_decision_is_neutral():
    """The `select` step runs the pull request's own code: were a module it imports (or a package
    above one) neutral, a pull request could change how it decides and still be offered main's
    verdict."""
    from importgraph import import_graph, imported_by

    graph = import_graph(REPO_ROOT)
    run = set()
    for start in ("flashmoe_science.__main__", "flashmoe_science.pipeline.cli", selection.__name__):
        run |= imported_by(graph, start)
    run |= {".".join(m.split(".")[:i]) for m in run for i in range(1, m.count(".") + 1)}
    paths = []
    for module in sorted(run):
        as_path = REPO_ROOT / Path(*module.split("."))
        path = as_path / "__init__.py" if as_path.is_dir() else as_path.with_suffix(".py")
        paths.append(path.relative_to(REPO_ROOT).as_posix())
    assert "flashmoe_science/pipeline/ci/__init__.py" in paths  # the closure reaches the packages
    assert [p for p in paths if not selection.is_gate_input(p)] == []
