"""The test stage's verdicts: exit 0 only when gates ran and passed, 255 (a bisect stops) when no gate
ran, 1 when a test failed; reports/gates.json says which, for which commit; `--list` gives the ids
`-k` selects; plugins of the interpreter stay out of the run.

The stage runs as a user runs it, in a subprocess with its own report directory and no GPU, so the
CUDA gate cases skip. Gate ids come from `--list`, never spelled out here."""

from __future__ import annotations

import io
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flashmoe_science.pipeline import exitcodes, provenance
from flashmoe_science.pipeline.gates import devices, testing, timelimit
from flashmoe_science.pipeline.gates import plugin as gate_plugin
from flashmoe_science.pipeline.paths import REPO_ROOT

ALL_PASSED = "all gates passed"


def stage_env(reports: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "FLASHMOE_",
                "PYTEST_XDIST",
                "PYTEST_ADDOPTS",
                "TORCH_CUDA_ARCH",
                "OMP_NUM_THREADS",
                "TORCHINDUCTOR_COMPILE_THREADS",
            )
        )
    }
    env.update(
        FLASHMOE_REPORTS_DIR=str(reports),
        CUDA_VISIBLE_DEVICES="",  # the CUDA gate cases skip, as on a machine without a GPU
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    env.update(extra)
    return env


THIS_FILE = "tests/gates/test_testing.py"


def run_stage(reports: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashmoe_science", "test", *args],
        cwd=REPO_ROOT,
        env=stage_env(reports, **extra),
        capture_output=True,
        text=True,
        timeout=600,
    )


def record(reports: Path) -> dict:
    return json.loads((reports / gate_plugin.RECORD).read_text())


def forward_gate_id(device: str) -> str:
    """A forward gate's id as tests/gates/test_gates.py parametrizes them, read from the matrix: the
    stage's `--list --all` costs a run of the command line of its own."""
    from flashmoe_science.pipeline.gates import matrix

    tier = "cpu" if device == "cpu" else "gpu"
    case = next(c for c in matrix.gate_cases(tier) if c.kind != "decode" and c.seqlen_q > 1)
    return f"{case.id}-{device}"


# ---- the outcome of a session, from its counts --------------------------------------------------


def counts(gates=(0, 0, 0, 0), tests=(0, 0, 0, 0)) -> tuple[dict, dict]:
    """gates (passed, failed, skipped, other-selected) and tests (passed, failed, errors, skipped)."""
    g, t = gate_plugin.empty_counts()
    g.update(passed=gates[0], failed=gates[1], skipped=gates[2], ran=gates[0] + gates[1])
    g["selected"] = g["ran"] + g["skipped"]
    t.update(passed=tests[0], failed=tests[1], errors=tests[2], skipped=tests[3])
    t["selected"] = sum(tests)
    return g, t


@pytest.mark.parametrize(
    ("pytest_exit", "gates", "tests", "outcome"),
    [
        (0, (3, 0, 0, 0), (10, 0, 0, 0), "passed"),
        (0, (3, 0, 2, 0), (10, 0, 0, 2), "passed"),
        (1, (2, 1, 0, 0), (10, 1, 0, 0), "failed"),
        (1, (3, 0, 0, 0), (10, 1, 0, 0), "tests-failed-outside-gates"),
        (1, (0, 0, 0, 0), (4, 1, 0, 0), "tests-failed-outside-gates"),
        (1, (3, 0, 0, 0), (10, 0, 1, 0), "tests-failed-outside-gates"),
        (0, (0, 0, 0, 0), (12, 0, 0, 0), "no-gates-selected"),
        (0, (0, 0, 4, 0), (0, 0, 0, 4), "gates-skipped-need-gpu"),
        (5, (0, 0, 0, 0), (0, 0, 0, 0), "no-tests-collected"),
        (2, (1, 0, 0, 0), (1, 0, 0, 0), "interrupted"),
        (3, (0, 0, 0, 0), (0, 0, 0, 0), "error"),
        (None, (0, 0, 0, 0), (0, 0, 0, 0), "error"),
    ],
)
def test_outcome_of_a_session(pytest_exit, gates, tests, outcome):
    g, t = counts(gates, tests)
    assert gate_plugin.classify(pytest_exit, g, t) == outcome


def test_only_gates_that_ran_and_passed_exit_0(capsys):
    for outcome, code in testing.EXIT_CODES.items():
        g, t = counts((3, 0, 0, 0) if outcome == "passed" else (0, 0, 0, 0), (3, 0, 0, 0))
        rec = {"outcome": outcome, "gates": g, "tests": t, "selection": {}, "reason": "why"}
        assert testing.verdict(rec, 1.0) == code
        said = capsys.readouterr()
        assert (ALL_PASSED in said.out + said.err) == (outcome == "passed"), outcome
        assert (code == exitcodes.OK) == (outcome == "passed"), outcome
    g, t = counts((0, 0, 0, 0), (12, 0, 0, 0))
    rec = {"outcome": "no-gates-selected", "gates": g, "tests": t, "selection": {}}
    assert testing.verdict(rec, 1.0, no_gates_ok=True) == exitcodes.OK
    assert "12 tests passed; no gate selected" in capsys.readouterr().out


# ---- the plugin over a small suite of its own ---------------------------------------------------

SUITE = """
import pytest

@pytest.mark.gate
@pytest.mark.parametrize("n", [1, 2])
def test_gate(n, record_property):
    record_property("gate", {"case_id": f"c{n}", "max_diff": 0.01 * n, "ratio": 1.5})
    assert {FAIL_GATE} != n

@pytest.mark.gate
def test_gpu_gate():
    pytest.skip("needs a CUDA GPU")

def test_other():
    assert not {FAIL_OTHER}
"""


def run_suite(
    tmp_path: Path, *args: str, fail_gate=0, fail_other=False, extra="", env: dict | None = None
) -> dict:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    (suite / "conftest.py").write_text(
        'pytest_plugins = ("flashmoe_science.pipeline.gates.plugin",)\n'
    )
    (suite / "test_suite.py").write_text(
        SUITE.replace("{FAIL_GATE}", str(fail_gate)).replace("{FAIL_OTHER}", str(fail_other))
        + extra
    )
    reports = tmp_path / "reports"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(suite)],
        cwd=suite,
        env=stage_env(reports, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **(env or {})),
        capture_output=True,
        text=True,
        timeout=300,
    )
    (tmp_path / "output.txt").write_text(done.stdout + done.stderr)
    return record(reports)


