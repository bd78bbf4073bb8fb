"""`python -m flashmoe_science bench`: the case matrix, the timing helper, the report files and the
head-against-base machinery, all on the CPU (no GPU needed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from gitrepo import copy_project, git, reuse_this_build

from flashmoe_science.pipeline import basetree, cases, exitcodes, paths
from flashmoe_science.pipeline.bench import (
    baselines,
    headbase,
    history,
    measure,
    stats,
    targets,
    timing,
)
from flashmoe_science.pipeline.bench import matrix as benchmatrix
from flashmoe_science.pipeline.bench import records as benchrecords
from flashmoe_science.pipeline.bench import run as bench
from flashmoe_science.pipeline.bench import summary as benchmd
from flashmoe_science.pipeline.bench.flex import NOT_ON_CPU
from flashmoe_science.pipeline.build import unit as build
from flashmoe_science.pipeline.paths import REPO_ROOT


def schema_errors(doc: dict) -> list[str]:
    return benchrecords.schema_errors(doc)


def definition_validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for one of the schema's $defs (e.g. a single case record)."""
    schema = benchrecords.schema()
    return jsonschema.Draft202012Validator({"$defs": schema["$defs"], "$ref": f"#/$defs/{name}"})


# --------------------------------------------------------------------------------------------------
# bench.json: typed records, validated when written and when read
# --------------------------------------------------------------------------------------------------

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "report"


def test_every_case_id_of_both_matrices_fits_the_schema():
    """The record is validated only after a whole run: an id the schema refuses (v's head dim in
    it, d192v128) would throw every timing of that run away."""
    pattern = re.compile(benchrecords.schema()["$defs"]["case"]["properties"]["id"]["pattern"])
    ids = [case.id for case in (*benchmatrix.gpu_matrix(), *benchmatrix.cpu_matrix())]
    assert any("v128-" in i for i in ids)
    assert [i for i in ids if not pattern.match(i)] == []


def test_the_schema_rejects_what_it_should():
    schema = benchrecords.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    case = {
        "id": "fwd-fp16-d64-h1-b1-s128-full",
        "kind": "prefill",
        "dtype": "fp16",
        "batch": 1,
        "heads_q": 1,
        "heads_kv": 1,
        "seqlen_q": 128,
        "seqlen_k": 128,
        "head_dim": 64,
        "causal": False,
        "group": "small",
        "flops": 1,
        "bytes": 1,
        "ours": {"status": "error", "reason": "x"},
        "baselines": {},
    }
    validator = definition_validator("case")
    assert list(validator.iter_errors(case)) == []
    for bad in (
        {**case, "dtype": "fp32"},
        {**case, "ours": {"status": "ok"}},
        {**case, "extra": 1},
        {**case, "batch": True},
        {**case, "layout": "sbhd"},
    ):
        assert list(validator.iter_errors(bad)), bad


def test_bench_md_names_the_commit_or_the_files_it_measured():
    """A run from a checkout names its commit; one from a tree outside git names the fingerprint
    of its files (provenance.source_fingerprint), the only thing that identifies that code."""
    record = benchrecords.load(sorted(FIXTURES.glob("*/bench.json"))[0])
    record.commit = benchrecords.Commit("0123456789abcdef", dirty=True)
    assert "commit 0123456789ab (dirty)" in benchmd.render_markdown(record)
    record.commit = None
    record.provenance = {
        **record.provenance,
        "commit": {"sha": None, "dirty": False, "fingerprint": "9b1c2d3e4f5a6b7c"},
    }
    assert "commit none (not a git checkout; files 9b1c2d3e4f5a6b7c)" in benchmd.render_markdown(
        record
    )
    record.provenance = {
        **record.provenance,
        "commit": {"sha": None, "dirty": False, "fingerprint": None},
    }
    assert "commit none (not a git checkout)" in benchmd.render_markdown(record)


def test_a_variant_build_is_named_in_bench_json_and_bench_md():
    record = benchrecords.load(sorted(FIXTURES.glob("*/bench.json"))[0])
    record.defines = ["FLASHMOE_EXP2_EMU=3"]
    assert schema_errors(benchrecords.to_json(record)) == []
    assert "**not the default build**: -DFLASHMOE_EXP2_EMU=3." in benchmd.render_markdown(record)
    record.defines = None
    assert "not the default build" not in benchmd.render_markdown(record)
    assert "defines" not in benchrecords.to_json(record)


def test_base_defines_build_and_time_the_base_as_a_variant(monkeypatch, tmp_path, capsys):
    """--base-dir . --base-defines '' times the head's switch against the same tree without it: the
    base's build and worker get exactly those defines, and the record names them."""
    p = bench.parser()
    for argv, message in (
        (["--base-defines", ""], "goes with --base REF or --base-dir DIR"),
        (["--base-dir", ".", "--base-defines", "9BAD"], "--base-defines: bad define"),
    ):
        with pytest.raises(SystemExit):
            bench._check_args(p, p.parse_args(argv))
        assert message in capsys.readouterr().err
    monkeypatch.setenv("FLASHMOE_BUILD_DEFINES", "FLASHMOE_EXP2_EMU=3")
    env = headbase.side_env(tmp_path, tmp_path / "b", tmp_path / "r", "")
    assert env["FLASHMOE_BUILD_DEFINES"] == "" and env["FLASHMOE_BUILD_ROOT"] == str(tmp_path / "b")
    assert (
        headbase.side_env(tmp_path, None, None)["FLASHMOE_BUILD_DEFINES"] == "FLASHMOE_EXP2_EMU=3"
    )

    seen = {}

    def fake_compare(tree, sha, cases, device, args, say=print):
        seen["defines"] = args.base_defines
        return []

    monkeypatch.setattr(headbase, "compare_with_tree", fake_compare)
    args = p.parse_args(["--base-dir", str(tmp_path), "--base-defines", ""])
    comparison = headbase.compare(None, [], "cpu", args, say=lambda _m: None)
    assert seen["defines"] == "" and comparison.base.defines == []
    assert "built with no extra defines" in benchmd.render_comparison(comparison)[0]
    args = p.parse_args(["--base-dir", str(tmp_path), "--base-defines", "FLASHMOE_EXP2_EMU=3"])
    assert headbase.compare(None, [], "cpu", args, say=lambda _m: None).base.defines is None


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*/bench.json")), ids=lambda p: p.parent.name)
def test_report_fixtures_load_as_records(path):
    record = benchrecords.load(path)
    assert record.schema == benchrecords.SCHEMA and record.provenance["run_id"]
    assert benchrecords.to_json(record) == json.loads(path.read_text())  # nothing lost or added
    markdown = benchmd.render_markdown(record)
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    compared = len(record.comparison.cases) + 1 if record.comparison else 0
    speed = [line for line in benchmd.render_targets(record) if line.startswith("| ")]
    assert len(rows) == 1 + len(record.cases) + compared + len(speed)
    assert bool(record.targets) == ("## Speed targets" in markdown and "| varlen-" in markdown)
    if record.gpu:
        assert f"{record.gpu.name} (sm_{record.gpu.capability.replace('.', '')}" in markdown
    else:
        assert "CPU backend (plumbing numbers, not a performance claim)" in markdown


