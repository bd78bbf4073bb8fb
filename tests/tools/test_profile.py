"""`python -m flashmoe_science profile CASE`: the raw-page CSV parser and the decision tree on sample
Nsight Compute output, the ncu command line, the exit codes (bad case, no GPU, ncu missing or not
permitted) and the driver with a stand-in ncu, all on the CPU; then, on a GPU, a real profile."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashmoe_science.pipeline import exitcodes
from flashmoe_science.pipeline.bench import run as bench
from flashmoe_science.pipeline.paths import REPO_ROOT
from flashmoe_science.pipeline.tools import profile

PREFILL_ID = "fwd-bf16-d128-h16-b1-s16384-causal"
DECODE_ID = "dec-bf16-d128-h32-b1-q1-k131072"
FWD_NAME = (
    "void flashmoe::cuda::flash_fwd_kernel<flashmoe::cuda::FwdTraits<128, 128, 32, 4>, "
    "__nv_bfloat16>(flashmoe::AttentionParams)"
)
DEC_NAME = (
    "void flashmoe::cuda::flash_fwd_kernel<flashmoe::cuda::FwdTraits<128, 64, 64, 4>, "
    "__nv_bfloat16>(flashmoe::AttentionParams)"
)
COMBINE_NAME = (
    "void flashmoe::cuda::split_kv_combine_kernel<__nv_bfloat16, 128>(const float *, const float "
    "*, __nv_bfloat16 *, float *, int, long)"
)
COLUMNS = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","device__attribute_display_name",'
    '"device__attribute_multiprocessor_count","dram__bytes_read.sum","dram__bytes_write.sum",'
    '"dram__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum",'
    '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",'
    '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum","launch__block_size",'
    '"launch__grid_size","launch__occupancy_limit_blocks","launch__occupancy_limit_registers",'
    '"launch__occupancy_limit_shared_mem","launch__occupancy_limit_warps",'
    '"launch__registers_per_thread","launch__waves_per_multiprocessor",'
    '"sm__maximum_warps_per_active_cycle_pct","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"sm__warps_active.avg.pct_of_peak_sustained_active",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",'
    '"smsp__pcsamp_warps_issue_stalled_barrier"'
)
UNITS = (
    '"","","","","","","","","","","","","","byte","byte","%","%","nsecond","","","","","block",'
    '"block","block","block","register/thread","","%","%","%","","","","","","","","","warp"'
)
HEAD = "gpu-node-7"
DEVICE = '"0","9.0","NVIDIA H100 80GB HBM3","132"'

# ncu 2025.x: `ncu --import R --csv --page raw --print-units base` of a causal 16k prefill: one
# launch of the forward kernel (no split: 16 heads x 128 row blocks fill the GPU).
PREFILL_CSV = f"""\
==PROF== Connected to process 41234 (/usr/bin/python3.11)
==WARNING== Backing up device memory in system memory. Kernel replay might be slow.
{COLUMNS}
{UNITS}
"0","41234","python3.11","{HEAD}","{FWD_NAME}","1","7","(128, 1, 1)","(16, 128, 1)",{DEVICE},"251,658,240","67,108,864","1.83","38.12","5,212,736","0","2,097,152","128","2,048","32","1","3","16","255","15.52","6.25","41.27","6.21","1.21","4.52","0.05","2.87","0.41","0.33","0.72","0.61","12,345"
"""

# A 128k-token decode: the forward kernel split along the cache, then the combine kernel (the two
# launches ncu profiles).
DECODE_CSV = f"""\
{COLUMNS}
{UNITS}
"0","52001","python3.11","{HEAD}","{DEC_NAME}","1","7","(128, 1, 1)","(32, 1, 8)",{DEVICE},"2,147,876,864","1,310,720","86.9","86.9","803,200","0","131,072","128","256","32","2","3","16","175","0.97","12.50","14.1","11.6","0.12","9.87","0.01","0.35","0.02","0.09","0.21","0.44","7"
"1","52001","python3.11","{HEAD}","{COMBINE_NAME}","1","7","(128, 1, 1)","(8, 1, 1)",{DEVICE},"1,048,576","8,192","0.91","1.85","4,128","0","0","128","8","32","16","16","16","32","0.03","100","2.20","1.04","0.02","3.17","0","0","0.01","0.45","1.10","0.80",""
"""


# --------------------------------------------------------------------------------------------------
# Parsing and figures
# --------------------------------------------------------------------------------------------------


def test_parse_ncu_csv_reads_names_units_and_numbers():
    (launch,) = profile.parse_ncu_csv(PREFILL_CSV)
    assert launch["kernel"] == "flash_fwd_kernel<FwdTraits<128, 128, 32, 4>, __nv_bfloat16>"
    assert launch["name"] == FWD_NAME
    metrics = launch["metrics"]
    assert metrics["gpu__time_duration.sum"] == 5_212_736  # nanoseconds
    assert metrics["dram__bytes_read.sum"] == 251_658_240
    assert metrics["launch__occupancy_limit_registers"] == 1
    assert metrics["device__attribute_multiprocessor_count"] == 132
    assert "Kernel Name" not in metrics and "Grid Size" not in metrics


def test_parse_ncu_csv_scales_units_to_base():
    text = '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes.sum.per_second"\n'
    text += '"","","usecond","Mbyte","Gbyte/second"\n'
    text += '"0","k(int)","1.50","2.5","3,000.5"\n'
    (launch,) = profile.parse_ncu_csv(text)
    assert launch["metrics"]["gpu__time_duration.sum"] == pytest.approx(1500)
    assert launch["metrics"]["dram__bytes_read.sum"] == pytest.approx(2.5e6)
    assert launch["metrics"]["dram__bytes.sum.per_second"] == pytest.approx(3000.5e9)


def test_parse_ncu_csv_without_kernels():
    assert (
        profile.parse_ncu_csv("==PROF== Disconnected\n==WARNING== No kernels were profiled.\n")
        == []
    )


def test_top_stalls_and_occupancy_limiter():
    (launch,) = profile.parse_ncu_csv(PREFILL_CSV)
    metrics = launch["metrics"]
    # 'selected' is issuing, not a stall; the per-issue family wins over the sampled one
    assert profile.top_stalls(metrics) == [
        ("long_scoreboard", 4.52),
        ("mio_throttle", 2.87),
        ("barrier", 1.21),
    ]
    limiter, limits = profile.occupancy_limiter(metrics)
    assert limiter == "registers"
    assert limits == {"registers": 1, "shared_mem": 3, "blocks": 32, "warps": 16}
    assert profile.occupancy_limiter({})[0] is None
    tie = {"launch__occupancy_limit_registers": 2, "launch__occupancy_limit_shared_mem": 2}
    assert profile.occupancy_limiter(tie)[0] == "registers and shared memory"
    tie["launch__occupancy_limit_warps"] = 2
    assert profile.occupancy_limiter(tie)[0] == "registers, shared memory and warps per SM"


CEILINGS = {"copy": {"gbps": 2900.0}, "matmul": {"tflops": 620.0}}


def test_prefill_summary_is_latency_bound_on_registers():
    case = bench.parse_case_id(PREFILL_ID)
    summary = profile.summarize(profile.parse_ncu_csv(PREFILL_CSV), case, CEILINGS, None)
    (fwd,) = summary["kernels"]
    assert fwd["time_us"] == pytest.approx(5212.736)
    assert fwd["tflops"] == pytest.approx(case.flops / 5.212736e-3 / 1e12)
    assert fwd["pct_matmul_ceiling"] == pytest.approx(100 * fwd["tflops"] / 620)
    assert fwd["dram_gbps"] == pytest.approx((251_658_240 + 67_108_864) / 5.212736e-3 / 1e9)
    assert fwd["sm_count"] == 132  # from the raw page when torch is not asked
    assert fwd["verdict"]["bound"] == "latency"
    assert "limited by registers" in fwd["verdict"]["lever"]
    assert "long_scoreboard" in fwd["verdict"]["lever"]
    assert summary["call"]["tflops"] == pytest.approx(fwd["tflops"])
    lines = profile.format_kernel(fwd)
    assert lines[0] == "  flash_fwd_kernel<FwdTraits<128, 128, 32, 4>, __nv_bfloat16>"
    assert lines[1] == (
        "    time 5.21 ms; 211 TFLOP/s (34% of matmul ceiling); DRAM 61.2 GB/s (2.1% of copy "
        "ceiling, 1.8% of peak); SM throughput 41%"
    )
    assert (
        "limited by registers (blocks/SM: registers 1, shared_mem 3, blocks 32, warps 16)"
        in lines[2]
    )
    assert lines[3] == "    shared-memory bank conflicts: 0 on loads, 2.1e+06 on stores"
    assert lines[4] == (
        "    top stalls (cycles per issued instruction): long_scoreboard 4.52, mio_throttle 2.87, "
        "barrier 1.21"
    )
    assert lines[5].startswith("    verdict: latency-bound (")


def test_the_l2s_throughput_and_bytes_by_operation_where_the_report_has_them():
    """The L2's figures come from the report's sections (no metric asked for by name that an ncu
    could refuse): all sources' sectors where present, else the SMs' (srcunit_tex), 32 bytes
    each; the summary line says them, and a report without them leaves the line out."""
    metrics = {
        "gpu__time_duration.sum": 1e6,
        "lts__throughput.avg.pct_of_peak_sustained_elapsed": 84.2,
        "lts__t_sectors_op_read.sum": 4e6,
        "lts__t_sectors_srcunit_tex_op_read.sum": 1.0,  # the all-sources count wins
        "lts__t_sectors_srcunit_tex_op_red.sum": 2e6,
    }
    assert profile.l2_figures(metrics) == (84.2, {"read": 128e6, "red": 64e6})
    assert profile.l2_figures({"gpu__time_duration.sum": 1.0}) == (None, {})
    launch = {"kernel": "flash_bwd_sm90_wide_block", "name": "k", "metrics": metrics}
    fig = profile.kernel_figures([launch], None, CEILINGS, 132)
    fig["verdict"] = profile.classify_bound(fig)
    lines = profile.format_kernel(fig)
    assert "    L2 84% of peak; by operation: read 128 MB, red 64 MB" in lines
    summary = profile.summarize(
        profile.parse_ncu_csv(PREFILL_CSV), bench.parse_case_id(PREFILL_ID), CEILINGS, None
    )
    assert not [line for line in profile.format_kernel(summary["kernels"][0]) if "L2" in line]


def test_decode_summary_memory_then_launch():
    case = bench.parse_case_id(DECODE_ID)
    summary = profile.summarize(profile.parse_ncu_csv(DECODE_CSV), case, CEILINGS, 132)
    fwd, combine = summary["kernels"]
    assert fwd["kernel"].startswith("flash_fwd_kernel") and fwd["tflops"] is not None
    assert fwd["pct_copy_ceiling"] == pytest.approx(
        100 * (2_147_876_864 + 1_310_720) / 803.2e-6 / 1e9 / 2900
    )
    assert fwd["verdict"]["bound"] == "memory" and "of the copy ceiling" in fwd["verdict"]["why"]
    assert combine["kernel"] == "split_kv_combine_kernel<__nv_bfloat16, 128>"
    assert combine["tflops"] is None  # the case's FLOPs belong to the forward kernel
    assert combine["verdict"]["bound"] == "launch"
    assert summary["call"]["time_us"] == pytest.approx(803.2 + 4.128)


def _fig(**values) -> dict:
    base = {
        "time_us": 500.0,
        "waves": 4.0,
        "grid_blocks": 1056,
        "sm_count": 132,
        "pct_copy_ceiling": None,
        "dram_pct_of_peak": None,
        "sm_pct_of_peak": None,
        "pct_matmul_ceiling": None,
        "occupancy_limiter": None,
        "top_stalls": [],
    }
    return {**base, **values}


@pytest.mark.parametrize(
    "values, bound",
    [
        ({"time_us": 4.0, "waves": 0.06}, "launch"),
        ({"time_us": 4.0, "waves": None, "grid_blocks": 8}, "launch"),
        (
            {"time_us": 4.0, "waves": 3.0, "sm_pct_of_peak": 10},
            "latency",
        ),  # short but fills the GPU
        ({"time_us": 40.0, "waves": 0.06}, "latency"),  # long enough to amortise a launch
        ({"pct_copy_ceiling": 85, "sm_pct_of_peak": 20}, "memory"),
        ({"dram_pct_of_peak": 75}, "memory"),  # no ceiling: ncu's DRAM % of peak
        ({"pct_copy_ceiling": 30, "dram_pct_of_peak": 90}, "latency"),  # the ceiling wins
        ({"sm_pct_of_peak": 72, "pct_copy_ceiling": 10}, "compute"),
        ({"pct_matmul_ceiling": 65}, "compute"),
        ({"sm_pct_of_peak": 90, "pct_copy_ceiling": 70}, "compute"),  # both busy: the larger
        ({"sm_pct_of_peak": 65, "pct_copy_ceiling": 80}, "memory"),
        ({"sm_pct_of_peak": 40, "pct_copy_ceiling": 40}, "latency"),
        ({}, "latency"),
    ],
)
def test_decision_tree(values, bound):
    verdict = profile.classify_bound(_fig(**values))
    assert verdict["bound"] == bound
    assert verdict["lever"] and verdict["why"]


def test_latency_lever_names_the_limiter_and_the_top_stall():
    fig = _fig(occupancy_limiter="shared memory", top_stalls=[("barrier", 3.1), ("wait", 1.0)])
    lever = profile.classify_bound(fig)["lever"]
    assert lever.startswith("more work in flight: occupancy (limited by shared memory)")
    assert "fewer stalls on barrier (waiting at __syncthreads" in lever


def test_ncu_command():
    command = profile.ncu_command("/opt/ncu", PREFILL_ID, Path("/r/profile-x"))
    assert command[:4] == ["/opt/ncu", "--force-overwrite", "-o", "/r/profile-x"]
    assert (
        command[command.index("--kernel-name") + 1]
        == "regex:flash_fwd|flash_decode|split_kv|varlen_offsets"
    )
    skip = int(command[command.index("--launch-skip") + 1])
    count = int(command[command.index("--launch-count") + 1])
    calls = int(command[-1])
    # past the warm-up whether a call launches one kernel or two, and enough calls left to profile
    assert skip == profile.MAX_KERNELS_PER_CALL * profile.WARMUP_CALLS
    assert calls >= skip + count
    assert command[command.index("--clock-control") + 1] == "none"
    sections = [command[i + 1] for i, arg in enumerate(command) if arg == "--section"]
    assert {"SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats"} <= set(sections)
    metrics = command[command.index("--metrics") + 1].split(",")
    assert "gpu__time_duration.sum" in metrics
    assert "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum" in metrics
    assert command[-6:-2] == [
        "-m",
        "flashmoe_science.pipeline.tools.profile",
        "--workload",
        PREFILL_ID,
    ]
    assert profile.ncu_import_command("ncu", Path("r.ncu-rep")) == (
        ["ncu", "--import", "r.ncu-rep", "--csv", "--page", "raw", "--print-units", "base"]
    )


def test_ncu_command_against_a_baseline_profiles_the_nvtx_range_alone():
    command = profile.ncu_command("/opt/ncu", PREFILL_ID, Path("/r/p"), against="sdpa-cudnn")
    # a baseline's kernels have its own names, and its warm-up calls lie outside the range
    assert "--kernel-name" not in command and "--launch-skip" not in command
    assert "--launch-count" not in command
    # a start/end range (no trailing "/"): a backward call's kernels come from autograd's thread
    assert command[command.index("--nvtx-include") + 1] == profile.AGAINST_RANGE
    assert "--nvtx" in command and command[command.index("--clock-control") + 1] == "none"
    assert command[-6:-2] == ["--workload", PREFILL_ID, "--against", "sdpa-cudnn"]
    assert "--against" not in profile.ncu_command("/opt/ncu", PREFILL_ID, Path("/r/p"))


def _counting_sdpa(monkeypatch):
    """Wraps the baselines' sdpa_call: each call of its callable records whether it ran inside
    the profiled NVTX range."""
    from flashmoe_science.pipeline.bench import baselines

    inside, seen = [], []
    real = baselines.sdpa_call

    def counting(case, x):
        fn, why = real(case, x)
        if fn is None:
            return fn, why

        def call():
            seen.append(bool(inside))
            return fn()

        return call, why

    @contextlib.contextmanager
    def recording(name):
        assert name == profile.AGAINST_RANGE
        inside.append(name)
        yield
        inside.pop()

    monkeypatch.setattr(baselines, "sdpa_call", counting)
    monkeypatch.setattr(profile, "nvtx_range", recording)
    return seen


@pytest.mark.parametrize(
    "case_id", ["fwd-bf16-d64-h2-b1-s64-full", "bwd-bf16-d64-h2-b1-s64-causal"]
)
def test_the_workload_against_a_baseline_runs_its_last_call_alone_in_the_range(
    monkeypatch, case_id
):
    seen = _counting_sdpa(monkeypatch)
    assert profile.run_workload(case_id, 8, "sdpa-default", device="cpu") == exitcodes.OK
    # the first call (a backward case's forward among it) and the warm-up outside; one inside
    assert seen == [False] * 7 + [True]


def test_a_baseline_that_refuses_the_case_says_why_in_one_line(monkeypatch, capsys):
    seen = _counting_sdpa(monkeypatch)
    case_id = "fwd-bf16-d64-h2-b1-s64-full"
    assert profile.run_workload(case_id, 8, "sdpa-cudnn", device="cpu") == exitcodes.GATE_FAILED
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"profile: sdpa-cudnn cannot run {case_id}: ")
    assert seen == [False], "refused at its first call: nothing profiled"


def test_an_unknown_baseline_is_a_usage_error_naming_the_supported(capsys):
    assert profile.main([PREFILL_ID, "--against", "cudnn"]) == exitcodes.USAGE
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "--against 'cudnn' is not a baseline; supported: sdpa-flash, sdpa-cudnn" in line


def test_stored_ceilings_only_from_the_same_gpu(tmp_path):
    path = tmp_path / "bench.json"
    doc = {"gpu": {"name": "NVIDIA H100 80GB HBM3"}, "timestamp": "t", "ceilings": CEILINGS}
    path.write_text(json.dumps(doc))
    assert profile.stored_ceilings(path, "NVIDIA H100 80GB HBM3")["copy"]["gbps"] == 2900
    assert profile.stored_ceilings(path, "NVIDIA L4") is None
    assert profile.stored_ceilings(path, None) is not None  # --import: whatever is there
    assert profile.stored_ceilings(tmp_path / "missing.json", None) is None


@pytest.mark.parametrize(
    "text",
    [
        "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
        "Performance Counters on the target device 0.",
        "==ERROR== Failed to initialize the profiler.",
    ],
)
def test_not_permitted_is_recognised(text):
    assert profile.unusable_reason(f"==PROF== Connected to process 1\n{text}\n")


# --------------------------------------------------------------------------------------------------
# Exit codes and the driver, with a stand-in ncu
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path / "reports"))
    return tmp_path


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(profile, "_gpu", lambda: ("NVIDIA H100 80GB HBM3", 132))
    monkeypatch.setattr(bench, "build_checkout", lambda device: None)


def test_bad_case_is_a_usage_error(capsys):
    assert profile.main(["fwd-bf16-d128"]) == exitcodes.USAGE
    assert "bad case id" in capsys.readouterr().out


def test_no_gpu_exits_255_with_one_line(isolated, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile.main([PREFILL_ID]) == exitcodes.ENV_BROKEN
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no GPU" in out[0]


def test_missing_ncu_exits_126_with_one_line(
    isolated, fake_gpu, no_cuda_tools, monkeypatch, capsys
):
    monkeypatch.setattr(profile, "NCU_GLOBS", ())
    assert profile.main([PREFILL_ID]) == exitcodes.TOOL_MISSING
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "ncu) not found" in out[0]


FAKE_NCU = """\
#!/bin/sh
# Stands in for ncu: `--import R ...` prints $FAKE_DIR/import.csv; a profiling run writes
# <-o>.ncu-rep (unless $FAKE_DIR/profile.txt says otherwise) and prints $FAKE_DIR/profile.txt.
if [ "$1" = "--import" ]; then cat "$FAKE_DIR/import.csv"; exit 0; fi
echo "$@" > "$FAKE_DIR/args"
out=
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out=$2; fi
  shift