def test_gates_json_counts_gates_apart_from_tests(tmp_path):
    rec = run_suite(tmp_path)
    assert rec["schema"] == "flashmoe-science/gates/2"
    assert rec["outcome"] == "passed" and rec["pytest_exit"] == 0
    assert rec["gates"] == {"selected": 3, "ran": 2, "passed": 2, "failed": 0, "skipped": 1}
    assert rec["tests"] == {"selected": 4, "passed": 3, "failed": 0, "errors": 0, "skipped": 1}
    assert (rec["total"], rec["failed"], rec["worst_case"]) == (2, 0, "c2")
    assert rec["provenance"]["commit"] == provenance.commit()
    assert rec["provenance"]["run_id"]
    assert rec["restriction"] is None  # the full build


def test_the_end_of_a_session_imports_no_torch():
    """The plugin ends every pytest session, the stage's small subprocess ones too, so what it reads
    there (the build's restriction) comes from the loader, never through torch (~3 s a session on
    2 cores)."""
    check = (
        "import sys; from flashmoe_science.pipeline.gates import plugin; "
        "plugin._restriction_text(); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_record_names_the_restriction_even_one_the_build_refuses(monkeypatch):
    monkeypatch.setenv("FLASHMOE_BUILD_ONLY", "head_dim=256 op=bwd_sm90a")
    assert gate_plugin._restriction_text() == "op=bwd_sm90a head_dim=256"
    monkeypatch.setenv("FLASHMOE_BUILD_ONLY", "head_dim=96")  # not a tile: the build refuses it
    assert gate_plugin._restriction_text() == "head_dim=96"
    monkeypatch.delenv("FLASHMOE_BUILD_ONLY")
    assert gate_plugin._restriction_text() is None


def test_gates_skipped_on_a_restricted_build_are_said_to_be(tmp_path, capsys):
    """gates.json names the restriction the gates ran on, and the verdict says the skipped ones
    may be its left-out kernels' and how to run them; the full build's verdict stays as it was."""
    rec = run_suite(tmp_path, env={"FLASHMOE_BUILD_ONLY": "head_dim=192,256 dtype=bf16"})
    assert (rec["outcome"], rec["restriction"]) == ("passed", "head_dim=192,256 dtype=bf16")
    assert testing.verdict(rec, 1.0) == exitcodes.OK
    said = capsys.readouterr().out
    assert (
        "test: all gates passed (2 of 2; 1 skipped: a GPU they need or kernels this build "
        "restricted to 'head_dim=192,256 dtype=bf16' left out (unset FLASHMOE_BUILD_ONLY for the "
        "whole matrix))"
    ) in said
    g, t = counts((0, 0, 4, 0), (0, 0, 0, 4))
    skipped = {"outcome": "gates-skipped-need-gpu", "gates": g, "tests": t, "selection": {}}
    assert testing.verdict({**skipped, "restriction": "head_dim=64"}, 1.0) == exitcodes.ENV_BROKEN
    assert "holds, or unset FLASHMOE_BUILD_ONLY and rebuild" in capsys.readouterr().err
    testing.verdict(skipped, 1.0)
    assert "Run it on a GPU machine" in capsys.readouterr().err


def test_a_failing_gate_and_a_failing_other_test_are_told_apart(tmp_path, capsys):
    rec = run_suite(tmp_path, fail_gate=2)
    assert (rec["outcome"], rec["gates"]["failed"], rec["failed"]) == ("failed", 1, 1)
    assert rec["cases"][0]["case_id"] == "c2"  # failing cases first
    rec = run_suite(tmp_path, fail_other=True)
    assert rec["outcome"] == "tests-failed-outside-gates"
    assert testing.verdict(rec, 1.0) == exitcodes.GATE_FAILED
    said = capsys.readouterr().err
    assert "1 test outside the gates FAILED (2 of 2 gates passed)" in said
    assert ALL_PASSED not in said


JOB_FILES_TEST = """
import os
from pathlib import Path

def test_writes_a_job_file():
    for name in ("GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT"):
        if os.environ.get(name):  # what the report and the selection step do when it is set
            Path(os.environ[name]).write_text("a test's report")
"""


def test_a_test_never_writes_the_jobs_summary_or_outputs(tmp_path):
    """In a GitHub Actions job (the GPU test stage), a test that renders its fixtures' report
    appended it to the job's own step summary; with two workers, as the stage runs."""
    job = {name: tmp_path / name.lower() for name in ("GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT")}
    env = {name: str(path) for name, path in job.items()}
    rec = run_suite(tmp_path, "-p", "xdist.plugin", "-n", "2", extra=JOB_FILES_TEST, env=env)
    assert rec["outcome"] == "passed" and rec["tests"]["passed"] == 4
    assert not any(path.exists() for path in job.values())


TRAINING_TEST = """
def test_training(record_property):
    record_property("training", {"ours": [4.6312, 3.2001], "sdpa": [4.6312, 3.2107]})
"""


def test_the_training_run_is_recorded_and_said(tmp_path, capsys):
    """The training run's losses reach gates.json and the test stage's verdict lines (a GPU run's
    log then carries them), and a run without it says nothing of it."""
    rec = run_suite(tmp_path, extra=TRAINING_TEST)
    assert rec["training"] == {
        "ours": [4.6312, 3.2001],
        "sdpa": [4.6312, 3.2107],
        "outcome": "passed",
    }
    assert testing.verdict(rec, 1.0) == exitcodes.OK
    out = capsys.readouterr().out
    assert (
        "test: training run (passed), loss first -> last: ours 4.6312 -> 3.2001, SDPA "
        "4.6312 -> 3.2107" in out
    )
    assert out.index("training run") < out.index(ALL_PASSED)
    rec = run_suite(tmp_path)
    assert rec["training"] is None
    testing.verdict(rec, 1.0)
    assert "training" not in capsys.readouterr().out


def test_gates_only_deselects_every_other_test(tmp_path):
    rec = run_suite(tmp_path, "--gates-only", fail_other=True)
    assert rec["outcome"] == "passed" and rec["tests"]["selected"] == 3
    assert rec["selection"]["gates_only"] is True
    rec = run_suite(tmp_path, "-k", "gpu_gate")
    assert rec["outcome"] == "gates-skipped-need-gpu"
    assert rec["reason"] == "needs a CUDA GPU" and rec["selection"]["keyword"] == "gpu_gate"


# ---- the tests marked long: the scheduled run's, never a pull request's ------------------------

LONG_TEST = """
@pytest.mark.long
def test_end_to_end():
    pass
"""
LONG_GATE = """
@pytest.mark.long
@pytest.mark.gate
def test_long_gate():
    pass
"""
LONG_PLANT = """
@pytest.fixture
def run_planted():
    return None

@pytest.mark.long
def test_long_plant(run_planted):
    pass
"""


LEFT_OUT = "1 test marked `long` left out: `--long` runs them (the scheduled CI runs do)"


def test_a_test_marked_long_runs_only_when_asked(tmp_path):
    rec = run_suite(tmp_path, extra=LONG_TEST)
    assert rec["outcome"] == "passed" and rec["tests"]["selected"] == 4, "left out by default"
    assert rec["selection"]["long"] is False
    assert LEFT_OUT in (tmp_path / "output.txt").read_text()  # and the run says so
    # so do pytest-xdist workers, which collect and leave it out where their controller cannot
    rec = run_suite(tmp_path, "-p", "xdist.plugin", "-n", "2", extra=LONG_TEST)
    assert rec["tests"]["selected"] == 4 and LEFT_OUT in (tmp_path / "output.txt").read_text()
    for args, env in ((["--long"], None), ([], {gate_plugin.LONG_VAR: "1"})):
        rec = run_suite(tmp_path, *args, extra=LONG_TEST, env=env)
        assert rec["tests"]["selected"] == 5 and rec["selection"]["long"] is True, (args, env)
        assert "left out" not in (tmp_path / "output.txt").read_text()
    rec = run_suite(tmp_path, "--long", "--gates-only", extra=LONG_TEST)
    assert rec["tests"]["selected"] == 3, "--gates-only keeps the gates alone"
    run_suite(tmp_path, "--gates-only", extra=LONG_TEST)  # leaves out every other test anyway
    assert "left out" not in (tmp_path / "output.txt").read_text()


@pytest.mark.parametrize("extra", [LONG_GATE, LONG_PLANT], ids=["gate", "plant"])
def test_a_gate_or_a_plant_marked_long_is_refused(tmp_path, extra):
    """Gates and planted bugs prove every pull request: marking one long is a usage error, with
    or without --long, not a test quietly moved to the scheduled run."""
    for args in ([], ["--long"]):
        rec = run_suite(tmp_path, *args, extra=extra)
        assert (rec["outcome"], rec["pytest_exit"]) == ("error", 4), rec


# ---- the CPU twins: CPU CI's, left out of the GPU job's stage ---------------------------------

TWINS = """
@pytest.mark.gate
@pytest.mark.parametrize("case", ["c3"], ids=lambda c: f"{c}-cpu")
def test_cpu_gate(case, record_property):
    record_property("gate", {"case_id": case, "max_diff": 0.0, "ratio": 1.0})

@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_a_device(device):
    pass

@pytest.mark.cpu
def test_marked_cpu():
    pass
"""
TWINS_LEFT_OUT = "3 CPU twin tests left out (--no-cpu-twins): CPU CI runs them"


def test_no_cpu_twins_leaves_out_what_runs_the_cpu_implementation_alone(tmp_path):
    """The CPU gate case, the test on device cpu and the test marked cpu go; the CUDA twin, the
    other gates and tests stay; the run says how many it left out, under xdist too."""
    rec = run_suite(tmp_path, extra=TWINS)
    assert rec["tests"]["selected"] == 8 and rec["gates"]["selected"] == 4
    assert "CPU twin" not in (tmp_path / "output.txt").read_text()
    for workers in ([], ["-p", "xdist.plugin", "-n", "2"]):
        rec = run_suite(tmp_path, "--no-cpu-twins", *workers, extra=TWINS)
        assert rec["outcome"] == "passed", rec
        assert (rec["tests"]["selected"], rec["gates"]["selected"]) == (5, 3), workers
        assert [c["case_id"] for c in rec["cases"]] == ["c1", "c2"]
        assert TWINS_LEFT_OUT in (tmp_path / "output.txt").read_text(), workers
    rec = run_suite(tmp_path, "--no-cpu-twins", "--long", extra=TWINS + LONG_TEST)
    assert rec["tests"]["selected"] == 6, "--long keeps the long test, the twins still go"
    assert "marked `long` left out" not in (tmp_path / "output.txt").read_text()


# ---- every GPU of the machine: a worker per GPU --------------------------------------------------

DEVICE_GATES = """
import os
import time
from pathlib import Path

def _wait_for_every_worker():
    # a barrier: under xdist no worker runs these gates until every worker has reached one, so a
    # worker that starts late still receives gates (the load scheduler gives them to whoever asks)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    started = Path(__file__).with_name("started")
    started.mkdir(exist_ok=True)
    (started / worker).touch()
    deadline = time.monotonic() + 60
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    while len(list(started.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.01)

@pytest.fixture(autouse=True)
def _second_worker_starts_late():
    # what a busy machine does: the second worker's first test starts a second after the first's
    late = Path(__file__).with_name("late")
    if os.environ.get("PYTEST_XDIST_WORKER") == "gw1" and not late.exists():
        late.touch()
        time.sleep(1)
    yield

@pytest.mark.gate
@pytest.mark.parametrize("n", range(8))
def test_device_gate(n, record_property):
    _wait_for_every_worker()
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    threads = (os.environ.get("OMP_NUM_THREADS"), os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"))
    record_property(
        "gate",
        {"case_id": f"d{n}", "max_diff": 0.0, "ratio": 1.0, "seen": seen, "threads": threads},
    )
"""


def test_with_two_faked_gpus_both_workers_receive_gates_each_on_its_own(tmp_path):
    """Two GPUs (faked: this machine has none), two pytest-xdist workers: each worker is given one
    GPU as CUDA_VISIBLE_DEVICES before it starts, both run gates, and the one gates.json of the
    run holds every worker's gates and names the GPU each used."""
    rec = run_suite(
        tmp_path,
        *("-p", "xdist.plugin", "-n", "2"),
        extra=DEVICE_GATES,
        env={devices.DEVICES_VAR: "0,1"},
    )
    assert rec["outcome"] == "passed" and rec["gates"]["ran"] == 10
    workers = {w["id"]: w for w in rec["workers"]}
    assert sorted(workers) == ["gw0", "gw1"]
    assert {w["cuda_visible_devices"] for w in workers.values()} == {"0", "1"}
    assert all(w["gates"] > 0 for w in workers.values()), workers
    assert sum(w["gates"] for w in workers.values()) == 10 and rec["total"] == 10
    for case in rec["cases"]:
        given = workers[case["worker"]]["cuda_visible_devices"]
        if "seen" in case:  # the device the test itself saw is the one its worker was given
            assert case["seen"] == given, case
    assert all(w["gpu"] is None for w in workers.values()), "no GPU here to name"
    # each worker's torch gets its share of the cores, not every core (OpenMP oversubscription)
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert {tuple(case.get("threads")) for case in rec["cases"] if "seen" in case} == {
        (share, share)
    }


SLOW_LAST = """
import os
from pathlib import Path

def _ran(name):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(__file__).with_name(f"order-{worker}"), "a") as f:
        f.write(name + "\\n")

@pytest.mark.parametrize("n", range(6))
def test_quick(n):
    _ran(f"quick{n}")

@pytest.mark.slow
@pytest.mark.parametrize("n", range(2))
def test_slow(n):
    _ran(f"slow{n}")
"""


def test_workers_start_the_slow_tests_first(tmp_path):
    """Work stealing takes from the end of a worker's queue: a slow test last in the collection
    would start last and run alone at the stage's end. Workers put the tests marked slow first;
    a run without workers keeps the collection's order."""
    rec = run_suite(
        tmp_path, "-p", "xdist.plugin", "-n", "2", "--dist", "worksteal", extra=SLOW_LAST
    )
    assert rec["outcome"] == "passed"
    firsts = {path.read_text().split()[0] for path in (tmp_path / "suite").glob("order-gw*")}
    assert firsts == {"slow0", "slow1"}, "each worker starts on a slow test"
    (tmp_path / "serial").mkdir()
    run_suite(tmp_path / "serial", extra=SLOW_LAST)
    ran = (tmp_path / "serial" / "suite" / "order-main").read_text().split()
    assert ran[-2:] == ["slow0", "slow1"]


def test_each_workers_share_starts_with_its_part_of_the_slow_tests():
    """The shares pytest-xdist's worksteal cuts (N // workers, then the rest likewise), each
    headed by every `workers`-th slow test; nothing lost, nothing doubled."""
    items = [f"s{i}" if i % 10 == 9 else f"f{i}" for i in range(50)]  # five slow: s9 ... s49
    order = gate_plugin.slow_first(items, 3, lambda item: item.startswith("s"))
    assert sorted(order) == sorted(items)
    shares, left, start = [], len(order), 0
    for share in range(3):
        size = left // (3 - share)
        shares.append(order[start : start + size])
        left, start = left - size, start + size
    assert [share[:2] for share in shares[:2]] == [["s9", "s39"], ["s19", "s49"]]
    assert shares[2][0] == "s29" and not any(item.startswith("s") for item in shares[2][1:])
    assert shares[0][2] == "f0", "the fast tests keep their order"
    assert gate_plugin.slow_first(items, 1, lambda item: item.startswith("s")) == items


def test_without_gpus_the_workers_are_not_pinned_and_a_lone_process_says_so(tmp_path):
    rec = run_suite(
        tmp_path,
        *("-p", "xdist.plugin", "-n", "2"),
        extra=DEVICE_GATES,
        env={"OMP_NUM_THREADS": "3", "TORCHINDUCTOR_COMPILE_THREADS": "4"},
    )
    assert {w["cuda_visible_devices"] for w in rec["workers"]} == {""}, "the run's own, unchanged"
    assert {tuple(case.get("threads")) for case in rec["cases"] if "seen" in case} == {("3", "4")}
    (tmp_path / "serial").mkdir()
    rec = run_suite(tmp_path / "serial", extra=DEVICE_GATES)
    assert [(w["id"], w["gates"], w["tests"]) for w in rec["workers"]] == [("main", 10, 12)]
    assert all("worker" not in case for case in rec["cases"])


def test_the_gpus_of_the_stage_and_each_workers_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "2,GPU-ab12"}
    assert devices.visible_devices(env, count=lambda: 8) == ["2", "GPU-ab12"]
    assert devices.visible_devices({**env, devices.DEVICES_VAR: "0, 1"}) == ["0", "1"]
    assert devices.visible_devices({"CUDA_VISIBLE_DEVICES": ""}, count=lambda: 8) == []
    assert devices.visible_devices({}, count=lambda: 3) == ["0", "1", "2"]
    assert [devices.device_of(i, ["0", "1", "2"]) for i in range(7)] == list("0120120")
    assert devices.device_of(0, []) is None
    # every GPU gets a worker, however few the cores; no more than MAX_WORKERS otherwise
    assert devices.worker_count(2, ["0", "1", "2", "3"]) == 4
    assert devices.worker_count(64, ["0"]) == devices.MAX_WORKERS
    assert devices.worker_count(None, []) == 1
    # half a worker over the cores: the stage's tests wait on subprocesses for part of their time
    assert [devices.worker_count(c, []) for c in (1, 2, 4, 5, 16)] == [1, 3, 6, 7, 8]
    assert [devices.threads_per_worker(c, w) for c, w in ((16, 8), (2, 2), (2, 8), (None, 1))] == [
        2,
        1,
        1,
        1,
    ]
    assert devices.placement_text(8, ["0", "1"]) == (
        "8 workers over 2 GPUs (CUDA_VISIBLE_DEVICES 0, 1), 4 on each"
    )
    assert devices.placement_text(1, ["0", "1"]) == "1 worker over 1 GPU (CUDA_VISIBLE_DEVICES 0)"
    assert devices.placement_text(3, ["0", "1"]).endswith("GPUs (CUDA_VISIBLE_DEVICES 0, 1)")