def test_a_cpu_run_under_load_is_not_judged_in_bench_md():
    record = benchrecords.load(FIXTURES / "cpu_passing" / "bench.json")
    markdown = benchmd.render_markdown(record)
    assert (
        "Load: load average 3.4 → 4.0 on 2 CPUs (1 minute, at the start and the end)." in markdown
    )
    assert "**Not judged**: load average 4.0 on 2 CPUs (the 1-minute average" in markdown
    assert "back-to-back calls lasting at least 5 ms" in markdown
    record.load = benchrecords.MachineLoad(cpus=2, before=[0.3, 0.2, 0.1], after=[1.9, 0.7, 0.3])
    markdown = benchmd.render_markdown(record)
    assert "load average 0.3 → 1.9 on 2 CPUs" in markdown and "Not judged" not in markdown


def test_the_run_records_the_load_before_and_after_and_says_when_it_is_not_judged(monkeypatch):
    readings = iter([(3.5, 2.0, 1.0), (4.25, 2.5, 1.5)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(readings))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device, timer, config: {})
    said = []
    config = timing.TimingConfig.for_device("cpu")
    record = bench.run_matrix([], "cpu", config, baselines=False, say=said.append)
    assert record.load == benchrecords.MachineLoad(2, [3.5, 2.0, 1.0], [4.25, 2.5, 1.5])
    assert record.timing.min_sample_ms == timing.MIN_SAMPLE_MS
    assert said[-1] == (
        "bench: load average 4.2 on 2 CPUs: busy cores, so these CPU timings are not judged "
        "(rerun `nox -s bench` alone on an idle machine for judged numbers)"
    )
    assert benchrecords.schema_errors(benchrecords.to_json(record)) == []


def test_cuda_only_baselines_refusing_the_cpu_say_not_available(monkeypatch):
    refusal = "RuntimeError: No viable backend for scaled_dot_product_attention was found."
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(measure, "make_inputs", lambda case, device: None)
    monkeypatch.setattr(measure, "our_call", lambda case, x: _kernel("ours", 0.010))
    monkeypatch.setattr(measure, "sdpa_call", lambda case, x: (None, refusal))
    case = cases.parse_case_id("fwd-fp16-d64-h1-b1-s512-full")
    config = timing.TimingConfig(
        warmup_ms=0, rep_ms=1, min_warmup=0, min_reps=8, max_reps=8, estimate_calls=1
    )
    timer = DisturbedTimer([1.0])
    entry = measure.run_case(case, "cpu", timer, config, {}, baselines=True)
    reasons = {name: result.reason for name, result in entry.baselines.items()}
    assert reasons["sdpa-cudnn"] == reasons["sdpa-efficient"] == benchrecords.NOT_ON_CPU
    assert reasons["sdpa-flash"] == refusal  # a refusal of a kernel the CPU has keeps its reason


def test_load_names_the_file_and_the_problem(tmp_path):
    path = tmp_path / "bench.json"
    with pytest.raises(benchrecords.InvalidBenchFile, match="cannot read"):
        benchrecords.load(path)
    path.write_text("{")
    with pytest.raises(benchrecords.InvalidBenchFile, match="is not JSON"):
        benchrecords.load(path)
    good = json.loads(next(FIXTURES.glob("*/bench.json")).read_text())
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "provenance"}))
    with pytest.raises(benchrecords.InvalidBenchFile, match=r"'provenance' is a required") as err:
        benchrecords.load(path)
    assert str(path) in str(err.value) and "rerun `python -m flashmoe_science bench`" in str(
        err.value
    )


def test_write_refuses_an_invalid_record(tmp_path):
    record = benchrecords.load(next(FIXTURES.glob("*/bench.json")))
    record.backend = "tpu"
    with pytest.raises(benchrecords.InvalidBenchFile, match="backend"):
        benchrecords.write(record, tmp_path / "bench.json")
    assert not (tmp_path / "bench.json").exists()