done
cat "$FAKE_DIR/profile.txt" 2>/dev/null
if [ -f "$FAKE_DIR/profile.rc" ]; then exit "$(cat "$FAKE_DIR/profile.rc")"; fi
echo report > "$out.ncu-rep"
"""


@pytest.fixture
def fake_ncu(isolated, monkeypatch):
    fake = isolated / "fake"
    (fake / "bin").mkdir(parents=True)
    ncu = fake / "bin" / "ncu"
    ncu.write_text(FAKE_NCU)
    ncu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for variable in ("CUDA_HOME", "CUDA_PATH"):  # a real toolkit there would come first
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FAKE_DIR", str(fake))
    return fake


def test_profile_writes_the_report_and_a_verdict(isolated, fake_gpu, fake_ncu, capsys):
    (fake_ncu / "import.csv").write_text(DECODE_CSV)
    reports = isolated / "reports"
    reports.mkdir()
    bench_doc = {"gpu": {"name": "NVIDIA H100 80GB HBM3"}, "timestamp": "t0", "ceilings": CEILINGS}
    (reports / "bench.json").write_text(json.dumps(bench_doc))
    assert profile.main([DECODE_ID]) == exitcodes.OK
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-3].startswith(f"profile: {DECODE_ID}: 807 us per call")
    assert "copy 2900 GB/s, matmul 620 TFLOP/s (bench.json (t0, NVIDIA H100 80GB HBM3))" in out[-3]
    assert out[-2].startswith(
        "  flash_fwd_kernel<FwdTraits<128, 64, 64, 4>, __nv_bfloat16>: memory-bound"
    )
    assert out[-1].startswith("  split_kv_combine_kernel<__nv_bfloat16, 128>: launch-bound")
    assert any(line.startswith("    verdict: memory-bound (DRAM ") for line in out)
    args = (fake_ncu / "args").read_text()
    assert f"-o {reports / ('profile-' + DECODE_ID)} " in args
    assert (reports / f"profile-{DECODE_ID}.ncu-rep").exists()
    doc = json.loads((reports / f"profile-{DECODE_ID}.json").read_text())
    assert doc["case"] == DECODE_ID and doc["flops"] == bench.parse_case_id(DECODE_ID).flops
    assert [k["verdict"]["bound"] for k in doc["kernels"]] == ["memory", "launch"]


def test_output_folder_and_import(isolated, fake_gpu, fake_ncu, capsys):
    (fake_ncu / "import.csv").write_text(PREFILL_CSV)
    out_dir = isolated / "elsewhere"
    assert profile.main([PREFILL_ID, "--output", str(out_dir), "--no-ceilings"]) == exitcodes.OK
    assert (out_dir / f"profile-{PREFILL_ID}.json").exists()
    (fake_ncu / "args").unlink()
    rep = out_dir / f"profile-{PREFILL_ID}.ncu-rep"
    assert (
        profile.main([PREFILL_ID, "--import", str(rep), "--output", str(out_dir)]) == exitcodes.OK
    )
    assert not (fake_ncu / "args").exists()  # nothing profiled again
    assert "latency-bound" in capsys.readouterr().out.strip().splitlines()[-1]


def test_counters_not_permitted_exit_126(isolated, fake_gpu, fake_ncu, capsys):
    (fake_ncu / "profile.txt").write_text(
        "==PROF== Connected to process 4242 (/usr/bin/python3.11)\n"
        "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
        "Performance Counters on the target device 0. For instructions on enabling permissions "
        "and to get more information see https://developer.nvidia.com/ERR_NVGPUCTRPERM\n"
        "==PROF== Disconnected from process 4242\n"
    )
    (fake_ncu / "profile.rc").write_text("1")
    assert profile.main([PREFILL_ID, "--no-ceilings"]) == exitcodes.TOOL_MISSING
    out = capsys.readouterr().out.strip().splitlines()
    assert "ERR_NVGPUCTRPERM" in out[-1] and sum("ERR_NVGPUCTRPERM" in ln for ln in out) == 1


def test_nothing_profiled_fails(isolated, fake_gpu, fake_ncu, capsys):
    (fake_ncu / "import.csv").write_text("==WARNING== No kernels were profiled.\n")
    assert profile.main([PREFILL_ID, "--no-ceilings"]) == exitcodes.GATE_FAILED
    assert "no kernel in" in capsys.readouterr().out


CUDNN_NAME = "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0"
DOT_NAME = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"
BASELINE_CSV = f"""\
{COLUMNS}
{UNITS}
"0","7001","python3.11","{HEAD}","{DOT_NAME}","1","7","(128, 1, 1)","(64, 1, 1)",{DEVICE},"0","1,048,576","20","20","6,000","0","0","128","64","32","16","16","16","32","0.1","100","2.20","1.04","0.02","3.17","0","0","0.01","0.45","1.10","0.80",""
"1","7001","python3.11","{HEAD}","{CUDNN_NAME}","1","7","(384, 1, 1)","(16, 16, 1)",{DEVICE},"167,772,160","33,554,432","2.1","40.2","400,000","0","1,048,576","384","256","32","1","1","8","168","1.94","18.75","17.9","45.0","1.30","2.10","0.05","1.10","0.40","0.35","0.60","0.80",""
"2","7001","python3.11","{HEAD}","{CUDNN_NAME}","1","7","(384, 1, 1)","(16, 16, 1)",{DEVICE},"167,772,160","33,554,432","2.1","40.2","410,000","0","1,048,576","384","256","32","1","1","8","168","1.94","18.75","17.9","45.0","1.30","2.10","0.05","1.10","0.40","0.35","0.60","0.80",""
"""


def test_profile_against_a_baseline_records_one_whole_call_beside_ours(
    isolated, fake_gpu, fake_ncu, capsys
):
    out_dir = isolated / "prof"
    (fake_ncu / "import.csv").write_text(BASELINE_CSV)
    args = [PREFILL_ID, "--against", "sdpa-cudnn", "--output", str(out_dir), "--no-ceilings"]
    assert profile.main(args) == exitcodes.OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert "--nvtx-include" in (fake_ncu / "args").read_text()
    assert lines[-1].startswith("profile: no profile of ours beside it") and "--output" in lines[-1]
    doc = json.loads((out_dir / f"profile-{PREFILL_ID}-sdpa-cudnn.json").read_text())
    assert doc["against"] == "sdpa-cudnn" and not (out_dir / f"profile-{PREFILL_ID}.json").exists()
    # one call: the fill once and the kernel that ran twice, every launch counted (816 us)
    assert doc["call"]["time_us"] == pytest.approx(816.0)
    # ours, then the baseline again: the two calls side by side
    (fake_ncu / "import.csv").write_text(PREFILL_CSV)
    assert profile.main([PREFILL_ID, "--output", str(out_dir), "--no-ceilings"]) == exitcodes.OK
    assert json.loads((out_dir / f"profile-{PREFILL_ID}.json").read_text())["against"] is None
    (fake_ncu / "import.csv").write_text(BASELINE_CSV)
    capsys.readouterr()
    assert profile.main(args) == exitcodes.OK
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("profile: ours 5.21 ms per call (our kernels,"), last
    assert last.endswith("sdpa-cudnn 816 us (every kernel of its call): sdpa-cudnn / ours 0.16x")


def test_cli_lists_the_command():
    from flashmoe_science.pipeline import cli

    assert cli.COMMANDS["profile"][0] == "flashmoe_science.pipeline.tools.profile"


# --------------------------------------------------------------------------------------------------
# On a GPU: a real profile of a small case
# --------------------------------------------------------------------------------------------------


def _real_profile(reports: Path, case_id: str, *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "flashmoe_science", "profile", case_id, "--no-ceilings", *args],
        cwd=REPO_ROOT,
        env=dict(os.environ, FLASHMOE_REPORTS_DIR=str(reports)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if run.returncode == exitcodes.TOOL_MISSING:
        pytest.skip(run.stdout.strip().splitlines()[-1])
    assert run.returncode == exitcodes.OK, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.gpu
@pytest.mark.slow
def test_real_profile_of_a_small_case_then_of_a_baseline_beside_it(tmp_path):
    case_id = "fwd-fp16-d64-h8-b1-s512-full"
    _real_profile(tmp_path, case_id)
    doc = json.loads((tmp_path / f"profile-{case_id}.json").read_text())
    # small grids run the 16-row decode kernel; larger ones the forward kernel
    (fwd,) = [
        k
        for k in doc["kernels"]
        if k["kernel"].startswith(("flash_fwd_kernel", "flash_decode_kernel"))
    ]
    assert fwd["time_us"] > 0 and fwd["tflops"] > 0 and fwd["occupancy_limiter"]
    assert fwd["top_stalls"] and fwd["verdict"]["bound"] in (
        "launch",
        "memory",
        "compute",
        "latency",
    )
    assert (tmp_path / f"profile-{case_id}.ncu-rep").exists()
    # ncu's NVTX filter on a real run (the syntax of --nvtx-include is ncu's to judge): SDPA's
    # flash kernel of one call, and the line that sets it beside ours
    run = _real_profile(tmp_path, case_id, "--against", "sdpa-flash")
    doc = json.loads((tmp_path / f"profile-{case_id}-sdpa-flash.json").read_text())
    assert any("flash" in k["kernel"].lower() for k in doc["kernels"]), doc["kernels"]
    assert all(k["launches"] == 1 for k in doc["kernels"]), "one call: one launch a kernel"
    assert "sdpa-flash / ours" in run.stdout.strip().splitlines()[-1]
    # a backward call: its kernels are launched by autograd's device thread, outside a push/pop
    # range of the caller's (which profiled none of them)
    backward = "bwd-bf16-d64-h8-b1-s512-full"
    _real_profile(tmp_path, backward, "--against", "sdpa-flash")
    doc = json.loads((tmp_path / f"profile-{backward}-sdpa-flash.json").read_text())
    assert any("bwd" in k["kernel"].lower() for k in doc["kernels"]), doc["kernels"]


def test_l1_and_the_busiest_pipes_say_which_unit_a_kernel_waits_on():
    """A kernel that DRAM does not bound waits on one of the SM's units: the summary gives L1 and
    shared memory's throughput and the three busiest pipes (busy cycles, else instructions issued),
    from the sections, and leaves both lines out where the report has neither."""
    metrics = {
        "gpu__time_duration.sum": 1e6,
        "l1tex__throughput.avg.pct_of_peak_sustained_elapsed": 71.5,
        "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": 2.5e7,
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": 31.0,
        "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": 12.25,
        "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active": 18.0,
        "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active": 4.0,
        "sm__pipe_uniform_cycles_active.avg.pct_of_peak_sustained_active": 0.0,
        "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": 90.0,  # the other family
    }
    assert profile.busiest_pipes(metrics) == [
        ("tensor_op_gmma", 31.0),
        ("alu", 18.0),
        ("fma", 12.25),
    ]
    assert profile.busiest_pipes(
        {"sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": 90.0}
    ) == [("lsu", 90.0)]
    launch = {"kernel": "flash_bwd_sm90_wide_block", "name": "k", "metrics": metrics}
    fig = profile.kernel_figures([launch], None, CEILINGS, 132)
    fig["verdict"] = profile.classify_bound(fig)
    lines = profile.format_kernel(fig)
    assert "    L1 and shared memory 72% of peak; shared wavefronts 2.5e+07" in lines
    assert "    busiest pipes (% of peak): tensor_op_gmma 31%, alu 18%, fma 12%" in lines
    summary = profile.summarize(
        profile.parse_ncu_csv(PREFILL_CSV), bench.parse_case_id(PREFILL_ID), CEILINGS, None
    )
    kept = profile.format_kernel(summary["kernels"][0])
    assert not [line for line in kept if "L1 and shared" in line or "busiest pipes" in line]