# ---- the stage, as a user and a bisect run it ---------------------------------------------------


@pytest.mark.slow
def test_a_cuda_selection_without_a_gpu_stops_a_bisect(tmp_path):
    run = run_stage(tmp_path, "--gates", "-k", forward_gate_id("cuda"))
    assert run.returncode == exitcodes.ENV_BROKEN, run.stdout + run.stderr
    assert ALL_PASSED not in run.stdout + run.stderr
    assert "every selected gate (1) was skipped" in run.stderr
    rec = record(tmp_path)
    assert rec["outcome"] == "gates-skipped-need-gpu" and rec["gates"]["ran"] == 0
    assert rec["provenance"]["commit"]["sha"] == provenance.commit()["sha"]


@pytest.mark.slow
def test_a_selection_without_gates_is_no_verdict(tmp_path):
    # A test of this very module, collected alone (a path under tests/ narrows the collection):
    # fast, and never a gate.
    only = "test_outcome_of_a_session and no-gates-selected"
    run = run_stage(tmp_path, THIS_FILE, "-k", only)
    assert run.returncode == exitcodes.ENV_BROKEN, run.stdout + run.stderr
    assert ALL_PASSED not in run.stdout + run.stderr
    assert "1 test passed; no gate selected" in run.stderr and "--no-gates-ok" in run.stderr
    rec = record(tmp_path)
    assert rec["outcome"] == "no-gates-selected" and rec["tests"]["passed"] == 1
    assert rec["selection"]["keyword"] == only
    assert THIS_FILE in rec["selection"]["args"] and "tests" not in rec["selection"]["args"]
    run = run_stage(tmp_path, THIS_FILE, "-k", only, "--no-gates-ok")
    assert run.returncode == exitcodes.OK, run.stdout + run.stderr
    assert ALL_PASSED not in run.stdout