def test_records_import_without_torch():
    code = (
        "import sys; from flashmoe_science.pipeline.bench import records as benchrecords, targets; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------------------------------
# The real command on the CPU backend
# --------------------------------------------------------------------------------------------------


def bench_env(report_dir: Path) -> dict:
    # The subprocess checks report plumbing, not speed, so it may run beside other xdist workers.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return {**env, "FLASHMOE_REPORTS_DIR": str(report_dir)}


def run_bench(
    args: list[str], cwd: Path, env: dict, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashmoe_science", "bench", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.cpu
def test_quick_run_on_cpu_writes_schema_valid_json_and_a_markdown_table(tmp_path):
    """Long (~18 CPU-s, a tenth of the 2-core test stage: 19 cases and targets, each column timed
    at least 16 times, transformers for the training step), so the scheduled runs have it; every
    pull request still runs `bench --quick` on the CPU end to end for one case from an installed
    wheel (tests/build/test_package.py) and head against base (below), and `.ci/run` runs the
    whole quick matrix after the test stage."""
    # --retakes 0: the plumbing, not the figures (a loaded machine would retake every case twice)
    done = run_bench(
        ["--quick", "--backend", "cpu", "--rep-ms", "20", "--warmup-ms", "1", "--retakes", "0"],
        REPO_ROOT,
        bench_env(tmp_path),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(
        r"^\[1/19\] fwd-\S+ \.\.\. [0-9.]+ ms.*\([0-9.]+ s elapsed\)$", done.stdout, re.MULTILINE
    ), done.stdout
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert schema_errors(doc) == []
    assert doc["backend"] == "cpu" and doc["gpu"] is None and doc["comparison"] is None
    assert [c["id"] for c in doc["cases"]] == list(benchmatrix.QUICK_IDS["cpu"])
    groups = {"prefill", "decode", "small", "backward", "features"}
    assert {c["group"] for c in doc["cases"]} == groups
    for case in doc["cases"]:
        assert case["ours"]["status"] == "ok", case["ours"]
        peers = {"fa3", "fa4"} if case["kind"] != "decode" else set()
        features = {"window", "softcap", "sinks"} & set(case)
        flex = {"flex"} if features else set()
        assert set(case["baselines"]) == set(baselines.BASELINES) | peers | flex
        if features:  # SDPA cannot express them; FlexAttention is timed on CUDA
            assert all(case["baselines"][n]["status"] == "unsupported" for n in baselines.BASELINES)
            assert case["baselines"]["flex"] == {"status": "unsupported", "reason": NOT_ON_CPU}
            continue
        # FlashAttention-3 and -4 need an sm_90 card: a column that says why, not a crash
        assert all(case["baselines"][p]["status"] == "unsupported" for p in peers)
        deterministic = case["kind"] == "backward" and case["group"] != "features"
        assert ("ours_deterministic" in case) == deterministic
        assert case["baselines"]["sdpa-default"]["status"] == "ok"
        # CUDA-only SDPA backends refuse CPU tensors: recorded with the reason, not a crash
        assert case["baselines"]["sdpa-cudnn"]["status"] == "unsupported"
        assert case["baselines"]["sdpa-cudnn"]["reason"]
    # the speed-target cases: varlen and paged measured, host cost and the model unsupported here
    targets = {t["id"]: t for t in doc["targets"]}
    assert list(targets) == list(benchmatrix.QUICK_TARGET_IDS["cpu"])
    assert re.search(r"^\[14/19\] varlen-\S+ \.\.\. varlen / dense [0-9.]+x", done.stdout, re.M)
    for kind, sides in (("varlen", ("ours", "dense")), ("paged", ("ours", "contiguous"))):
        (record,) = [t for t in doc["targets"] if t["kind"] == kind]
        assert all(record[side]["status"] == "ok" for side in sides), record
        assert record["ratio"] > 0
    for kind in ("host", "model"):
        (record,) = [t for t in doc["targets"] if t["kind"] == kind]
        assert record["ours"]["status"] == record["sdpa"]["status"] == "unsupported"
        assert "CUDA" in record["ours"]["reason"]
    (step,) = [t for t in doc["targets"] if t["kind"] == "step"]  # the training step runs
    assert step["ours"]["status"] == step["sdpa"]["status"] == "ok" and step["ratio"] > 0
    assert step["ours_tokens_per_s"] > 0
    (loss,) = [t for t in doc["targets"] if t["kind"] == "loss"]  # the training run's plumbing
    assert loss["ours"]["status"] == loss["eager"]["status"] == "ok" and loss["ratio"] > 0
    # varlen, paged, host, the step, the training run; the backward's and the deterministic
    # backward's geomeans; the features' eight
    assert "speed targets: 0 met, 0 missed, 15 not judged" in done.stdout
    assert "retaking" not in done.stdout and doc["timing"]["retakes"] == 0
    markdown = (tmp_path / "bench.md").read_text()
    assert "not measured again (--retakes 0)" in markdown
    main_table = markdown.split("\n\n")[2]  # after the title and the header lines
    rows = [line for line in main_table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| case | ours ms (IQR) |")
    assert len(rows) == 1 + len(doc["cases"])
    assert (
        "## Speed targets" in markdown
        and "| host-bf16-d128-h32kv8-b1-k1024-decode-lens |" in markdown
    )


def test_refuses_to_time_under_pytest_xdist(monkeypatch, capsys):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert bench.main(["--quick"]) == exitcodes.ENV_BROKEN
    assert "pytest-xdist" in capsys.readouterr().err
    with pytest.raises(timing.UnderXdistError):
        timing.benchmark(lambda: None, FakeTimer([1.0] * 20), timing.TimingConfig.for_device("cpu"))


def test_a_missing_validator_stops_the_run_before_anything_is_built_or_timed(
    tmp_path, monkeypatch, capsys
):
    """bench.json is validated when it is written, at the end: without jsonschema a whole run's
    measurements were lost there (an H100 run of 281 cases, then a traceback)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` raises ImportError

    def must_not_run(*args, **kwargs):
        raise AssertionError("built or timed without a way to write bench.json")

    monkeypatch.setattr(bench, "build_checkout", must_not_run)
    monkeypatch.setattr(bench, "run_matrix", must_not_run)
    assert bench.main(["--quick", "--backend", "cpu"]) == exitcodes.ENV_BROKEN
    err = capsys.readouterr().err
    assert "pip install jsonschema" in err and "nothing was timed" in err
    assert len(err.strip().splitlines()) == 1
    assert bench.main(["--quick", "--backend", "cpu", "--list"]) == exitcodes.OK  # lists anyway


@pytest.mark.parametrize(
    ("args", "subset", "recorded"),
    [
        (["--pr"], "pull-request", False),
        (["--quick"], "quick", False),
        (["--case", "dec-*"], "cases", False),
        ([], None, True),
    ],
)
def test_only_a_run_of_the_whole_matrix_is_recorded_and_a_subset_says_which(
    tmp_path, monkeypatch, args, subset, recorded
):
    """A pull request's bench (--pr) times one case per kernel family: bench.json says so (its
    geomean targets are not judged), and only a run of the whole matrix enters the history that
    later comparisons fall back to."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "build_checkout", lambda device: None)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device, timer, config: {})
    timed, stored = [], []
    real_run_matrix = bench.run_matrix

    flex_columns = []

    def run_matrix(cases, device, config, **kwargs):
        timed.extend(c.id for c in cases)
        flex_columns.append(kwargs["flex_column"])
        record = real_run_matrix([], device, config, baselines=False)
        record.commit = benchrecords.Commit("0" * 40, dirty=False)
        return record

    monkeypatch.setattr(bench, "run_matrix", run_matrix)
    monkeypatch.setattr(
        history, "record_history", lambda record, folder: stored.append(1) or folder
    )
    assert bench.main([*args, "--backend", "cpu"]) == exitcodes.OK
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc.get("subset") == subset and bool(stored) == recorded
    expected, _ = benchmatrix.select(
        "cpu", "--quick" in args, args[1:] if "--case" in args else (), "--pr" in args
    )
    assert timed == [c.id for c in expected]
    assert flex_columns == [subset != "pull-request"]  # a pull request compiles no FlexAttention
    # the groups whose geomean the selection cannot judge: some of their cases, not all
    partial = doc.get("partial_groups")
    assert partial == (targets.partial_groups(expected, benchmatrix.default_matrix("cpu")) or None)
    assert bool(partial) == (subset in ("pull-request", "quick"))


def test_a_run_clears_the_previous_results_before_it_builds(tmp_path, monkeypatch):
    """A commit that does not build (exit 125) must not leave an older run's bench.json behind,
    where the report would read it as this commit's."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path))
    for name in bench.OUTPUTS:
        (tmp_path / name).write_text("from an older run")

    def no_build(device):
        raise baselines.Abort(exitcodes.BUILD_FAILED, "this checkout does not build")

    monkeypatch.setattr(bench, "build_checkout", no_build)
    assert bench.main(["--quick", "--backend", "cpu", "--list"]) == exitcodes.OK
    assert all((tmp_path / name).exists() for name in bench.OUTPUTS)  # --list writes nothing
    assert bench.main(["--quick", "--backend", "cpu"]) == exitcodes.BUILD_FAILED
    assert not any((tmp_path / name).exists() for name in bench.OUTPUTS)


def test_bisect_needs_a_gpu_unless_cpu_is_asked_for(monkeypatch, capsys):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (
        bench.main(["--bisect", benchmatrix.QUICK_IDS["cuda"][0], "--max-ms", "1"])
        == exitcodes.ENV_BROKEN
    )
    assert "--backend cpu" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# The case matrix (pure functions)
# --------------------------------------------------------------------------------------------------


def test_gpu_matrix_covers_the_requested_matrix():
    ids = {c.id for c in benchmatrix.gpu_matrix()}
    for dtype in ("fp16", "bf16"):
        for d, h in ((64, 32), (128, 16)):
            for s in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
                for mask in ("causal", "full"):
                    assert f"fwd-{dtype}-d{d}-h{h}-b{16384 // s}-s{s}-{mask}" in ids
        for kv in (1024, 4096, 8192, 16384, 32768, 65536, 131072):
            for b in (1, 4, 16):
                for hkv in (32, 8):
                    kv_bytes = 2 * b * hkv * kv * 128 * 2
                    heads = "h32" if hkv == 32 else "h32kv8"
                    case_id = f"dec-{dtype}-d128-{heads}-b{b}-q1-k{kv}"
                    assert (case_id in ids) == (kv_bytes <= 8 * 2**30), case_id
    for h in (1, 8):
        for s in (128, 512):
            assert f"fwd-fp16-d64-h{h}-b1-s{s}-full" in ids
    assert len(ids) == len(benchmatrix.gpu_matrix()), "case ids must be unique"


def test_gpu_matrix_times_the_wide_head_dims_forward_backward_and_gemma_decode():
    """Issue 47's bench: prefill and backward at B*S = 16k, S 512 to 16k, causal both, at d=96,
    192, 256 and (192, 128) (hidden size 2048), and Gemma 2's decode at d=256."""
    ids = {c.id for c in benchmatrix.gpu_matrix()}
    for d, h in ((96, 21), (192, 10), (256, 8), ("192v128", 10)):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for mask in ("causal", "full"):
                for kind in ("fwd", "bwd"):
                    assert f"{kind}-bf16-d{d}-h{h}-b{16384 // s}-s{s}-{mask}" in ids
    for b in (1, 4):
        for kv in (8192, 32768, 131072):
            assert f"dec-bf16-d256-h16kv8-b{b}-q1-k{kv}" in ids


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_quick_cases_are_a_handful_from_the_default_matrix(device):
    quick = benchmatrix.select_cases(device, quick=True)
    assert [c.group for c in quick].count("prefill") == 2
    assert [c.group for c in quick].count("decode") == 1
    assert [c.group for c in quick].count("small") == 1
    # a subset, so a stored full run can serve as the reference of a quick run
    assert {c.id for c in quick} <= {c.id for c in benchmatrix.default_matrix(device)}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_glob_with_quick_picks_among_the_quick_cases(device):
    quick, quick_targets = benchmatrix.select(device, quick=True)
    cases_, targets = benchmatrix.select(device, quick=True, patterns=["fwd-*", "paged-*"])
    assert [c.id for c in cases_] == [c.id for c in quick if c.id.startswith("fwd-")]
    plain = [c for c in cases_ if c.group != "features"]
    assert len(plain) == 3  # two prefill cases and the small one, not the matrix's dozens
    assert [t.id for t in targets] == [t.id for t in quick_targets if t.id.startswith("paged-")]
    with pytest.raises(ValueError, match=r"matches nothing in the \w+ --quick subset"):
        benchmatrix.select(device, quick=True, patterns=["dec-*-k65536"])


def test_cpu_matrix_is_scaled_down():
    for case in benchmatrix.cpu_matrix():
        assert case.seqlen_k <= 4096 and case.seqlen_q <= 512
        assert case.batch * case.heads_q <= 32


def test_case_ids_round_trip_and_globs_select():
    for case in [*benchmatrix.gpu_matrix(), *benchmatrix.cpu_matrix()]:
        parsed = cases.parse_case_id(case.id)
        assert parsed.id == case.id
        assert dataclasses.replace(parsed, group=case.group) == case
    chosen = benchmatrix.select_cases(
        "cuda", patterns=["dec-bf16-*-b16-q1-k8192", "fwd-fp16-d64-h8-b1-s512-full"]
    )
    assert [c.id for c in chosen] == [
        "dec-bf16-d128-h32-b16-q1-k8192",
        "dec-bf16-d128-h32kv8-b16-q1-k8192",
        "fwd-fp16-d64-h8-b1-s512-full",
    ]
    with pytest.raises(ValueError, match="bad case id"):
        benchmatrix.select_cases("cuda", patterns=["fwd-fp32-d64"])


def test_flops_and_bytes():
    prefill = cases.parse_case_id("fwd-bf16-d128-h16-b4-s4096-causal")
    assert prefill.flops == 4 * 4 * 16 * 4096 * 4096 * 128 // 2
    assert cases.parse_case_id("fwd-bf16-d128-h16-b4-s4096-full").flops == 2 * prefill.flops
    decode = cases.parse_case_id("dec-bf16-d128-h32kv8-b4-q1-k8192")
    assert decode.causal and decode.flops == 4 * 4 * 32 * 1 * 8192 * 128  # not halved: Sq != Sk
    assert decode.bytes_moved == 2 * 4 * 8 * 8192 * 128 * 2 + 2 * 4 * 32 * 128 * 2


def test_sdpa_masks_follow_our_alignment():
    import torch

    decode = cases.parse_case_id("dec-fp16-d64-h4kv2-b1-q1-k64")
    x = cases.make_inputs(decode, "cpu")
    fn, reason = baselines.sdpa_call(decode, x)
    ours = baselines.our_call(decode, x)()
    assert reason is None
    torch.testing.assert_close(fn().float(), ours.float(), atol=2e-3, rtol=2e-3)
    _, reason = baselines.sdpa_call(cases.parse_case_id("fwd-fp16-d64-h4-b1-q16-k64-causal"), x)
    assert "top-left" in reason


# --------------------------------------------------------------------------------------------------
# Timing helper
# --------------------------------------------------------------------------------------------------


class FakeTimer:
    """Hands out prepared samples instead of timing anything; records what the helper asked for."""

    method, flush_bytes = "fake", 0

    def __init__(self, samples):
        self.samples = list(samples)
        self.calls = []

    def warm(self, fn, count):
        self.calls.append(("warm", count))

    def time(self, fn, count, flush=True):
        self.calls.append(("time", count, flush))
        taken, self.samples = self.samples[:count], self.samples[count:]
        return taken


def test_benchmark_reports_median_and_iqr_of_the_timed_calls(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    config = timing.TimingConfig(
        warmup_ms=10, rep_ms=10, min_warmup=3, min_reps=5, max_reps=7, estimate_calls=1
    )
    timer = FakeTimer(
        [2.0, 5.0, 1.0, 4.0, 2.0, 3.0, 99.0]
    )  # estimate 2 ms -> 5 warm-up, 5 timed calls
    result = timing.benchmark(lambda: None, timer, config)
    assert timer.calls == [("time", 1, True), ("warm", 5), ("time", 5, True)]
    assert result.samples_ms == [5.0, 1.0, 4.0, 2.0, 3.0]
    assert (result.median_ms, result.summary.q1, result.summary.q3, result.iqr_ms) == (
        3.0,
        2.0,
        4.0,
        2.0,
    )


class PerCallTimer(FakeTimer):
    """Every timed call of fn takes fn.ms."""

    def __init__(self):
        super().__init__([])

    def time(self, fn, count, flush=True):
        return [fn.ms] * count


def timed(ms):
    def fn():
        return None

    fn.ms = ms
    return fn


class CoarseClock:
    """A clock that reads in steps of `step_ns`, and a call that takes `call_ns` of its time."""

    def __init__(self, step_ns: int, call_ns: int):
        self.now, self.step_ns, self.call_ns = 0, step_ns, call_ns

    def read(self) -> int:
        return self.now // self.step_ns * self.step_ns

    def call(self) -> None:
        self.now += self.call_ns


def test_a_cpu_sample_times_enough_calls_to_resolve_a_call_shorter_than_the_clocks_step():
    # a 20 us call against a clock that reads in 100 us steps: timed alone it reads 0 or 100 us
    clock = CoarseClock(step_ns=100_000, call_ns=20_000)
    timer = timing.CpuTimer(min_sample_ms=5.0, clock=clock.read)
    samples = timer.time(clock.call, 10)
    assert len(samples) == 10
    assert all(abs(ms - 0.020) <= 0.020 * 0.05 for ms in samples), samples
    calls, _ = timer.calls_per_sample(clock.call)
    assert calls * 0.020 >= 5.0 and calls * 0.020 <= 5.0 * 1.3  # about the minimum, not far past
    # a call that lasts the minimum alone is timed once per sample, sizing included
    slow = CoarseClock(step_ns=100_000, call_ns=6_000_000)
    samples = timing.CpuTimer(min_sample_ms=5.0, clock=slow.read).time(slow.call, 3)
    assert samples == [6.0, 6.0, 6.0] and slow.now == 3 * 6_000_000


def test_a_cpu_sample_of_a_known_spin_reads_its_length():
    """A busy wait of 50 us on the real clock: no sample reads less than that, and the least
    disturbed one is close to it, not a whole scheduler tick (the other samples of a loaded
    machine may be stretched by a tick, so their bound is left out)."""

    def spin(ns: int = 50_000) -> None:
        until = time.perf_counter_ns() + ns
        while time.perf_counter_ns() < until:
            pass

    samples = timing.CpuTimer(min_sample_ms=2.0).time(spin, 5)
    assert min(samples) >= 0.050 and min(samples) < 0.050 * 10, samples


def test_read_floor_is_the_fastest_read_and_missing_triton_is_a_record(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    case = cases.parse_case_id("dec-bf16-d128-h32-b1-q1-k4096")
    config = timing.TimingConfig.for_device("cpu", warmup_ms=1, rep_ms=1)
    calls = {"a": timed(0.05), "b": timed(0.02), "c": timed(0.04)}
    floor, others = measure.read_floor(case, None, "cpu", PerCallTimer(), config, calls=calls)
    assert floor == benchrecords.ReadFloor(median_ms=0.02, gbps=3355, config="b", iqr_ms=0.0)
    assert others == {}
    assert floor.gbps == round(case.kv_bytes / 0.02e-3 / 1e9)  # 64 MiB of K and V

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    floor, _ = measure.read_floor(case, None, "cpu", PerCallTimer(), config, calls={"x": broken})
    assert floor.status == "error" and floor.reason.startswith("x: ")

    def no_triton(k, v):
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(measure.readfloor, "read_calls", no_triton)
    ours = {"ours": (timed(0.03), None)}
    floor, others = measure.read_floor(
        case, cases.Inputs(None, None, None, None), "cpu", PerCallTimer(), config, alongside=ours
    )
    assert others["ours"].median_ms == 0.03  # what it was set against is still timed
    assert floor == benchrecords.NotMeasured(
        "unsupported", "the read floor needs Triton: No module named 'triton'"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_read_floor_on_cuda_reads_every_byte_and_fits_the_schema(monkeypatch):
    """Each reader sums all of K and V (1000 keys: not a multiple of its blocks, so the masked
    tail counts too); a decode case's record carries the floor as the schema says."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # plumbing only: times are not used
    case = cases.parse_case_id("dec-bf16-d128-h8-b1-q1-k1000")
    x = cases.make_inputs(case, "cuda")
    expected = x.k.double().sum() + x.v.double().sum()
    for name, call in measure.readfloor.read_calls(x.k, x.v).items():
        call()
        got = call.args[2].double().sum()  # one fp32 partial sum per program
        assert abs(float(got - expected)) < 1e-3 * x.k.numel() ** 0.5, name
    config = timing.TimingConfig.for_device("cuda", warmup_ms=1, rep_ms=2)
    entry = measure.run_case(case, "cuda", timing.CudaTimer(), config, {}, baselines=False)
    floor = entry.read_floor
    assert floor.status == "ok" and floor.median_ms > 0 and floor.ratio > 0, floor
    errors = definition_validator("case").iter_errors(benchrecords.to_json(entry))
    assert list(errors) == []


class DriftingTimer:
    """A card that slows as it works: every sample of a call is its own time x (1 + drift x the
    time spent so far), like clocks that fall as the card heats. Records which call it timed."""

    method, flush_bytes = "fake", 0

    def __init__(self, drift):
        self.drift, self.spent, self.order = drift, 0.0, []

    def warm(self, fn, count):
        self.order.append(fn.name)  # once per measurement

    def time(self, fn, count, flush=True):
        taken = []
        for _ in range(count):
            taken.append(fn.ms * (1 + self.drift * self.spent))
            self.spent += taken[-1]
        return taken


def _kernel(name, ms):
    def fn():
        return None

    fn.name, fn.ms = name, ms
    return fn


@pytest.mark.parametrize("rounds", [1, measure.ROUNDS])
def test_ours_and_the_baselines_are_timed_in_interleaved_rounds(monkeypatch, rounds):
    """The same kernel under two names must come out at a ratio near 1 on a drifting card; timed
    one after the other (one round), the second looks slower by the drift alone."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    case = cases.parse_case_id("fwd-fp16-d64-h8-b1-s512-full")
    config = timing.TimingConfig(
        warmup_ms=0, rep_ms=30, min_warmup=0, min_reps=30, max_reps=30, estimate_calls=1
    )
    timer = DriftingTimer(drift=0.004)
    calls = {"ours": (_kernel("ours", 1.0), None), "twin": (_kernel("twin", 1.0), None)}
    got = measure.measure_interleaved(calls, case, "cpu", timer, config, {}, rounds)
    assert list(got) == ["ours", "twin"]
    # every round times every call, every other round in reverse
    assert timer.order == (["ours", "twin", "twin", "ours"] * rounds)[: 2 * rounds]
    # the budget is split over the rounds
    assert got["ours"].n == got["twin"].n == rounds * math.ceil(30 / rounds)
    ratio = got["twin"].median_ms / got["ours"].median_ms
    if rounds == 1:
        assert ratio > 1.05  # sequential timing shows a difference that is not there
    else:
        assert abs(ratio - 1) < 0.02


def test_the_read_floor_is_timed_in_the_rounds_of_what_it_is_set_against(monkeypatch):
    """On a drifting card a floor read that takes as long as our kernel must come out at a ratio
    near 1: it is timed in the same interleaved rounds, not after ours (where the drift alone made
    it look 5% slower or more)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    case = cases.parse_case_id("dec-bf16-d128-h32-b1-q1-k4096")
    config = timing.TimingConfig(
        warmup_ms=0, rep_ms=30, min_warmup=0, min_reps=30, max_reps=30, estimate_calls=1
    )
    timer = DriftingTimer(drift=0.004)
    floor, timed_with = measure.read_floor(
        case,
        None,
        "cpu",
        timer,
        config,
        calls={"reader": _kernel("floor", 1.0)},
        alongside={"ours": (_kernel("ours", 1.0), None)},
    )
    assert timer.order[:4] == ["ours", "floor", "floor", "ours"]
    assert (
        floor.config == "reader" and abs(floor.median_ms / timed_with["ours"].median_ms - 1) < 0.02
    )


def test_a_call_that_fails_in_a_later_round_becomes_its_record(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    case = cases.parse_case_id("fwd-fp16-d64-h8-b1-s512-full")
    config = timing.TimingConfig.for_device("cpu", warmup_ms=0, rep_ms=3)
    timer = DriftingTimer(drift=0.0)
    fails = _kernel("fails", 1.0)
    seen = []

    def flaky_time(fn, count, flush=True):
        seen.append(fn.name)
        if fn.name == "fails" and seen.count("fails") > 3:
            raise RuntimeError("CUDA out of memory\nmore")
        return DriftingTimer.time(timer, fn, count, flush)

    timer.time = flaky_time
    calls = {"ours": (_kernel("ours", 1.0), None), "fails": (fails, None)}
    got = measure.measure_interleaved(calls, case, "cpu", timer, config, {}, rounds=3)
    assert got["ours"].status == "ok"
    assert got["fails"] == benchrecords.NotMeasured("error", "RuntimeError: CUDA out of memory")


def deterministic_kernels(monkeypatch):
    """Fake kernels: ours 10 us, ours with deterministic=True 12 us, SDPA 11 us; no peers."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(measure, "make_inputs", lambda case, device: None)
    monkeypatch.setattr(
        measure,
        "our_call",
        lambda case, x: _kernel("det", 0.012) if case.deterministic else _kernel("ours", 0.010),
    )
    monkeypatch.setattr(measure, "sdpa_call", lambda case, x: (_kernel("sdpa", 0.011), None))
    monkeypatch.setattr(measure.peers, "availability", lambda device: {})


@pytest.mark.parametrize(
    ("case_id", "timed"),
    [
        ("bwd-bf16-d128-h16-b4-s4096-causal", True),
        ("bwd-bf16-d128-h16-b4-s4096-causal-det", False),  # deterministic already
        ("bwd-bf16-d128-h16-b4-s4096-causal-cfg1", False),  # a forced configuration
        ("fwdbwd-bf16-d128-h16-b4-s4096-causal", False),
        ("fwd-bf16-d128-h16-b4-s4096-causal", False),
    ],
)
def test_an_automatic_backward_case_times_our_deterministic_kernel_in_its_rounds(
    monkeypatch, case_id, timed
):
    deterministic_kernels(monkeypatch)
    config = timing.TimingConfig(
        warmup_ms=0, rep_ms=1, min_warmup=0, min_reps=8, max_reps=8, estimate_calls=1, retakes=0
    )
    timer = DriftingTimer(drift=0.0)
    entry = measure.run_case(cases.parse_case_id(case_id), "cpu", timer, config, {}, True)
    if not timed:
        ours = [name for name in timer.order if name in ("ours", "det")]
        assert len(ours) == measure.ROUNDS and entry.ours_deterministic is None  # ours alone
        assert "ours_deterministic" not in benchrecords.to_json(entry)
        return
    # in every round, beside ours: the first round forward, the next backward
    per_round = len(timer.order) // measure.ROUNDS
    rounds = [timer.order[i : i + per_round] for i in range(0, len(timer.order), per_round)]
    assert rounds[0][:2] == ["ours", "det"] and rounds[1][-2:] == ["det", "ours"]
    assert all(r.count("det") == 1 for r in rounds)
    det = entry.ours_deterministic
    assert det.median_ms == 0.012 and det.ratio == 1.2 and det.samples_ms is None
    doc = json.loads(json.dumps(benchrecords.to_json(entry)))
    assert list(definition_validator("case").iter_errors(doc)) == []
    assert benchrecords.case_from_json(doc) == entry
    record = benchrecords.load(FIXTURES / "passing" / "bench.json")
    record.cases = [entry]
    text = benchmd.render_markdown(record)
    assert "| vs default | vs deterministic | vs read floor |" in text
    assert "| 1.10x | 1.20x | - |" in text


def test_our_deterministic_kernel_failing_fails_the_run(monkeypatch, capsys):
    deterministic_kernels(monkeypatch)

    def broken():
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(
        measure, "our_call", lambda case, x: broken if case.deterministic else _kernel("ours", 1)
    )
    config = timing.TimingConfig.for_device("cpu", retakes=0)
    case = cases.parse_case_id("bwd-bf16-d128-h16-b4-s4096-causal")
    entry = measure.run_case(case, "cpu", DriftingTimer(drift=0.0), config, {}, True)
    assert entry.ours_deterministic.status == "error" and isinstance(
        entry.ours, benchrecords.Measured
    )
    record = benchrecords.load(FIXTURES / "passing" / "bench.json")
    record.cases, record.targets, record.comparison = [entry], None, None
    assert bench.verdict_exit_code(record, False) == exitcodes.GATE_FAILED
    assert case.id in capsys.readouterr().err


class DisturbedTimer:
    """Every other sample of the kernel named `victim` is `factors[i]` times slower during attempt
    i of a case (CALLS_PER_ATTEMPT calls to time() each): a disturbance that may or may not pass."""

    method, flush_bytes = "fake", 0
    CALLS_PER_ATTEMPT = 5 * measure.ROUNDS * 2  # ours and 4 baselines, an estimate and a timing

    def __init__(self, factors, victim="ours"):
        self.factors, self.victim, self.calls = factors, victim, 0

    def warm(self, fn, count):
        pass

    def time(self, fn, count, flush=True):
        factor = self.factors[min(self.calls // self.CALLS_PER_ATTEMPT, len(self.factors) - 1)]
        self.calls += 1
        slow = factor if fn.name == self.victim else 1.0
        return [fn.ms * (slow if i % 2 else 1.0) for i in range(count)]


def disturbed_case(monkeypatch, factors):
    """run_case on fake kernels (ours 10 us, every SDPA backend 12 us) under a DisturbedTimer; the
    record and the progress lines it printed."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(measure, "make_inputs", lambda case, device: None)
    monkeypatch.setattr(measure, "our_call", lambda case, x: _kernel("ours", 0.010))
    monkeypatch.setattr(measure, "sdpa_call", lambda case, x: (_kernel("sdpa", 0.012), None))
    case = cases.parse_case_id("fwd-fp16-d64-h1-b1-s512-full")
    config = timing.TimingConfig(
        warmup_ms=0, rep_ms=1, min_warmup=0, min_reps=8, max_reps=8, estimate_calls=1
    )
    said = []
    timer = DisturbedTimer(factors)
    entry = measure.run_case(case, "cpu", timer, config, {}, baselines=True, say=said.append)
    return entry, said, timer


def test_a_disturbed_case_is_retaken_whole_and_the_retake_is_recorded(monkeypatch):
    entry, said, timer = disturbed_case(monkeypatch, [5.0, 1.0, 1.0])
    assert timer.calls == 2 * DisturbedTimer.CALLS_PER_ATTEMPT  # every column timed again
    assert said == [
        "  retaking fwd-fp16-d64-h1-b1-s512-full (1 of 2): ours IQR 133% of the median, over 25%"
    ]
    assert entry.retakes == 1 and entry.unstable is None
    assert entry.ours.median_ms == 0.01 and entry.ours.iqr_ms == 0 and entry.ours.retakes == 1
    for name in benchrecords.BASELINE_NAMES:  # the ratios come from the clean attempt
        assert entry.baselines[name].ratio == 1.2 and entry.baselines[name].retakes == 1
    assert list(definition_validator("case").iter_errors(benchrecords.to_json(entry))) == []
    # an undisturbed case is taken once and says nothing
    entry, said, timer = disturbed_case(monkeypatch, [1.0])
    assert timer.calls == DisturbedTimer.CALLS_PER_ATTEMPT and said == []
    assert entry.retakes is None and entry.ours.retakes is None
    assert "retakes" not in benchrecords.to_json(entry)


def test_a_case_that_stays_disturbed_keeps_its_least_disturbed_attempt_and_is_not_judged(
    monkeypatch,
):
    from flashmoe_science.pipeline.bench import targets

    # 1.4: a spread of 33%, still unstable, but less than the retakes' 133%
    entry, said, timer = disturbed_case(monkeypatch, [1.4, 5.0, 5.0])
    assert timer.calls == 3 * DisturbedTimer.CALLS_PER_ATTEMPT and len(said) == 2
    assert said[1].startswith("  retaking fwd-fp16-d64-h1-b1-s512-full (2 of 2): ours IQR 33%")
    assert entry.retakes == 2 and entry.unstable == ["ours"]
    assert entry.ours.iqr_ms == pytest.approx(0.004) and entry.ours.retakes == 2
    assert bench._progress_text(entry).endswith("; still unstable: ours, not judged")
    default = entry.baselines["sdpa-default"]
    sides = (("ours", entry.ours), ("SDPA default", default))
    verdict = targets.judge(entry.id, targets.SMALL_VS_DEFAULT, default.ratio, 1.0, False, sides)
    assert verdict.status == targets.NOT_JUDGED
    assert verdict.reason == "ours unstable: IQR 33% of the median after 2 retakes; rerun the bench"
    # the retakes are recorded; the record reads back as it was written
    doc = json.loads(json.dumps(benchrecords.to_json(entry)))
    assert doc["retakes"] == 2 and doc["unstable"] == ["ours"] and doc["ours"]["retakes"] == 2
    assert list(definition_validator("case").iter_errors(doc)) == []
    assert benchrecords.case_from_json(doc) == entry
    # a record written before the retakes existed still loads, with none recorded
    for key in ("retakes", "unstable"):
        del doc[key]
    for result in (doc["ours"], *doc["baselines"].values()):
        result.pop("retakes", None)  # the peers, not installed here, have none
    assert list(definition_validator("case").iter_errors(doc)) == []
    old = benchrecords.case_from_json(doc)
    assert old.retakes is None and old.unstable is None and old.ours.retakes is None
    assert list(definition_validator("case").iter_errors({**doc, "retakes": -1}))


def test_benchmark_caps_the_repeats_and_honours_a_fixed_count(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    config = timing.TimingConfig(
        warmup_ms=25, rep_ms=100, min_warmup=3, min_reps=10, max_reps=100, estimate_calls=5
    )
    timer = FakeTimer([0.01] * 500)  # 10 us kernels: the budget alone would ask for 10,000 calls
    assert timing.benchmark(lambda: None, timer, config).summary.n == 100
    assert timer.calls[1] == ("warm", 2500)
    assert timing.benchmark(lambda: None, FakeTimer([0.01] * 500), config, samples=7).summary.n == 7


# --------------------------------------------------------------------------------------------------
# Head against base
# --------------------------------------------------------------------------------------------------


class FakeWorker:
    def __init__(self, name, log, samples, error=None):
        self.name, self.log, self.samples, self.error = name, log, samples, error

    def time(self, case, count):
        self.log.append(self.name)
        if self.error:
            raise headbase.WorkerError(self.error)
        return self.samples[:count]


def test_comparison_interleaves_base_and_head():
    assert headbase.interleaved_order(3) == ["base", "head"] * 3
    log = []
    same = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.0]
    workers = {"base": FakeWorker("A", log, same), "head": FakeWorker("B", log, same)}
    cases = benchmatrix.select_cases("cpu", quick=True)[:2]
    results = headbase.compare_interleaved(cases, workers, 4, 8, 0.05, 0.01, say=lambda _: None)
    assert log == ["A", "B"] * 8  # A B A B per case, case after case
    assert [r.verdict for r in results] == [stats.NO_CHANGE] * 2  # identical code: no change


def test_comparison_flags_a_slower_head_and_records_failing_cases():
    log = []
    base = [1.0, 1.01, 0.99, 1.02, 0.98]
    workers = {
        "base": FakeWorker("A", log, base),
        "head": FakeWorker("B", log, [x * 1.2 for x in base]),
    }
    case = benchmatrix.select_cases("cpu", quick=True)[:1]
    [result] = headbase.compare_interleaved(case, workers, 4, 5, 0.05, 0.01, say=lambda _: None)
    assert result.verdict == stats.REGRESSION and result.change_pct == pytest.approx(20)
    workers["head"] = FakeWorker("B", log, [], error="RuntimeError: head_dim 96 unsupported")
    [result] = headbase.compare_interleaved(case, workers, 4, 5, 0.05, 0.01, say=lambda _: None)
    assert result.verdict == "missing" and "head_dim 96" in result.reason


def test_stored_reference_is_the_base_itself_else_its_newest_ancestor():
    entries = [{"commit": "a1"}, {"commit": "b2"}, {"commit": "c3"}, {"commit": "d4"}]
    ancestors = {"a1", "b2"}  # c3 and d4 are on other branches
    assert history.stored_reference(entries, "c3", lambda a, _: a in ancestors)["commit"] == "c3"
    assert history.stored_reference(entries, "zz", lambda a, _: a in ancestors)["commit"] == "b2"
    assert history.stored_reference(entries, "zz", lambda a, _: False) is None


def test_history_keeps_the_raw_samples_per_machine(tmp_path):
    record = benchrecords.load(next(FIXTURES.glob("*/bench.json")))
    measured = benchrecords.Measured(1.5, 1, 2, 1, 2, None, None, None, None, None, [1.0, 2.0])
    record.gpu = benchrecords.Gpu("NVIDIA L4", "8.9", 58, 24 * 2**30)
    record.commit = benchrecords.Commit("abc", dirty=False)
    record.cases = [
        dataclasses.replace(record.cases[0], id="x", ours=measured),
        dataclasses.replace(
            record.cases[0], id="y", ours=benchrecords.NotMeasured("error", "boom")
        ),
    ]
    for _ in range(history.HISTORY_KEEP + 3):
        path = history.record_history(record, tmp_path)
    assert path.name == "nvidia-l4.json"
    entries = history.load_history(path)
    assert len(entries) == history.HISTORY_KEEP
    assert entries[-1]["samples_ms"] == {"x": [1.0, 2.0]}
    assert entries[-1]["commit"] == "abc"


# --------------------------------------------------------------------------------------------------
# End to end: a throwaway repository whose head is slower than its base
# --------------------------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    return git(repo, *args).stdout.strip()


# Appended to ops.py, so edits elsewhere in that file do not break the plant.
SLOWER_FORWARD = """

_unplanted_forward = flash_attention_forward


def flash_attention_forward(*args, **kwargs):  # planted by tests/bench/test_bench.py: 200 ms slower
    __import__("time").sleep(0.2)
    return _unplanted_forward(*args, **kwargs)
"""


class _Started(Exception):
    """Raised by a stand-in for start_base_build once it has seen its arguments."""


def test_the_build_steps_base_is_the_one_the_bench_builds(monkeypatch, tmp_path):
    """`build --base REF` (basetree.start_prebuild) builds REF in the very tree, build root,
    report dir, log and environment that `bench --base REF` uses, so the bench finds it made;
    nothing where REF is unknown or its kernel sources are these (the bench reuses this build)."""
    monkeypatch.setenv("FLASHMOE_BUILD_ROOT", str(tmp_path / "root"))
    head = build.resolve_config("cpu")
    tree = tmp_path / "root" / "worktrees" / "ab12"
    (tree / "flashmoe_science" / "pipeline" / "bench").mkdir(parents=True)
    (tree / "flashmoe_science" / "pipeline" / "bench" / "run.py").write_text("")
    shutil.copytree(head.sources_dir, tree / "csrc")
    sha = "ab12" * 10
    monkeypatch.setattr(basetree, "resolve_ref", lambda ref: sha if ref == "main" else "")
    monkeypatch.setattr(basetree, "commit_has_bench", lambda sha: True)
    monkeypatch.setattr(basetree, "prepare_worktree", lambda sha: tree)
    said: list[str] = []
    assert basetree.start_prebuild("nope", head, said.append) is None
    assert "no such commit here" in said[-1]
    assert basetree.start_prebuild("main", head, said.append) is None, "same sources"
    assert "its kernel sources are these" in said[-1]

    (tree / "csrc" / "flashmoe_science.cu").write_text(head.source.read_text() + "// base\n")
    seen = []

    def started(tree, env, log_path):
        seen.append((tree, env["FLASHMOE_BUILD_ROOT"], env[paths.REPORTS_VAR], log_path))
        raise _Started

    monkeypatch.setattr(basetree, "start_base_build", started)
    monkeypatch.setattr(headbase, "start_base_build", started)
    with pytest.raises(_Started):
        basetree.start_prebuild("main", head, said.append)
    args = argparse.Namespace(base_defines=None, warmup_ms=None, rep_ms=None)
    with pytest.raises(_Started):  # the bench's own build of the base, as compare() starts it
        headbase.compare_with_tree(tree, sha, [], "cpu", args, say=said.append)
    assert len(seen) == 2 and seen[0] == seen[1]
    build_root, reports = paths.base_dirs(tree, sha)
    assert seen[0] == (
        tree,
        str(build_root),
        str(reports),
        reports.parent / f"{sha[:12]}.build.log",
    )


@pytest.mark.slow
def test_base_worktree_comparison_finds_a_planted_slowdown(tmp_path):
    repo = tmp_path / "repo"
    copy_project(REPO_ROOT, repo)
    reuse_this_build(repo)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    with (repo / "flashmoe_science" / "ops.py").open("a") as ops_py:
        # prefill 200 ms slower: beyond the 15 -> 75 ms spikes of a loaded 2-core VM; decode unchanged
        ops_py.write(SLOWER_FORWARD)
    _git(repo, "commit", "-q", "-am", "head: slower prefill")

    env = {
        k: v
        for k, v in bench_env(tmp_path / "reports").items()
        if not k.startswith(("FLASHMOE_BUILD", "FLASHMOE_BENCH"))
    }
    args = [
        "--quick",
        "--backend",
        "cpu",
        "--no-baselines",
        "--rep-ms",
        "20",
        "--warmup-ms",
        "1",
        "--base",
        "HEAD~1",
        "--rounds",
        "3",
        "--samples-per-round",
        "4",
        "--fail-on-regression",
        # one prefill case (it pays the planted 200 ms a call) and the decode case; the speed
        # targets' dense sides would pay it too (their plumbing is
        # test_quick_run_on_cpu_writes_schema_valid_json_and_a_markdown_table's)
        "--case",
        "fwd-fp16-d64-h1-b1-s128-full",
        "--case",
        "dec-*",
    ]
    done = run_bench(args, repo, env, timeout=900)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == exitcodes.GATE_FAILED, output
    doc = json.loads((tmp_path / "reports" / "bench.json").read_text())
    assert schema_errors(doc) == []
    comparison = doc["comparison"]
    assert comparison["source"] == "worktree", output
    verdicts = {r["id"]: r["verdict"] for r in comparison["cases"]}
    prefill = [case_id for case_id in verdicts if case_id.startswith("fwd-")]
    assert prefill == ["fwd-fp16-d64-h1-b1-s128-full"], comparison["cases"]
    assert verdicts[prefill[0]] == stats.REGRESSION, comparison["cases"]
    assert any(case_id.startswith("dec-") for case_id in verdicts), comparison["cases"]
    # Decode runs the same code on both sides, but no verdict is asserted for it: on a 2-vCPU VM two
    # processes running identical CPU code were measured up to 2x apart (vCPU placement, threads),
    # so CPU comparisons check the plumbing; the statistics have their own tests (test_stats.py).
    # the base was built in its own build root, and its build.json did not overwrite ours
    label = comparison["base"]["sha"][:12]
    worktrees = repo / "build" / "worktrees"
    assert (worktrees / label / "flashmoe_science" / "pipeline" / "bench" / "run.py").is_file()
    assert (worktrees / f"{label}.build").is_dir()
    assert (worktrees / f"{label}.reports" / "build.json").is_file()
    # the change is to Python alone: the base's kernel sources are the head's, and its build
    # reused the head's library instead of compiling the same unit again
    assert "it reuses the head's build" in done.stdout, output
    base_log = (worktrees / f"{label}.build.log").read_text()
    assert "build: up to date (" in base_log and "compiling" not in base_log, base_log


def test_workers_start_through_the_cli_that_every_version_has():
    """Module paths move between versions (flashmoe_science.bench, then .pipeline.bench); the
    `python -m flashmoe_science bench --worker` command line is what old and new trees share."""
    assert headbase.worker_command("cpu", ["--rep-ms", "5"]) == [
        sys.executable,
        "-m",
        "flashmoe_science",
        "bench",
        "--worker",
        "--backend",
        "cpu",
        "--rep-ms",
        "5",
    ]
    env = headbase.side_env(REPO_ROOT, None, None)
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")}
    worker = headbase.Worker("head", REPO_ROOT, env, "cpu", ["--warmup-ms", "1", "--rep-ms", "5"])
    try:
        case = cases.parse_case_id("fwd-fp16-d64-h1-b1-s128-full")
        samples = worker.time(case, 3)
        assert len(samples) == 3 and all(s > 0 for s in samples)
        too_long = cases.parse_case_id("dec-fp16-d64-h2-b1-q1-k9-lens20")  # 20 > 9 cached keys
        with pytest.raises(headbase.WorkerError, match="ValueError: cache_seqlens"):
            worker.time(too_long, 1)
        assert len(worker.time(case, 2)) == 2  # the worker lives on after a failed request
    finally:
        worker.close()
    assert worker.process.returncode == 0


def _old_layout_commit() -> str | None:
    """The last commit whose bench command lived at flashmoe_science/bench.py, if this checkout's
    history holds it (a shallow clone does not)."""
    moved = git(REPO_ROOT, "rev-list", "-1", "HEAD", "--", "flashmoe_science/bench.py", check=False)
    sha = moved.stdout.strip()
    if moved.returncode != 0 or not sha:
        return None
    old = git(REPO_ROOT, "rev-parse", "--verify", "--quiet", f"{sha}^", check=False).stdout.strip()
    has = git(REPO_ROOT, "cat-file", "-e", f"{old}:flashmoe_science/bench.py", check=False)
    return old if old and has.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.long
def test_head_against_a_base_from_before_the_pipeline_moved(tmp_path):
    """A base whose bench lives at flashmoe_science/bench.py serves the head's requests. Long
    (35-50 s on 2 cores: the old base compiles its own CPU unit), so it runs in the scheduled run;
    the command line both sides share is tested on every pull request
    (test_workers_start_through_the_cli_that_every_version_has)."""
    old = _old_layout_commit()
    if old is None:
        pytest.skip("this checkout's history has no commit with flashmoe_science/bench.py")
    repo = tmp_path / "repo"
    repo.mkdir()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", old], cwd=REPO_ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base: the layout before the pipeline moved")
    _git(repo, "rm", "-q", "-r", ".")
    copy_project(REPO_ROOT, repo)
    reuse_this_build(repo)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "head: this tree")

    env = {
        k: v
        for k, v in bench_env(tmp_path / "reports").items()
        if not k.startswith(("FLASHMOE_BUILD", "FLASHMOE_BENCH"))
    }
    args = ["--quick", "--backend", "cpu", "--no-baselines", "--rep-ms", "10", "--warmup-ms", "1"]
    args += ["--base", "HEAD~1", "--rounds", "2", "--samples-per-round", "3"]
    done = run_bench(args, repo, env, timeout=900)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == exitcodes.OK, output
    record = benchrecords.load(tmp_path / "reports" / "bench.json")
    comparison = record.comparison
    assert comparison.source == "worktree", output
    assert [r.id for r in comparison.cases] == list(benchmatrix.QUICK_IDS["cpu"])
    assert all(r.verdict != "missing" for r in comparison.cases), comparison.cases
    tree = repo / "build" / "worktrees" / comparison.base.sha[:12]
    assert (tree / "flashmoe_science" / "bench.py").is_file()
    assert not (tree / "flashmoe_science" / "pipeline").exists()