@pytest.mark.slow
def test_a_selection_that_matches_nothing_is_no_tests_collected(tmp_path):
    (tmp_path / gate_plugin.RECORD).write_text('{"outcome": "passed"}')  # an older run's record
    run = run_stage(tmp_path, THIS_FILE, "-k", "no_such_test_anywhere")
    assert run.returncode == exitcodes.ENV_BROKEN, run.stdout + run.stderr
    assert "no tests collected: -k 'no_such_test_anywhere' matched nothing" in run.stderr
    assert "--list" in run.stderr
    rec = record(tmp_path)
    assert (rec["outcome"], rec["pytest_exit"]) == ("no-tests-collected", 5)


@pytest.mark.slow
def test_pytest_that_cannot_start_is_no_verdict(tmp_path):
    run = run_stage(tmp_path, "--gates", "--no-such-pytest-option")
    assert run.returncode == exitcodes.ENV_BROKEN, run.stdout + run.stderr
    assert "pytest exited 4 (usage error); no verdict on this commit" in run.stderr
    rec = record(tmp_path)
    assert (rec["outcome"], rec["pytest_exit"]) == ("error", 4) and rec["provenance"]


STRAY_PLUGIN = """
import os

def pytest_configure(config):
    with open(os.environ["STRAY_MARK"], "a") as f:
        f.write("loaded\\n")
"""


@pytest.mark.slow
def test_listed_ids_are_what_k_selects_and_the_stage_runs_without_stray_plugins(tmp_path):
    """Four stage runs, one each for what other tests would each run again (3 to 5 CPU-s a run on
    2 cores): `--list --all` gives unique ids, and without a GPU `--list` the CPU ones and a count
    of those it hid; `--list -k ID` gives that id alone; the gate it names runs in the stage's own
    process, and a pytest plugin installed in the interpreter (an entry point, as pytest-benchmark's
    is), which a plain pytest run loads, stays out of the stage's run."""
    everything = run_stage(tmp_path, "--list", "--all")
    assert everything.returncode == 0, everything.stderr
    gate_ids = everything.stdout.split()
    assert len(gate_ids) == len(set(gate_ids)) > 10
    assert all(i.endswith(("-cpu", "-cuda")) for i in gate_ids)
    assert {forward_gate_id("cpu"), forward_gate_id("cuda")} <= set(gate_ids)  # the other tests'
    assert "not listed" not in everything.stderr

    here = run_stage(tmp_path, "--list")
    assert here.returncode == 0, here.stderr
    ids = here.stdout.split()
    assert ids and all(i.endswith("-cpu") for i in ids)
    cuda = [i for i in gate_ids if i.endswith("-cuda")]
    assert cuda and sorted(ids + cuda) == sorted(gate_ids)
    assert (
        f"test: {len(cuda):,} of {len(gate_ids):,} ids not listed: they need a GPU and "
        "this machine has none (`--list --all` lists them)"
    ) in here.stderr

    one = forward_gate_id("cpu")
    narrowed = run_stage(tmp_path, "--list", "-k", one)
    assert narrowed.stdout.split() == [one]
    assert not (tmp_path / gate_plugin.RECORD).exists()  # --list runs nothing

    # the stray plugin is real: plain pytest loads it
    site = tmp_path / "site"
    (site / "stray_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "stray_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: stray-plugin\nVersion: 1.0\n"
    )
    (site / "stray_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        "[pytest11]\nstray = stray_plugin\n"
    )
    (site / "stray_plugin.py").write_text(textwrap.dedent(STRAY_PLUGIN))
    mark = tmp_path / "mark"
    path = os.pathsep.join([str(tmp_path), str(site), str(REPO_ROOT)])
    plain = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-k", "x"],
        cwd=site,
        env={
            k: v
            for k, v in stage_env(tmp_path / "plain", PYTHONPATH=path, STRAY_MARK=str(mark)).items()
            if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"  # set for this suite by the stage itself
        },
        capture_output=True,
    )
    assert mark.exists(), plain.stdout
    mark.unlink()

    # a plugin that says which process ran pytest: the stage's own, a child of this test
    (tmp_path / "whoran.py").write_text(
        "import os\n\ndef pytest_sessionfinish(session):\n"
        f"    open({str(tmp_path / 'ran')!r}, 'w').write(str(os.getppid()))\n"
    )
    run = run_stage(
        tmp_path, "--gates", "-k", one, "-p", "whoran", PYTHONPATH=path, STRAY_MARK=str(mark)
    )
    assert run.returncode == exitcodes.OK, run.stdout + run.stderr
    assert "all gates passed (1 of 1)" in run.stdout
    assert " -n 0 " in run.stdout  # one case: no pytest-xdist workers to start
    # nor a second process: the stage, which collected the selection already, runs it itself
    assert "(1 tests: this process, no worker start-up)" in run.stdout
    assert "warning" not in run.stdout, "the gate plugin, imported already, is not a warning"
    assert (tmp_path / "ran").read_text() == str(os.getpid())
    assert not mark.exists(), "the interpreter's plugin stayed out of the stage's run"
    rec = record(tmp_path)
    assert rec["outcome"] == "passed" and rec["tests"]["selected"] == 1
    assert rec["cases"][0]["case_id"] + "-cpu" == one


SLOW_AFTER_A_FAILURE = """
import time

def test_fails():
    assert 1 + 1 == 3, "planted failure"

def test_runs_on():
    time.sleep(120)
"""
FAILURE_DEADLINE_S = 30  # the failure comes in well under a second; the run goes on for 120 s


def first_line_with(stream, text: str, deadline_s: float) -> tuple[str | None, list[str]]:
    """The first line of `stream` that holds `text`, read for at most `deadline_s` (None if it
    did not come by then), and the lines read until then."""
    seen: list[str] = []
    found: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            seen.append(line)
            if text in line:
                found.put(line)
                return

    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=deadline_s), seen
    except queue.Empty:
        return None, seen


def test_a_failure_is_named_before_the_run_ends(tmp_path):
    """A run cut short by a time limit (a CI step's, a GPU lease's) never reaches pytest's summary:
    the stage's command must print each failure when it happens (pytest-instafail), and its
    output must not wait in a buffer: the stage's stdout is a pipe, where Python holds output
    back unless told not to (testing.isolated_env). Run from an environment without
    PYTHONUNBUFFERED, as CI's is."""
    assert testing.report_plugins(), "pytest-instafail is in the test dependency group"
    (tmp_path / "test_slow.py").write_text(SLOW_AFTER_A_FAILURE)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *testing.report_plugins(),
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen(
        [*cmd, "test_slow.py"],
        cwd=tmp_path,
        env=testing.isolated_env(base),
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            line, seen = first_line_with(proc.stdout, "planted failure", FAILURE_DEADLINE_S)
            assert line, f"no failure printed within {FAILURE_DEADLINE_S} s: {''.join(seen)!r}"
            assert proc.poll() is None, "the failure must be printed while the run goes on"
        finally:
            proc.kill()


HANGS = """
import os, subprocess, sys

from flashmoe_science.pipeline.gates import timelimit

CHILD = (
    "from flashmoe_science.pipeline.gates.timelimit import watch_as_child\\n"
    "watch_as_child()\\n"
    "import time\\n"
    "def sleeps_in_the_child():\\n"
    "    time.sleep(600)\\n"
    "sleeps_in_the_child()\\n"
)

def test_passes():
    pass

def test_hangs_in_a_call():
    env, fds = timelimit.child_watch()
    subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env}, pass_fds=fds)
"""
HANG_LIMIT_S = 10.0  # time for two workers to start and begin both tests on a loaded 2-core CI


@pytest.mark.slow
def test_a_run_past_the_time_limit_names_the_tests_it_is_stuck_in(tmp_path, capfd):
    """A run on workers that hangs stops at the stage's limit (timelimit.py) with the hung test
    named by the controller and in the record, and its worker's stack printed, and the stack of
    the child process it waits on (as a planted-bug test's gate script); it does not wait for the
    test. Slow (~11 s, mostly asleep): the one test that stops real pytest-xdist workers."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        'pytest_plugins = ("flashmoe_science.pipeline.gates.plugin",)\n'
    )
    (suite / "test_hang.py").write_text(HANGS)
    reports = tmp_path / "reports"
    env = stage_env(
        reports, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **{timelimit.LIMIT_VAR: f"{HANG_LIMIT_S:g}"}
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "2", "-q"]
    start = time.monotonic()
    rc = timelimit.run([*cmd, "-p", "no:cacheprovider", str(suite)], suite, env, HANG_LIMIT_S)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert rc == 2
    assert took < HANG_LIMIT_S + timelimit.GRACE_S / 2, (
        "the controller exits once it has named them"
    )
    hung = "test_hang.py::test_hangs_in_a_call"
    assert f"still running at the time limit: {hung} (for " in err, err
    # the worker's stack (faulthandler) names the function beside the controller's line, and so
    # does the child's it handed the limit to (the two dumps may interleave, a name is one write)
    assert err.count("test_hangs_in_a_call") >= 2, err
    assert "sleeps_in_the_child" in err, err
    rec = record(reports)
    assert rec["outcome"] == "interrupted" and rec["pytest_exit"] == 2
    assert (
        f"ran out ({HANG_LIMIT_S:g} s, {timelimit.LIMIT_VAR}) with 1 test still running: "
        in (rec["reason"])
    )
    assert hung in rec["reason"] and rec["tests"]["passed"] == 1


class StageClock:
    """testing.time's stand-in: monotonic() reads `now`, which the stage's fake build moves on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("build_s", [100.0, 500.0])
def test_the_time_limit_counts_the_stages_own_build(monkeypatch, tmp_path, capsys, build_s):
    """The limit is the stage's: a build inside it (nothing to do after a build step; minutes when
    it compiles, as a stage under a define once did beside its build step's library) comes out of
    it, so the limit set inside a CI step's timeout still fires first. Where the build spent it
    all, the stage stops before starting pytest, with a record and a line saying what to do."""
    from flashmoe_science.pipeline.build import unit

    clock = StageClock()
    monkeypatch.setattr(testing, "time", clock)
    monkeypatch.setattr(unit, "build", lambda config: setattr(clock, "now", clock.now + build_s))
    runs = []
    monkeypatch.setattr(
        testing, "run_command", lambda cmd, env, limit, spent: runs.append((limit, spent)) or 0
    )
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path))
    monkeypatch.setenv(timelimit.LIMIT_VAR, "450")
    monkeypatch.delenv("FLASHMOE_REQUIRE_GPU", raising=False)
    code = testing.main([])
    if build_s < 450:
        assert runs == [(450.0, build_s)]
        return
    assert runs == [] and code == exitcodes.ENV_BROKEN
    said = (
        "the stage's time limit ran out (450 s, FLASHMOE_TEST_TIME_LIMIT) before its tests started"
    )
    assert said in capsys.readouterr().err
    rec = record(tmp_path)
    assert rec["outcome"] == "interrupted" and rec["reason"].startswith(said)
    assert "took 500 s; build first (python -m flashmoe_science build)" in rec["reason"]


def test_a_child_takes_its_workers_descriptor_and_passes_it_no_further(monkeypatch):
    """watch_as_child registers the stack dump on the descriptor child_watch named and drops the
    variable, so a process the child starts (which does not hold that descriptor, whose number may
    name another file there) registers nothing."""
    import faulthandler

    read, write = os.pipe()
    try:
        monkeypatch.setenv(timelimit.STACK_FD_VAR, str(write))
        timelimit.watch_as_child()
        assert timelimit.STACK_FD_VAR not in os.environ
        os.kill(os.getpid(), timelimit.SIGNAL)  # the dump, not the signal's default end
        assert b"test_a_child_takes_its_workers_descriptor" in os.read(read, 65536)
    finally:
        faulthandler.unregister(timelimit.SIGNAL)
        os.close(read)
        os.close(write)


def test_the_limits_wait_is_what_the_stage_has_left(tmp_path, capfd):
    """timelimit.run waits the limit less what the stage spent before it, and says so."""
    child = [sys.executable, "-c", "import time; time.sleep(600)"]
    start = time.monotonic()
    assert timelimit.run(child, tmp_path, dict(os.environ), 60.0, spent=59.5) == 2
    assert time.monotonic() - start < 10
    assert f"ran out (60 s, {timelimit.LIMIT_VAR}; 60 s of it before the tests started)" in (
        capfd.readouterr().err
    )


SESSION_PARENT = """
import os, sys
from pathlib import Path
from flashmoe_science.pipeline.gates import timelimit

child = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
sys.exit(timelimit.run([sys.executable, "-c", child], Path("."), dict(os.environ), 600))
"""


def test_sigterm_to_the_stage_takes_pytests_session_down_with_it(tmp_path):
    """pytest runs in a session of its own under the time limit, out of reach of a signal to the
    stage's process group: a cancelled CI step's SIGTERM to the stage must still end it, or a
    worker would hold the runner's GPU after the job."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with subprocess.Popen(
        [sys.executable, "-c", SESSION_PARENT],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as stage:
        child = int(stage.stdout.readline())
        stage.terminate()
        assert stage.wait(timeout=30) == 143
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        pytest.fail("the stage exited and left its pytest session running")


def test_a_session_inside_a_test_leaves_the_processs_watch_in_place():
    """A pytest session run by a test inside a worker loads the gate plugin with the limit in its
    environment: its Watch must neither replace the worker's handler nor, at its end, remove it."""
    import signal

    before = signal.getsignal(timelimit.SIGNAL)
    outer = timelimit.Watch(False, lambda: None)
    outer.install()
    try:
        assert signal.getsignal(timelimit.SIGNAL) == outer._handle
        inner = timelimit.Watch(False, lambda: None)
        inner.install()
        assert signal.getsignal(timelimit.SIGNAL) == outer._handle
        inner.uninstall()
        assert signal.getsignal(timelimit.SIGNAL) == outer._handle
    finally:
        outer.uninstall()
    assert signal.getsignal(timelimit.SIGNAL) == before and timelimit.Watch.active is None


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_time_limit_that_is_not_a_positive_number_is_refused_in_one_line(value):
    with pytest.raises(timelimit.LimitError) as raised:
        timelimit.limit_from_env({timelimit.LIMIT_VAR: value})
    message = str(raised.value)
    assert "\n" not in message and repr(value) in message and "positive number" in message
    assert timelimit.limit_from_env({timelimit.LIMIT_VAR: " 450 "}) == 450.0
    assert timelimit.limit_from_env({timelimit.LIMIT_VAR: ""}) is None
    assert timelimit.limit_from_env({}) is None


def test_the_reason_names_the_longest_running_tests_first_and_counts_the_rest():
    running = {f"t::{n}": 100.0 + n for n in range(7)}  # t::0 started first
    lines = timelimit.running_text(running, now=200.0)
    assert lines[0] == "t::0 (for 100 s)" and lines[-1] == "t::6 (for 94 s)"
    text = timelimit.reason("450", lines)
    assert "with 7 tests still running: t::0 (for 100 s)" in text and "; and 2 more" in text
    assert "t::5" not in text and "no test running" in timelimit.reason("450", [])


def test_commands_write_each_line_as_it_comes():
    """`python -m flashmoe_science` writes each line when it is printed, also into a pipe, where
    Python would otherwise hold output back until the command ends: a stage stopped by a time
    limit still shows its progress, in order with stderr. Run without PYTHONUNBUFFERED."""
    script = (
        "import time; from flashmoe_science.__main__ import main; main(['--help']); "
        "print('a line, then a long wait'); time.sleep(120)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            line, seen = first_line_with(proc.stdout, "a long wait", FAILURE_DEADLINE_S)
            assert line, f"nothing printed within {FAILURE_DEADLINE_S} s: {''.join(seen)!r}"
        finally:
            proc.kill()


def test_the_stage_runs_pytest_with_the_report_plugins():
    cmd = testing.pytest_command(["tests"], "4", ["-k", "x"])
    assert cmd[cmd.index("--instafail") - 2 : cmd.index("--instafail")] == [
        "-p",
        "pytest_instafail",
    ]
    assert cmd[-9:] == [
        *("-n", "4", "--dist", "worksteal", "-q"),
        *("--durations=20", "--durations-min=5", "-k", "x"),
    ]
    serial = testing.pytest_command(["tests"], "0", [])
    assert "--dist" not in serial and serial[serial.index("-n") + 1] == "0"


def test_only_the_whole_suite_goes_to_the_workers_uncollected():
    """The stage collects a selection before it runs it, to run a small one in its own process;
    the whole suite (or every gate) is known to be large and skips that collection."""
    assert testing.is_whole_suite(None, [], ["--durations=80", "-x", "--long"])
    assert not testing.is_whole_suite("fwd-fp16", [], [])
    assert not testing.is_whole_suite(None, ["tests/bench/"], [])
    for narrowing in (["-m", "gpu"], ["-mgpu"], ["--deselect", "tests/x.py::t"], ["--lf"]):
        assert not testing.is_whole_suite(None, [], narrowing), narrowing


def test_a_selection_is_collected_once_and_runs_here_only_when_small():
    """The stage's one session for a selection (-k, paths): at most SERIAL_MAX_TESTS tests run in
    it, announced before pytest's output; a larger selection runs nothing there and shows nothing
    (workers run it); one whose collection failed runs there, where pytest says why."""

    class Session:
        def __init__(self, tests: int, errors: int = 0):
            self.items, self.testsfailed = [object()] * tests, errors

    limit = testing.SERIAL_MAX_TESTS
    for tests, errors, runs_here in ((limit, 0, True), (limit + 1, 0, False), (limit + 1, 1, True)):
        shown, said = io.StringIO(), []
        output = testing.HeldOutput(shown)
        small = testing.SmallRun(limit, output, said.append)
        output.write("pytest's first lines\n")
        session = Session(tests, errors)
        small.pytest_collection_finish(session)
        output.write("the run\n")
        assert small.too_many is not runs_here and len(session.items) == (tests if runs_here else 0)
        assert said == ([None if errors else tests] if runs_here else [])
        assert shown.getvalue() == ("pytest's first lines\nthe run\n" if runs_here else "")


def test_gates_take_no_paths(capsys):
    """`--gates` collects the gate modules itself: a path beside it would be dropped silently."""
    with pytest.raises(SystemExit) as stop:
        testing.main(["--gates", "tests/bench/", "-k", "x"])
    assert stop.value.code == 2
    assert "leave out tests/bench/" in capsys.readouterr().err


def test_the_plants_of_a_device_share_one_build_even_where_the_job_asks_for_cuda(monkeypatch):
    """A CPU-device plant builds the small CPU unit with every plant in it (the bug picked at run
    time), not a whole CUDA unit per bug because the GPU job sets TORCH_CUDA_ARCH_LIST; the
    CUDA-device plants share one CUDA unit with every plant in it, for the job's targets, whole
    (a restriction the test run has is not inherited)."""
    from conftest import planted_process_env

    from flashmoe_science import _loader as loader

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv(loader.ONLY_VAR, "op=paged")
    monkeypatch.delenv(loader.DEFINES_VAR, raising=False)  # a run under a define has one set
    for device in ("cpu", "cuda"):
        envs = {
            bug: planted_process_env(bug, device, ("fwd-bf16-d64-h8-b2-s257-full",))
            for bug in (4, 9)
        }
        assert {env["FLASHMOE_BUILD_DEFINES"] for env in envs.values()} == {loader.PLANT_DEFINE}
        assert [env["FLASHMOE_PLANT_BUG"] for env in envs.values()] == ["4", "9"]
        assert all(loader.ONLY_VAR not in env for env in envs.values())
    cpu = planted_process_env(4, "cpu")
    assert "TORCH_CUDA_ARCH_LIST" not in cpu and cpu["CUDA_VISIBLE_DEVICES"] == ""
    cuda = planted_process_env(4, "cuda")
    assert cuda["TORCH_CUDA_ARCH_LIST"] == "9.0a"
    assert cuda.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    honest = planted_process_env(0, "cpu")
    assert "FLASHMOE_BUILD_DEFINES" not in honest and honest["TORCH_CUDA_ARCH_LIST"] == "9.0a"


def test_a_stage_under_a_switch_plants_into_the_kernels_it_gates(monkeypatch):
    """Under FLASHMOE_BUILD_DEFINES (an experiment's switch) the plant build keeps the stage's
    defines, so its plants act on the kernels the stage gates; a define a test names replaces the
    environment's of the same name, and the plant define comes last."""
    from conftest import planted_process_env

    from flashmoe_science import _loader as loader

    monkeypatch.setenv(loader.DEFINES_VAR, "FLASHMOE_BWD_WS=1,FLASHMOE_BWD_WS_DQ_STAGES=2")
    env = planted_process_env(6, "cuda")
    assert env[loader.DEFINES_VAR] == (
        "FLASHMOE_BWD_WS=1,FLASHMOE_BWD_WS_DQ_STAGES=2," + loader.PLANT_DEFINE
    )
    env = planted_process_env(6, "cuda", defines=("-DFLASHMOE_BWD_WS_DQ_STAGES=1", "X"))
    assert env[loader.DEFINES_VAR] == (
        "FLASHMOE_BWD_WS=1,FLASHMOE_BWD_WS_DQ_STAGES=1,X," + loader.PLANT_DEFINE
    )
    honest = planted_process_env(0, "cuda")  # the stage's own build, its defines untouched
    assert honest[loader.DEFINES_VAR] == "FLASHMOE_BWD_WS=1,FLASHMOE_BWD_WS_DQ_STAGES=2"
