"""`python -m flashmoe_science sanitize`: the parser on sample compute-sanitizer output, the workload
matrix, the command lines, the exit codes (no GPU, tool missing or not permitted) and the driver
with a stand-in compute-sanitizer, all on the CPU; then, on a GPU, a planted out-of-bounds read that
memcheck must report."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashmoe_science import _loader
from flashmoe_science.pipeline import background, cli, exitcodes
from flashmoe_science.pipeline.cases import Case
from flashmoe_science.pipeline.gates import kernels, matrix
from flashmoe_science.pipeline.paths import REPO_ROOT
from flashmoe_science.pipeline.tools import sanitize, sanitize_coverage

FWD = (
    "void flashmoe::cuda::flash_fwd_kernel<flashmoe::cuda::FwdTraits<(int)128, (int)64, (int)64, "
    "(int)4>, __nv_bfloat16>(flashmoe::AttentionParams)"
)
FWD_SHORT = "flash_fwd_kernel<FwdTraits<128, 64, 64, 4>, __nv_bfloat16>"
CASE = "fwd-bf16-d128-h2-b1-s17-full-cfg1-splits1"

# compute-sanitizer 2025.x, memcheck, PYTORCH_NO_CUDA_MEMORY_CACHING=1, a build with -lineinfo:
# one bad load seen by several threads, then the failed synchronize it causes.
MEMCHECK_OOB = f"""\
========= COMPUTE-SANITIZER
sanitize-case: fwd-fp16-d64-h2-b1-s1-full-cfg1
sanitize-case: {CASE}
========= Invalid __global__ read of size 16 bytes
=========     at {FWD}+0x1b70 in /work/main/csrc/flash_fwd_kernel.cuh:94
=========     by thread (8,0,0) in block (0,0,0)
=========     Access at 0x7f5e3c200410 is out of bounds
=========     and is 4,294,901,776 bytes after the nearest allocation at 0x7f5d3c200000 of size 65,792 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2e0c6f] in libcuda.so.1
=========         Host Frame: void flashmoe::cuda::launch_fwd<__nv_bfloat16>(...) in flash_api_cuda.cuh:52 [0x8a1f2] in flashmoe_science_C.so
=========         Host Frame: _PyEval_EvalFrameDefault [0x1e1c2c] in python3.11
=========
========= Invalid __global__ read of size 16 bytes
=========     at {FWD}+0x1b70 in /work/main/csrc/flash_fwd_kernel.cuh:94
=========     by thread (9,0,0) in block (0,0,0)
=========     Access at 0x7f5e3c200420 is out of bounds
=========     and is 4,294,901,792 bytes after the nearest allocation at 0x7f5d3c200000 of size 65,792 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2e0c6f] in libcuda.so.1
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x4a1b3e] in libcuda.so.1
=========
Traceback (most recent call last):
  File "/work/main/flashmoe_science/sanitize.py", line 160, in run_workload
    torch.cuda.synchronize()
torch.AcceleratorError: CUDA error: unspecified launch failure
========= Target application returned an error
========= ERROR SUMMARY: 3 errors
"""

# Older spellings of the location line: program counter first, function after.
MEMCHECK_OLD = """\
========= COMPUTE-SANITIZER
========= Invalid __shared__ write of size 4 bytes
=========     at 0x00000230 in /src/kernels.cu:57:saxpy(int, float, float const*, float*)
=========     by thread (127,0,0) in block (4,0,0)
=========     Address 0x7f2a4a001000 is out of bounds
=========
========= Invalid __global__ read of size 4 bytes
=========     at 0x3f0 in void lightllm::ops::rope_kernel<float>(float*, int)
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f640548c000 is out of bounds
=========
========= ERROR SUMMARY: 2 errors
"""

RACECHECK_HAZARD = f"""\
========= COMPUTE-SANITIZER
sanitize-case: {CASE}
========= Error: Potential RAW hazard detected at __shared__ 0x4000 in block (1,0,0) :
=========     Write Thread (36,0,0) at {FWD}+0x1c40 in /work/main/csrc/flash_kernel_utils.cuh:20
=========     Read Thread (3,0,0) at {FWD}+0x2a90 in /work/main/csrc/flash_kernel_utils.cuh:33
=========     Current Value : 0, Incoming Value : 15360
=========
========= Error: Race reported between Write access at {FWD}+0x1c40 in /work/main/csrc/flash_kernel_utils.cuh:20
=========     and Read access at {FWD}+0x2a90 in /work/main/csrc/flash_kernel_utils.cuh:33 [2048 hazards]
=========     and Read access at {FWD}+0x2b30 in /work/main/csrc/flash_kernel_utils.cuh:33 [1,024 hazards]
=========
sanitize-done: 136 calls
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

INITCHECK_UNINIT = f"""\
========= COMPUTE-SANITIZER
sanitize-case: {CASE}
========= Uninitialized __global__ memory read of size 2 bytes
=========     at {FWD}+0x4f0 in /work/main/csrc/flash_fwd_kernel.cuh:120
=========     by thread (64,0,0) in block (2,1,0)
=========     Address 0x7f1c2e000a40
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2e0c6f] in libcuda.so.1
=========
sanitize-done: 136 calls
========= ERROR SUMMARY: 1 error
"""

SYNCCHECK_DIVERGENT = f"""\
========= COMPUTE-SANITIZER
sanitize-case: {CASE}
========= Barrier error detected. Divergent thread(s) in block
=========     at {FWD}+0x2c8 in /work/main/csrc/flash_fwd_kernel.cuh:133
=========     by thread (0,0,0) in block (3,0,0)
=========
========= ERROR SUMMARY: 1 error
"""

GENERIC = f"""\
========= COMPUTE-SANITIZER
========= Out-of-range Shared or Local Address
=========     at {FWD}+0x300 in /work/main/csrc/flash_fwd_kernel.cuh:150
=========     by thread (1,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 1 error
"""

CLEAN = """\
========= COMPUTE-SANITIZER
sanitize-case: fwd-fp16-d64-h2-b1-s1-full-cfg1
sanitize-case: fwd-fp16-d64-h4kv1-b2-s17-full-cfg1-splits1
sanitize-done: 2 calls
========= ERROR SUMMARY: 0 errors
"""

RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
sanitize-done: 136 calls
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""

NOT_SUPPORTED = """\
========= COMPUTE-SANITIZER
========= Error: Device not supported. Please refer to the "Supported Devices" section of the sanitizer documentation
========= Error: Target application terminated before first instrumented API call
"""

ERROR_999 = """\
========= COMPUTE-SANITIZER
========= Internal Sanitizer Error: The Sanitizer failed to initialize the target process (error 999)
========= ERROR SUMMARY: 0 errors
"""

NO_PERMISSION = """\
========= COMPUTE-SANITIZER
========= Error: Unable to attach to the target process: insufficient permissions
"""

# `compute-sanitizer --help` as a release with the Hopper options prints it (boost-style: one
# option a line, its description wrapped under it), cut to the lines around them.
HELP_HOPPER = """\
NVIDIA (R) Compute Sanitizer
Copyright (c) 2020-2025 NVIDIA Corporation
Version 2025.3.1.0 (build 36398416) (public-release)
Usage: compute-sanitizer [options] [your-program] [your-program-options]

General options:
  -h [ --help ]                         Produce this help message.
  -v [ --version ]                      Print the version of the Compute Sanitizer.
  --check-bulk-copy arg (=yes)          Enables checks related to the PTX
                                        cp.async.bulk instructions on Hopper.
  --check-device-heap arg (=yes)        Enable device heap checking.
  --check-exit-code arg (=yes)          Check application exit code and print an
                                        error if it is different than 0.
  --check-warpgroup-mma arg (=yes)      Enables memcheck and synccheck support for
                                        PTX wgmma instructions.
  --error-exitcode arg (=0)             When this is set, Compute Sanitizer will
                                        return the given exit code when errors are
                                        found.
"""

# An older release: neither Hopper option (a description that names the words is no option).
HELP_OLD = """\
NVIDIA (R) Compute Sanitizer
Copyright (c) 2020-2022 NVIDIA Corporation
Version 2022.2.0 (build 31629151) (public-release)
Usage: compute-sanitizer [options] [your-program] [your-program-options]

General options:
  -h [ --help ]                         Produce this help message.
  --check-device-heap arg (=yes)        Enable device heap checking.
  --check-exit-code arg (=yes)          Check application exit code; unlike
                                        --check-bulk-copy in later releases.
  --check-warpgroup-mma-legacy arg      (an option of another name)
  --error-exitcode arg (=0)             When this is set, Compute Sanitizer will
                                        return the given exit code when errors are
                                        found.
"""


# --------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------


def test_memcheck_out_of_bounds_read():
    report = sanitize.parse_sanitizer_output("memcheck", MEMCHECK_OOB)
    assert report.errors == 3 and report.cases_started == 2 and not report.workload_done
    assert sanitize.tool_status(report, sanitize.SANITIZER_ERROR_EXIT) == "fail"
    first, api = sanitize.merge_findings(report.findings)
    assert first.check == "Invalid __global__ read of size 16 bytes"
    assert first.kernel == FWD_SHORT
    assert first.where == "flash_fwd_kernel.cuh:94"
    assert (first.thread, first.block) == ("8,0,0", "0,0,0")
    assert first.detail == (
        "out of bounds, 4,294,901,776 bytes after the nearest allocation of size 65,792 bytes"
    )
    assert first.case == CASE and first.count == 2
    assert api.severity == "api" and "cudaErrorLaunchFailure" in api.check
    assert "cudaStreamSynchronize" in api.check
    lines = sanitize.condensed(report, "fail")
    assert lines[0] == f"  memcheck: kernels {FWD_SHORT}"
    assert lines[1] == (
        f"  memcheck: Invalid __global__ read of size 16 bytes in {FWD_SHORT} at "
        "flash_fwd_kernel.cuh:94, thread (8,0,0) block (0,0,0): out of bounds, 4,294,901,776 "
        "bytes after the nearest allocation of size 65,792 bytes (x2) "
        f"[case {CASE}]"
    )
    assert "unspecified launch failure" in lines[2]


def test_memcheck_older_location_spellings():
    report = sanitize.parse_sanitizer_output("memcheck", MEMCHECK_OLD)
    shared, global_ = report.findings
    assert shared.check == "Invalid __shared__ write of size 4 bytes"
    assert (shared.kernel, shared.where) == ("saxpy", "kernels.cu:57")
    assert shared.detail == "out of bounds"
    assert (global_.kernel, global_.where) == ("rope_kernel<float>", "0x3f0")
    assert report.errors == 2


@pytest.mark.parametrize(
    "text, kernel, where",
    [
        (f"{FWD}+0x80", FWD_SHORT, "+0x80"),
        ("add(const float *, const float *, float *, int)+0x80", "add", "+0x80"),
        (
            "0x30 in /a/b/memcheck_demo.cu:6:unaligned_kernel(void)",
            "unaligned_kernel",
            "memcheck_demo.cu:6",
        ),
        (
            "void flashmoe::cuda::split_kv_combine_kernel<__half, (int)128>(const float *, const "
            "float *, __half *, float *, int, long)+0x1a0 in /w/csrc/flash_fwd_kernel.cuh:300",
            "split_kv_combine_kernel<__half, 128>",
            "flash_fwd_kernel.cuh:300",
        ),
    ],
)
def test_parse_location(text, kernel, where):
    assert sanitize.parse_location(text) == (kernel, where)


def test_racecheck_hazards_and_analysis():
    report = sanitize.parse_sanitizer_output("racecheck", RACECHECK_HAZARD)
    assert (report.errors, report.warnings) == (1, 0)
    assert sanitize.tool_status(report, sanitize.SANITIZER_ERROR_EXIT) == "fail"
    hazard, race = sanitize.merge_findings(report.findings)
    assert hazard.check == "Potential RAW hazard on __shared__"
    assert hazard.block == "1,0,0" and hazard.thread == "36,0,0"
    assert hazard.where == "Write at flash_kernel_utils.cuh:20"
    assert hazard.other == "Read at flash_kernel_utils.cuh:33"
    assert race.kernel == FWD_SHORT and race.hazards == 3072
    assert race.line() == (
        "Race reported between Write access at flash_kernel_utils.cuh:20 and Read access at "
        f"flash_kernel_utils.cuh:33 in {FWD_SHORT} [3072 hazards] [case {CASE}]"
    )
    assert sanitize.count_text(report) == "1 error, 0 warnings"


def test_initcheck_uninitialized_read():
    report = sanitize.parse_sanitizer_output("initcheck", INITCHECK_UNINIT)
    (finding,) = report.findings
    assert finding.check == "Uninitialized __global__ memory read of size 2 bytes"
    assert (finding.kernel, finding.where) == (FWD_SHORT, "flash_fwd_kernel.cuh:120")
    assert (finding.thread, finding.block) == ("64,0,0", "2,1,0")
    assert report.workload_done and sanitize.tool_status(report, 99) == "fail"


def test_synccheck_divergent_barrier():
    report = sanitize.parse_sanitizer_output("synccheck", SYNCCHECK_DIVERGENT)
    (finding,) = report.findings
    assert finding.check == "Barrier error detected. Divergent thread(s) in block"
    assert finding.where == "flash_fwd_kernel.cuh:133" and finding.block == "3,0,0"


def test_an_unknown_error_with_a_location_is_a_finding():
    report = sanitize.parse_sanitizer_output("memcheck", GENERIC)
    (finding,) = report.findings
    assert finding.check == "Out-of-range Shared or Local Address"
    assert finding.kernel == FWD_SHORT and finding.thread == "1,0,0"


@pytest.mark.parametrize("text, tool", [(CLEAN, "memcheck"), (RACECHECK_CLEAN, "racecheck")])
def test_clean_runs_pass(text, tool):
    report = sanitize.parse_sanitizer_output(tool, text)
    assert report.findings == [] and report.errors == 0
    assert sanitize.tool_status(report, 0) == "pass"
    assert sanitize.condensed(report, "pass") == []


def test_a_crash_without_findings_is_an_error_not_a_pass():
    text = CLEAN.replace("sanitize-done: 2 calls\n", "")
    report = sanitize.parse_sanitizer_output("memcheck", text)
    assert sanitize.tool_status(report, 1) == "error"
    assert sanitize.tool_status(report, None, timed_out=True) == "timeout"


def test_a_workload_that_dies_before_its_first_call_says_its_exception(
    isolated, fake_gpu, fake_sanitizer, capsys
):
    """A workload that raises before any call: the reason quotes its exception, not the tool's
    summary line printed after it."""
    fake_sanitizer(
        "memcheck",
        "========= COMPUTE-SANITIZER\nTraceback (most recent call last):\n"
        "NameError: name 'padded_head_dim_workload' is not defined\n"
        "========= ERROR SUMMARY: 0 errors\n",
        rc=1,
    )
    assert sanitize.main(["--tool", "memcheck"]) == exitcodes.GATE_FAILED
    assert (
        "memcheck: error: the workload exited 1 before any call without a finding: "
        "NameError: name 'padded_head_dim_workload' is not defined" in capsys.readouterr().out
    )


def test_the_workload_runs_every_feature_on_every_operator():
    """Windows, softcap and sinks reach every CUDA path the sanitizer watches: prefill (split-KV
    too), decode, paged, packed and the backward (deterministic too)."""
    features = sanitize.feature_workload()
    assert features and {c.id for c in features} <= {c.id for c in sanitize.workload_cases()}
    kinds = {c.id.split("-")[0] for c in features}
    assert kinds == {"fwd", "bwd", "dec", "varlen", "paged"}
    assert any(getattr(c, "deterministic", False) for c in features)
    assert all(c.window != (-1, -1) or c.softcap or c.sinks for c in features)


def test_every_configuration_runs_the_features_under_the_sanitizer():
    """Forced, each forward configuration (the wgmma ones' feature instantiations too) and each
    backward one meets a window, a softcap and sinks, where the GPU runs it (and only there)."""
    from flashmoe_science.ops import BACKWARD_CONFIGS
    from flashmoe_science.pipeline.gates.matrix import FORCED_CONFIGS

    forced = sanitize.forced_feature_workload(FORCED_CONFIGS, BACKWARD_CONFIGS)
    for kind, configs in (("prefill", FORCED_CONFIGS), ("backward", BACKWARD_CONFIGS)):
        for config in configs:
            mine = [c for c in forced if c.kind == kind and c.config == config]
            assert any(c.window != (-1, -1) for c in mine), (kind, config)
            assert any(c.softcap for c in mine) and any(c.sinks for c in mine), (kind, config)
    only_1 = sanitize.forced_feature_workload((1,), ())
    assert only_1 and {(c.kind, c.config) for c in only_1} == {("prefill", 1)}


def test_the_workload_module_run_as_a_script_lists_every_case():
    """`python -m ...sanitize --list` runs the module as __main__, as compute-sanitizer runs the
    workload: every function the cases need is defined before main() runs (a workload appended
    after the main guard raised NameError under every tool, and only there)."""
    done = subprocess.run(
        [sys.executable, "-m", "flashmoe_science.pipeline.tools.sanitize", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    listed = done.stdout.split()
    assert len(listed) >= 500 and len(set(listed)) == len(listed)
    assert any("-d80-" in case_id for case_id in listed)
    assert any("-d192v128-" in case_id for case_id in listed)


WORKLOAD_EXIT = """
import atexit, sys
from flashmoe_science.pipeline.tools import sanitize
atexit.register(print, "interpreter teardown")
sanitize.run_workload = lambda cases: print("sanitize-done: 0 calls") or {status}
sys.exit(sanitize.main(["--workload"]))
"""


@pytest.mark.parametrize("status", [0, 1])
def test_the_workload_leaves_without_the_interpreters_teardown(status):
    """Under memcheck or initcheck with another sanitizer on the GPU, the workload's teardown
    (torch's) aborted after every call had run clean; it leaves with its status, output flushed,
    and runs no exit handler."""
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD_EXIT.format(status=status)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "sanitize-done: 0 calls\n"


@pytest.mark.parametrize("text", [NOT_SUPPORTED, ERROR_999, NO_PERMISSION])
def test_not_permitted_or_not_supported(text):
    report = sanitize.parse_sanitizer_output("memcheck", text)
    assert report.unusable and sanitize.tool_status(report, 1) == "unusable"
    assert "=========" not in report.unusable


# --------------------------------------------------------------------------------------------------
# The workload and the command lines
# --------------------------------------------------------------------------------------------------


def has_features(case) -> bool:
    """A window, softcap or sinks (sanitize.feature_workload's calls, tested on their own)."""
    return case.window != (-1, -1) or bool(case.softcap) or case.sinks


def test_workload_covers_every_code_path():
    workload = sanitize.workload_cases()
    assert len({c.id for c in workload}) == len(workload)
    # packed and paged calls, the head dims past 128 and the padded ones: tests below
    cases = [
        c
        for c in workload
        if isinstance(c, Case) and c.head_dim in (64, 128) and not c.head_dim_v
        if not has_features(c)
    ]
    fwd = [c for c in cases if c.kind == "prefill"]
    dec = [c for c in cases if c.kind == "decode"]
    bwd = [c for c in cases if c.kind == "backward"]
    # racecheck's wall time grows with it (~0.1 s a call on an H100); 430 since configuration 6
    # (26 calls at head dim 64), 450 since configuration 7 (14 at head dim 128), 540 since head
    # dims 192 and 256 (94), 575 since the padded head dims (34), 600 since windows, softcap and
    # sinks (the CPU gate tier's 20), 640 since every configuration forced with them (40; racecheck
    # took 110 s over 592 calls on an H100), 660 since the wgmma forward at 192 and 256 (20), 665
    # since its kernel of v's 128 under 192 (2), 670 since the 128 tile padded (the forward's 2
    # and 80 and 96 on backward configurations 2 and 3, the wgmma backward's tile padded: 8), 682
    # since the wgmma backward past 128 (12), 690 since the automatic choice takes it (2 forced
    # at 192 and 256: 8)
    assert len(workload) <= 690
    from flashmoe_science.ops import BACKWARD_CONFIGS

    # every backward kernel: each configuration this GPU runs (all of them, wgmma included, for an
    # H100's listing) with dQ by atomics and deterministic, both dtypes and head dims, causal (with
    # rows that see no key) and not, GQA, a strided view
    if not torch.cuda.is_available():
        assert sanitize.workload_backward_configs() == list(BACKWARD_CONFIGS)
    assert {(c.dtype, c.head_dim, c.config, c.deterministic) for c in bwd} == {
        (t, d, k, det)
        for t in ("fp16", "bf16")
        for d in (64, 128)
        for k in sanitize.workload_backward_configs()
        for det in (False, True)
    }
    assert any(c.causal and c.seqlen_q > c.seqlen_k for c in bwd)
    assert any(c.heads_q > c.heads_kv for c in bwd) and any(c.layout == "bshd" for c in bwd)
    instantiations = {(c.dtype, c.head_dim, c.config) for c in fwd}
    assert instantiations == {
        (t, d, k)
        for t in ("fp16", "bf16")
        for k in sanitize.workload_configs()
        for d in matrix.gated_head_dims(k)  # 6 at 64 only: at 128 it is 5's kernel
    }
    for key in instantiations:  # every kernel instantiation, masked and not, on every length
        for causal in (False, True):
            lengths = {
                (c.seqlen_q, c.seqlen_k)
                for c in fwd
                if (c.dtype, c.head_dim, c.config) == key and c.causal == causal
            }
            assert {1, 17, 65, 129, 257} <= {q for q, _ in lengths}
            assert any(q > k for q, k in lengths) and any(q < k for q, k in lengths)
    assert any(c.heads_q == 4 * c.heads_kv and c.seqlen_q * 4 <= 128 for c in fwd)  # packed GQA
    assert any(c.heads_q == 4 * c.heads_kv and c.seqlen_q * 4 > 128 for c in fwd)  # unpacked
    assert {c.num_splits for c in fwd} == {0, 1, 3} and {c.layout for c in fwd} == {"bhsd", "bshd"}
    assert {1, 3, 7} <= {c.num_splits for c in dec} and 0 in {c.num_splits for c in dec}
    assert {(c.dtype, c.head_dim) for c in dec} == {
        (t, d) for t in ("fp16", "bf16") for d in (64, 128)
    }
    assert any(c.cache_seqlens and 0 in c.cache_seqlens for c in dec)
    # short caches with many splits: most splits own no key
    assert any(
        c.cache_seqlens and c.num_splits >= 7 and max(c.cache_seqlens) < 64 * c.num_splits
        for c in dec
    )
    # many query rows against a cache with lengths 0, short and full, on the wgmma kernels (where
    # the card runs them), whose producer copies K and V with cp.async when cache_seqlens is given
    many = [c for c in dec if c.cache_seqlens and c.seqlen_q > 16]
    if 5 not in sanitize.workload_configs():
        assert not many
        return
    assert {c.config for c in many} == set(matrix.MANY_ROW_DECODE_CONFIGS) == {5, 6, 7}
    many_rows = [c for c in many if c.config == 5]
    assert {(c.dtype, c.head_dim) for c in many_rows} == {
        (t, d) for t in ("fp16", "bf16") for d in (64, 128)
    }
    assert {c.causal for c in many_rows} == {False, True}
    assert {c.seqlen_q for c in many_rows} == {65, 257}
    assert {c.num_splits for c in many_rows} == {0, 3}
    assert all({0, c.seqlen_k} <= set(c.cache_seqlens) for c in many)
    sixes = [c for c in many if c.config == 6]
    assert {(c.dtype, c.head_dim, c.seqlen_q) for c in sixes} == {
        ("fp16", 64, 65),
        ("bf16", 64, 257),
    }
    sevens = [c for c in many if c.config == 7]
    assert {(c.dtype, c.head_dim, c.seqlen_q) for c in sevens} == {
        ("fp16", 128, 257),
        ("bf16", 128, 65),
    }
    # the packed and paged calls carry their gates' case types and id formats
    from flashmoe_science.pipeline.gates.paged import PagedCase
    from flashmoe_science.pipeline.gates.varlen import VarlenCase

    others = (VarlenCase, PagedCase, sanitize.VarlenBackward)
    assert all(isinstance(c, others) for c in workload if not isinstance(c, Case))


def test_workload_covers_packed_batches():
    """Every packed-batch kernel instantiation (dtype x head dim x configuration with a packed
    variant), each masked and not, over lengths 0, 1, 17 and one past a block's end, Sq != Sk both
    ways, GQA 1 and 4; the backward once per dtype and head dim."""
    from flashmoe_science.pipeline.gates.varlen import VARLEN_CONFIGS, VarlenCase

    cases = sanitize.workload_cases()
    varlen = [
        c
        for c in cases
        if isinstance(c, VarlenCase) and c.head_dim in (64, 128) and not has_features(c)
    ]
    configs = [c for c in sanitize.workload_configs() if c in VARLEN_CONFIGS]
    assert configs == [1, 2, 4, 5]  # listed without a GPU: all of them
    keys = {(c.dtype, c.head_dim, c.config, c.causal) for c in varlen}
    assert keys == {
        (t, d, k, m) for t in ("fp16", "bf16") for d in (64, 128) for k in configs for m in (0, 1)
    }
    for config in configs:
        mine = [c for c in varlen if c.config == config]
        assert {c.heads_q // c.heads_kv for c in mine} == {1, 4}
        for causal in (False, True):
            pairs = {
                pair
                for c in mine
                if c.causal == causal
                for pair in zip(c.lengths_q, c.lengths_k, strict=True)
            }
            lengths = {n for pair in pairs for n in pair}
            assert {0, 1, 17, 65, 129, 257} <= lengths
            assert any(q < k for q, k in pairs) and any(q > k for q, k in pairs)
            assert any(q and not k for q, k in pairs)  # queries without keys
    backward = [
        c for c in cases if isinstance(c, sanitize.VarlenBackward) and c.forward.head_dim <= 128
    ]
    assert sorted((c.forward.dtype, c.forward.head_dim) for c in backward) == [
        ("bf16", 64),
        ("bf16", 128),
        ("fp16", 64),
        ("fp16", 128),
    ]
    assert {c.forward.causal for c in backward} == {False, True}
    assert all(c.id.startswith("varlenbwd-") for c in backward)


def test_workload_covers_paged_decode():
    """The paged decode kernel per dtype and head dim over block sizes 16, 64 and 256, on shuffled
    page tables, with empty caches and partial last pages, forced and automatic splits."""
    from flashmoe_science.pipeline.gates.paged import PagedCase, make_paged_inputs

    paged = [
        c
        for c in sanitize.workload_cases()
        if isinstance(c, PagedCase) and c.head_dim in (64, 128) and not has_features(c)
    ]
    assert {(c.dtype, c.head_dim, c.page_size) for c in paged} == {
        (t, d, p) for t in ("fp16", "bf16") for d in (64, 128) for p in (16, 64, 256)
    }
    for page_size in (16, 64, 256):
        mine = [c for c in paged if c.page_size == page_size]
        assert any(0 in c.lengths for c in mine)
        assert any(n > page_size and n % page_size for c in mine for n in c.lengths)
        assert {c.num_splits for c in mine} == {0, 3, 7}
    assert any(c.num_splits == 0 and max(c.lengths) > 4096 for c in paged)  # splits automatically
    assert {c.causal for c in paged} == {False, True}
    assert {c.heads_q // c.heads_kv for c in paged} == {1, 4}
    assert {c.seqlen_q for c in paged} == {1, 4}
    _, _, _, table, _ = make_paged_inputs(paged[0], "cpu", seed=0)
    assert not torch.equal(table.flatten(), table.flatten().sort().values)  # shuffled


def test_workload_covers_wide_head_dims():
    """Head dims 192 and 256, both dtypes: every mma.sync forward configuration the card runs
    (1 at 192 only: at 256 it needs more shared memory than an sm86/sm89 block has), the wgmma
    one (5; 6 and 7 are its kernel there) and the automatic choice over odd lengths with forced
    and automatic splits, decode with a fused combine over short caches, the wgmma kernel's
    cp.async path (many query rows against a cache), paged decode, packed batches (on 5 too) and
    their backward, and the backward (automatic, 1, and 2 where the card runs it) with dQ by
    atomics and deterministic;
    appended, so the other calls keep their order."""
    from flashmoe_science.pipeline.gates.paged import PagedCase
    from flashmoe_science.pipeline.gates.varlen import VarlenCase

    workload = sanitize.workload_cases()
    assert sanitize.WIDE_HEAD_DIMS == (192, 256)
    first_wide = next(i for i, c in enumerate(workload) if getattr(c, "head_dim", 0) > 128)
    wide = sanitize.wide_head_dim_workload(sanitize.workload_configs())
    assert workload[first_wide : first_wide + len(wide)] == wide
    pairs = {(t, d) for t in ("fp16", "bf16") for d in (192, 256)}
    cases = [c for c in wide if isinstance(c, Case)]
    fwd = [c for c in cases if c.kind == "prefill"]
    assert {(c.dtype, c.head_dim, c.config) for c in fwd} == {
        (t, d, k) for t, d in pairs for k in (0, 1, 2, 3, 4, 5) if k != 1 or d == 192
    }
    for key in {(c.dtype, c.head_dim, c.config) for c in fwd}:
        mine = [c for c in fwd if (c.dtype, c.head_dim, c.config) == key]
        assert {c.causal for c in mine} == {False, True}
        assert any(c.seqlen_q > c.seqlen_k for c in mine) and any(
            c.seqlen_q < c.seqlen_k for c in mine
        )
        assert {c.num_splits for c in mine} == {0, 1, 3}
    assert any(c.heads_q > c.heads_kv for c in fwd) and any(c.layout == "bshd" for c in fwd)
    dec = [c for c in cases if c.kind == "decode"]
    assert {(c.dtype, c.head_dim) for c in dec} == pairs
    many_rows = [c for c in dec if c.config == 5]
    assert {(c.dtype, c.head_dim) for c in many_rows} == pairs
    assert all(c.seqlen_q > 16 and c.cache_seqlens for c in many_rows)
    assert all(
        any(c.num_splits == 7 and c.cache_seqlens for c in dec if (c.dtype, c.head_dim) == p)
        for p in pairs
    )
    bwd = [c for c in cases if c.kind == "backward"]
    # 2 as well where the card runs it: a Hopper card's automatic choice is the wgmma kernel
    backward = (0, 1, *(k for k in (2,) if k in sanitize.workload_backward_configs()))
    assert {(c.dtype, c.head_dim, c.config, c.deterministic) for c in bwd} == {
        (t, d, k, det) for t, d in pairs for k in backward for det in (False, True)
    }
    paged = [c for c in wide if isinstance(c, PagedCase)]
    assert {(c.dtype, c.head_dim) for c in paged} == pairs and {16, 64} <= {
        c.page_size for c in paged
    }
    varlen = [c for c in wide if isinstance(c, VarlenCase)]
    assert {(c.dtype, c.head_dim, c.config) for c in varlen} == {
        (t, d, k) for t, d in pairs for k in (0, 2, 5)
    }
    backward = [c for c in wide if isinstance(c, sanitize.VarlenBackward)]
    assert {(c.forward.dtype, c.forward.head_dim) for c in backward} == pairs


def test_workload_covers_the_wide_wgmma_backward_last():
    """Backward configuration 3 past 128 (Sm90BwdWideTraits) where the card runs it: each of its
    kernels (192, 256, v's 128 under 192; both dtypes; dQ by atomics and deterministic), causal
    with rows that see no key, GQA, and the window, softcap and sinks; the workload's last block."""
    from flashmoe_science.pipeline.gates import matrix

    workload = sanitize.workload_cases()
    wide = sanitize.wide_wgmma_backward_workload()
    if 3 not in sanitize.workload_backward_configs():
        assert wide == []
        return
    assert workload[len(workload) - len(wide) :] == wide
    assert {(c.head_dim, c.value_head_dim, c.dtype, c.deterministic) for c in wide} == {
        (*dims, t, det)
        for dims in matrix.WGMMA_WIDE_FORCED_BACKWARD
        for t in ("fp16", "bf16")
        for det in (False, True)
    }
    assert all(c.config == 3 and c.heads_q > c.heads_kv for c in wide)
    assert any(c.causal and c.seqlen_q > c.seqlen_k for c in wide)
    featured = [c for c in wide if c.softcap and c.sinks and c.window != (-1, -1)]
    assert {c.head_dim for c in featured} == {192, 256} and any(c.deterministic for c in featured)


@pytest.fixture(scope="module")
def cpu_workload():
    """The whole workload run on the CPU (which takes no tile configuration): what it printed and
    the operators it called."""
    import contextlib
    import io

    from torch.utils._python_dispatch import TorchDispatchMode

    class Operators(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.called: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.called.add(func.name())
            return func(*args, **(kwargs or {}))

    # Cases that differ only in their tile configuration are one call on the CPU: run it once.
    cases = list(
        {
            repr(c): c
            for c in (
                dataclasses.replace(c, config=0) if hasattr(c, "config") else c
                for c in sanitize.workload_cases()
            )
        }.values()
    )
    printed = io.StringIO()
    with Operators() as operators, contextlib.redirect_stdout(printed):
        status = sanitize.run_workload(cases, device="cpu")
    return cases, status, printed.getvalue(), operators.called


def test_workload_calls_are_valid_on_the_cpu(cpu_workload):
    """Every call of the workload is accepted by the API."""
    cases, status, out, _ = cpu_workload
    assert status == exitcodes.OK
    report = sanitize.parse_sanitizer_output(
        "memcheck", out + "========= ERROR SUMMARY: 0 errors\n"
    )
    assert report.cases_started == len(cases) and report.workload_done
    assert sanitize.tool_status(report, 0) == "pass"


def test_workload_launches_every_instrumented_kernel(cpu_workload):
    """Each kernel the sanitizer watches is launched by an operator the workload calls: a kernel
    left out of the workload (the packed or the paged one, say) would be watched and never run."""
    _, _, _, called = cpu_workload
    assert {"flash_fwd_varlen_kernel", "flash_decode_paged_kernel"} <= set(
        sanitize.KERNEL_OPERATORS
    )
    missing = {
        kernel: operator
        for kernel, operator in sanitize.KERNEL_OPERATORS.items()
        if f"flashmoe_science::{operator}" not in called
    }
    assert not missing, f"the workload never calls the operators of {missing}"


def test_a_restricted_build_runs_the_workload_calls_it_holds(monkeypatch):
    """On a restricted build (the planted out-of-bounds read's holds the first call's kernels) the
    workload is its calls whose kernels that build holds, in the workload's order; the restriction
    comes from FLASHMOE_BUILD_ONLY or from -DFLASHMOE_ONLY_* defines."""
    full = sanitize.workload_cases(_loader.Restriction())
    only = kernels.restriction_for(sanitize.case_needs(full[0]))
    assert only.text() == "op=fwd,combine head_dim=64 config=1 dtype=fp16"
    held = sanitize.workload_cases(only)
    assert held[0] == full[0] and 1 < len(held) < len(full)
    assert held == [case for case in full if case in held]  # the workload's order
    assert {(c.kind, c.dtype, c.head_dim, c.config) for c in held} == {("prefill", "fp16", 64, 1)}
    monkeypatch.delenv("FLASHMOE_BUILD_DEFINES", raising=False)
    assert sanitize.workload_cases() == full
    monkeypatch.setenv(_loader.ONLY_VAR, only.text())
    assert sanitize.workload_cases() == held
    monkeypatch.delenv(_loader.ONLY_VAR)
    monkeypatch.setenv(
        "FLASHMOE_BUILD_DEFINES", ",".join(("FLASHMOE_PLANT_BUG=3", *only.defines()))
    )
    assert sanitize.workload_cases() == held


def test_sanitizer_command_and_environment():
    memcheck = sanitize.sanitizer_command("/cuda/bin/compute-sanitizer", "memcheck")
    assert memcheck[:5] == [
        "/cuda/bin/compute-sanitizer",
        "--tool",
        "memcheck",
        "--error-exitcode",
        "99",
    ]
    assert "--print-limit" in memcheck and memcheck[memcheck.index("--print-limit") + 1] == "20"
    assert "--racecheck-report" not in memcheck
    assert "kns=flash_fwd_kernel" in memcheck and "kns=split_kv_combine_kernel" in memcheck
    assert memcheck[-4:] == [
        sys.executable,
        "-m",
        "flashmoe_science.pipeline.tools.sanitize",
        "--workload",
    ]
    racecheck = sanitize.sanitizer_command("cs", "racecheck", kernel_filter=False)
    assert racecheck[racecheck.index("--racecheck-report") + 1] == "all"
    assert "--kernel-name" not in racecheck
    env = sanitize.tool_env("memcheck", ("FLASHMOE_PLANT_BUG=3",))
    assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
    assert env["FLASHMOE_BUILD_DEFINES"] == "FLASHMOE_PLANT_BUG=3"
    racecheck_env = sanitize.tool_env("racecheck", ())
    assert racecheck_env.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == os.environ.get(
        "PYTORCH_NO_CUDA_MEMORY_CACHING"
    )


# --------------------------------------------------------------------------------------------------
# What each tool covers of the Hopper features (sanitize_coverage)
# --------------------------------------------------------------------------------------------------

BOTH = {"--check-bulk-copy", "--check-warpgroup-mma"}


def test_offered_options_from_both_kinds_of_help_text():
    assert sanitize_coverage.offered_options(HELP_HOPPER) == BOTH
    assert sanitize_coverage.offered_options(HELP_OLD) == set()
    only_bulk = HELP_HOPPER.replace("--check-warpgroup-mma", "--check-other")
    assert sanitize_coverage.offered_options(only_bulk) == {"--check-bulk-copy"}


def _flag(command: list[str], option: str) -> str | None:
    return command[command.index(option) + 1] if option in command else None


def test_hopper_options_are_passed_as_yes_only_where_offered_and_concerned():
    for tool in sanitize.TOOLS:
        offered = sanitize.sanitizer_command("cs", tool, offered=BOTH)
        assert _flag(offered, "--check-bulk-copy") == "yes"  # a general option: every tool
        # memcheck and synccheck support for wgmma, by the tool's documentation
        wgmma = "yes" if tool in ("memcheck", "synccheck") else None
        assert _flag(offered, "--check-warpgroup-mma") == wgmma
        assert offered.index("--check-bulk-copy") < offered.index(sys.executable)  # tool options
        bare = sanitize.sanitizer_command("cs", tool)
        assert "--check-bulk-copy" not in bare and "--check-warpgroup-mma" not in bare
    old = sanitize_coverage.offered_options(HELP_OLD)
    assert "--check-bulk-copy" not in sanitize.sanitizer_command("cs", "memcheck", offered=old)


def _statuses(tool: str, offered) -> dict[str, str]:
    return {s["feature"]: s["status"] for s in sanitize_coverage.coverage(tool, offered)}


def test_coverage_rests_on_the_offered_options():
    assert _statuses("memcheck", BOTH) == {
        "tma": "checked",
        "bulk_reduce": "not documented",
        "wgmma": "checked",
        "mbarrier": "not checked",
        "named_barrier": "not checked",
    }
    old = sanitize_coverage.coverage("memcheck", set())
    assert [s["status"] for s in old if s["feature"] in ("tma", "wgmma")] == ["not checked"] * 2
    assert {s["why"] for s in old if s["feature"] == "tma"} == {
        "this compute-sanitizer has no --check-bulk-copy"
    }
    assert _statuses("synccheck", BOTH)["wgmma"] == "checked"
    assert _statuses("synccheck", set())["wgmma"] == "not checked"
    unreadable = sanitize_coverage.coverage("memcheck", None)
    assert "--help was unreadable" in unreadable[0]["why"]


def test_racecheck_never_claims_tma_or_wgmma():
    # racecheck pairs threads' shared-memory accesses: TMA writes and wgmma reads are neither
    statuses = _statuses("racecheck", BOTH)
    assert statuses["tma"] == statuses["wgmma"] == "not checked"
    assert all(
        set(_statuses(tool, BOTH)) == set(sanitize_coverage.FEATURES) for tool in sanitize.TOOLS
    )
    line = sanitize_coverage.gap_line(sanitize_coverage.coverage("racecheck", BOTH))
    assert line == "not checked: TMA, wgmma, named barrier; not documented: bulk reduce, mbarrier"


def test_racecheck_leaves_the_named_barrier_handoffs_to_the_other_tools(monkeypatch):
    # the statement and the switch go together: racecheck says it does not check named barriers
    # and names the switch it runs under instead, and its runs (and only its) carry that switch
    monkeypatch.delenv("FLASHMOE_BWD_WS", raising=False)
    racecheck = {s["feature"]: s for s in sanitize_coverage.coverage("racecheck", BOTH)}
    assert racecheck["named_barrier"]["status"] == "not checked"
    assert "(FLASHMOE_BWD_WS=0 on its runs)" in racecheck["named_barrier"]["why"]
    assert sanitize_coverage.RACECHECK_ENV == {"FLASHMOE_BWD_WS": "0"}
    for tool in sanitize.TOOLS:
        env = sanitize.tool_env(tool, ())
        assert (env.get("FLASHMOE_BWD_WS") == "0") == (tool == "racecheck"), tool


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_find_cuda_tool_search_order(tmp_path, no_cuda_tools, monkeypatch):
    # CUDA_HOME, then PATH, then the install directories, then the globs (flashmoe_science._toolkit)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert sanitize.find_cuda_tool("ncu") is None
    glob_hit = _executable(tmp_path / "opt" / "2025.3.1" / "ncu")
    _executable(tmp_path / "opt" / "2024.1.0" / "ncu")
    assert sanitize.find_cuda_tool("ncu", [str(tmp_path / "opt" / "*" / "ncu")]) == str(glob_hit)
    path_hit = _executable(tmp_path / "bin" / "ncu")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert sanitize.find_cuda_tool("ncu", [str(tmp_path / "opt" / "*" / "ncu")]) == str(path_hit)
    home_hit = _executable(tmp_path / "cuda" / "bin" / "ncu")
    assert sanitize.find_cuda_tool("ncu") == str(home_hit)


# --------------------------------------------------------------------------------------------------
# Exit codes and the driver, with a stand-in compute-sanitizer
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_REPORTS_DIR", str(tmp_path / "reports"))
    monkeypatch.delenv("FLASHMOE_BUILD_DEFINES", raising=False)
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    return tmp_path


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(sanitize, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    from flashmoe_science.pipeline.build import unit as build

    built = []
    monkeypatch.setattr(
        build, "ensure_built", lambda backend, defines=(): built.append(defines) or Path("/b/x.so")
    )
    return built


def test_no_gpu_exits_255_with_one_line(isolated, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sanitize.main([]) == exitcodes.ENV_BROKEN
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no GPU" in out[0]


def test_a_background_run_is_waited_for_with_its_output_and_status(isolated):
    """`sanitize --background` returns at once; `sanitize --wait` (a later CI step) prints the
    run's output and exits with its status (255 here: no GPU in the child), and the stage row is
    the run's own, written once by the child (start and wait write none)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "flashmoe_science", "sanitize"]
    started = subprocess.run(
        [*command, "--background", "--tool", "memcheck"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert "started in the background" in started.stdout and "sanitize --wait" in started.stdout
    waited = subprocess.run(
        [*command, "--wait"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env
    )
    assert waited.returncode == exitcodes.ENV_BROKEN, waited.stdout + waited.stderr
    assert "the background run ended with exit 255" in waited.stdout
    assert "torch sees no GPU" in waited.stdout, "the run's own output, printed by the wait"
    # below the job's priority, so the test stage beside it keeps the CPU
    expected = min(19, os.nice(0) + background.NICENESS)
    assert f"running in the background at niceness {expected}" in waited.stdout
    reports = isolated / "reports"
    state = json.loads((reports / "sanitize-background.json").read_text())
    assert state["argv"] == ["sanitize", "--tool", "memcheck"]
    assert json.loads((reports / "sanitize-background-exit.json").read_text())["exit"] == 255
    stage = json.loads((reports / "stages.json").read_text())["stages"]["sanitize"]
    assert stage["exit_code"] == 255 and stage["seconds"] < 60


def test_a_wait_with_nothing_started_or_a_run_that_died_says_so(isolated, capsys, monkeypatch):
    assert sanitize.main(["--wait"]) == exitcodes.USAGE
    assert "nothing was started in the background" in capsys.readouterr().err
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs, and no exit status recorded: killed
    reports = isolated / "reports"
    reports.mkdir(exist_ok=True)
    (reports / "sanitize-background.json").write_text(json.dumps({"pid": gone.pid, "argv": []}))
    (reports / "sanitize-background.log").write_text("sanitize: memcheck ...\n")
    assert sanitize.main(["--wait"]) == exitcodes.ENV_BROKEN
    out, err = capsys.readouterr()
    assert "ended without an exit status" in err and "sanitize: memcheck ..." in out


def test_a_run_that_ended_before_its_start_was_recorded_is_still_waited_for(isolated, capsys):
    """The run's exit has a file of its own: a run over before the starting step wrote its pid
    (the record written last) still gives the wait its status, not "killed"."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    reports = isolated / "reports"
    reports.mkdir(exist_ok=True)
    (reports / "sanitize-background-exit.json").write_text(json.dumps({"exit": 1, "ended": 9.0}))
    (reports / "sanitize-background.json").write_text(
        json.dumps({"pid": gone.pid, "argv": [], "started": 10.0})
    )
    (reports / "sanitize-background.log").write_text("sanitize: memcheck FAIL\n")
    assert sanitize.main(["--wait"]) == exitcodes.GATE_FAILED == 1
    out = capsys.readouterr().out
    assert "ended with exit 1" in out and "sanitize: memcheck FAIL" in out


def test_missing_tool_exits_126_with_one_line(isolated, fake_gpu, no_cuda_tools, capsys):
    assert cli.main(["sanitize", "--tool", "memcheck"]) == exitcodes.TOOL_MISSING
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "compute-sanitizer not found" in out[0] and "PATH" in out[0]
    stages = json.loads((isolated / "reports" / "stages.json").read_text())["stages"]
    assert stages["sanitize"]["status"].startswith("skip")
    assert not fake_gpu  # nothing was built


FAKE_SANITIZER = """\
#!/bin/sh
# Stands in for compute-sanitizer: prints $FAKE_DIR/<tool>.txt and exits with <tool>.rc.
if [ "$1" = "--version" ]; then
  echo "NVIDIA (R) Compute Sanitizer"
  echo "Version 2025.3.1.0 (build 36398416) (public-release)"
  exit 0
fi
if [ "$1" = "--help" ]; then
  cat "$FAKE_DIR/help.txt"
  exit 0
fi
tool=memcheck
share=""
while [ $# -gt 0 ]; do
  if [ "$1" = "--tool" ]; then tool=$2; fi
  if [ "$1" = "--share" ]; then share=$2; fi
  shift
done
echo "tool=$tool caching=${PYTORCH_NO_CUDA_MEMORY_CACHING:-on} ws=${FLASHMOE_BWD_WS:-on} defines=$FLASHMOE_BUILD_DEFINES${share:+ share=$share}" >> "$FAKE_DIR/calls"
name=$tool
[ -z "$share" ] || name="$tool.$(echo "$share" | tr / o)"
if [ -n "${FAKE_BARRIER:-}" ]; then  # wait until FAKE_BARRIER runs have started: they run at once
  touch "$FAKE_DIR/started.$name"
  i=0
  while [ "$(ls "$FAKE_DIR" | grep -c '^started\\.')" -lt "$FAKE_BARRIER" ]; do
    i=$((i + 1))
    if [ "$i" -gt 300 ]; then echo "fake: $name waited alone"; exit 1; fi
    sleep 0.1
  done
fi
[ -f "$FAKE_DIR/$name.txt" ] || name=$tool  # a share's own answer, else the tool's
cat "$FAKE_DIR/$name.txt"
exit "$(cat "$FAKE_DIR/$name.rc" 2>/dev/null || echo 0)"
"""


@pytest.fixture
def fake_sanitizer(isolated, monkeypatch):
    fake = isolated / "fake"
    _executable(fake / "bin" / "compute-sanitizer", FAKE_SANITIZER)
    monkeypatch.setenv("PATH", f"{fake / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for variable in ("CUDA_HOME", "CUDA_PATH"):  # a real toolkit there would come first
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("FAKE_DIR", str(fake))
    (fake / "help.txt").write_text(HELP_HOPPER)

    def say(tool: str, text: str, rc: int = 0) -> None:
        (fake / f"{tool}.txt").write_text(text)
        (fake / f"{tool}.rc").write_text(str(rc))

    return say


def test_clean_tools_pass(isolated, fake_gpu, fake_sanitizer, capsys, monkeypatch):
    monkeypatch.setattr(sanitize.os, "cpu_count", lambda: 16)  # a GPU machine's cores
    fake_sanitizer("memcheck", CLEAN)
    fake_sanitizer("racecheck", RACECHECK_CLEAN)
    # one tool after another, as on 2 cores; more cores run racecheck in shares at once
    # (test_runs_go_at_once_and_each_tool_reports_over_its_shares)
    assert cli.main(["sanitize", "--tool", "memcheck,racecheck", "--jobs", "1"]) == exitcodes.OK
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("sanitize: clean in ")
    assert any(line.startswith("sanitize: memcheck  PASS") for line in out)
    doc = json.loads((isolated / "reports" / "sanitize.json").read_text())
    assert doc["status"] == "pass" and list(doc["tools"]) == ["memcheck", "racecheck"]
    assert doc["tools"]["racecheck"]["errors"] == 0
    calls = (isolated / "fake" / "calls").read_text().splitlines()
    assert calls == [
        "tool=memcheck caching=1 ws=on defines=",
        "tool=racecheck caching=on ws=0 defines=",
    ]
    stages = json.loads((isolated / "reports" / "stages.json").read_text())["stages"]
    assert stages["sanitize"]["status"] == "ok"


def test_each_tool_says_what_its_pass_does_not_cover(isolated, fake_gpu, fake_sanitizer, capsys):
    fake_sanitizer("memcheck", CLEAN)
    fake_sanitizer("racecheck", RACECHECK_CLEAN)
    assert sanitize.main(["--tool", "memcheck,racecheck"]) == exitcodes.OK
    out = capsys.readouterr().out
    assert (
        "  racecheck: not checked: TMA, wgmma, named barrier; not documented: bulk reduce, "
        "mbarrier\n"
    ) in out
    assert "  memcheck: not checked: mbarrier, named barrier; not documented: bulk reduce\n" in out
    calls = (isolated / "fake" / "calls").read_text()
    assert "tool=racecheck caching=on ws=0 " in calls and "tool=memcheck caching=1 ws=on " in calls
    doc = json.loads((isolated / "reports" / "sanitize.json").read_text())
    assert doc["schema"] == "flashmoe-science/sanitize/2"
    assert doc["sanitizer_options"] == ["--check-bulk-copy", "--check-warpgroup-mma"]
    memcheck, racecheck = doc["tools"]["memcheck"], doc["tools"]["racecheck"]
    assert "--check-bulk-copy yes --check-warpgroup-mma yes" in memcheck["command"]
    assert "--check-warpgroup-mma" not in racecheck["command"]
    assert [s["feature"] for s in racecheck["coverage"]] == list(sanitize_coverage.FEATURES)
    assert {s["status"] for s in racecheck["coverage"] if s["feature"] == "tma"} == {"not checked"}


def test_an_older_sanitizer_is_said_not_to_check_tma_or_wgmma(
    isolated, fake_gpu, fake_sanitizer, capsys
):
    (isolated / "fake" / "help.txt").write_text(HELP_OLD)
    fake_sanitizer("memcheck", CLEAN)
    assert sanitize.main(["--tool", "memcheck"]) == exitcodes.OK
    assert (
        "  memcheck: not checked: TMA, bulk reduce, wgmma, mbarrier, named barrier\n"
        in capsys.readouterr().out
    )
    doc = json.loads((isolated / "reports" / "sanitize.json").read_text())
    memcheck = doc["tools"]["memcheck"]
    assert doc["sanitizer_options"] == [] and "--check-" not in memcheck["command"]
    why = {s["feature"]: s["why"] for s in memcheck["coverage"]}
    assert why["tma"] == "this compute-sanitizer has no --check-bulk-copy"
    assert why["wgmma"] == "this compute-sanitizer has no --check-warpgroup-mma"


def test_a_finding_fails_with_a_condensed_report(isolated, fake_gpu, fake_sanitizer, capsys):
    fake_sanitizer("memcheck", MEMCHECK_OOB, rc=99)
    fake_sanitizer("initcheck", INITCHECK_UNINIT, rc=99)
    args = ["--tool", "memcheck", "--tool", "initcheck", "--define", "FLASHMOE_PLANT_BUG=3"]
    assert cli.main(["sanitize", *args]) == exitcodes.GATE_FAILED
    assert fake_gpu == [("FLASHMOE_PLANT_BUG=3",)]
    out = capsys.readouterr().out
    assert f"memcheck: Invalid __global__ read of size 16 bytes in {FWD_SHORT}" in out
    assert "initcheck: Uninitialized __global__ memory read of size 2 bytes" in out
    assert out.strip().splitlines()[-1].startswith("sanitize: FAILED (memcheck, initcheck) in ")
    doc = json.loads((isolated / "reports" / "sanitize.json").read_text())
    memcheck = doc["tools"]["memcheck"]
    assert memcheck["status"] == "fail" and memcheck["errors"] == 3
    assert memcheck["findings"][0]["kernel"] == FWD_SHORT
    assert doc["defines"] == ["FLASHMOE_PLANT_BUG=3"]
    assert "defines=FLASHMOE_PLANT_BUG=3" in (isolated / "fake" / "calls").read_text()
    assert (isolated / "reports" / "sanitize-memcheck.log").read_text().count(
        "Invalid __global__"
    ) == 2
    stages = json.loads((isolated / "reports" / "stages.json").read_text())["stages"]
    assert stages["sanitize"]["status"] == "fail"


def test_a_crashed_workload_fails_and_says_why(isolated, fake_gpu, fake_sanitizer, capsys):
    fake_sanitizer(
        "synccheck", "========= COMPUTE-SANITIZER\nsanitize-case: x\nSegmentation fault\n", rc=139
    )
    assert sanitize.main(["--tool", "synccheck"]) == exitcodes.GATE_FAILED
    out = capsys.readouterr().out
    assert (
        "synccheck: error: the workload exited 139 after 1 calls without a finding: Segmentation fault"
        in out
    )


@pytest.mark.parametrize("text", [NOT_SUPPORTED, ERROR_999, NO_PERMISSION])
def test_not_permitted_exits_126_with_one_line(isolated, fake_gpu, fake_sanitizer, capsys, text):
    fake_sanitizer("memcheck", text, rc=1)
    assert sanitize.main(["--tool", "memcheck"]) == exitcodes.TOOL_MISSING
    out = capsys.readouterr().out.strip().splitlines()
    assert "cannot instrument this GPU here" in out[-1]
    assert sum("cannot instrument" in line for line in out) == 1


def test_unknown_tool_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sanitize.main(["--tool", "leakcheck"])
    assert exit_info.value.code == exitcodes.USAGE


def test_cli_lists_the_command():
    assert cli.COMMANDS["sanitize"][0] == "flashmoe_science.pipeline.tools.sanitize"


# --------------------------------------------------------------------------------------------------
# On a GPU: a planted out-of-bounds read that memcheck must report
# --------------------------------------------------------------------------------------------------


def _sanitize(
    tmp_path: Path, *args: str, only: str = "", plant: int = 0
) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = dict(os.environ, FLASHMOE_REPORTS_DIR=str(tmp_path))
    env.pop("FLASHMOE_BUILD_DEFINES", None)
    env.pop(_loader.ONLY_VAR, None)
    if only:
        env[_loader.ONLY_VAR] = only
    if plant:  # the plant unit's choice (with --define PLANT_DEFINE)
        env["FLASHMOE_PLANT_BUG"] = str(plant)
    run = subprocess.run(
        [sys.executable, "-m", "flashmoe_science", "sanitize", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if run.returncode == exitcodes.TOOL_MISSING:
        pytest.skip(run.stdout.strip().splitlines()[-1])
    doc_path = tmp_path / "sanitize.json"
    return run, json.loads(doc_path.read_text()) if doc_path.exists() else None


@pytest.mark.gpu
@pytest.mark.slow
def test_planted_out_of_bounds_read_fails_memcheck(tmp_path):
    """FLASHMOE_PLANT_BUG=3 reads the KV rows past the sequence end, far out of bounds, instead of
    zero-filling them: memcheck reports it and the command exits 1. memcheck stops at the first
    faulty call, the workload's first (which reaches the plant). The plant unit the GPU job's
    build step made (`build --plants`: every plant in, picked by $FLASHMOE_PLANT_BUG at run time)
    serves, so nothing compiles here."""
    first = sanitize.workload_cases(_loader.Restriction())[0]
    assert first.kind == "prefill" and first.seqlen_k % 64, "a partial key tile: plant 3's read"
    run, doc = _sanitize(tmp_path, "--tool", "memcheck", "--define", _loader.PLANT_DEFINE, plant=3)
    assert run.returncode == exitcodes.GATE_FAILED, run.stdout[-3000:] + run.stderr[-3000:]
    assert doc is not None and doc["tools"]["memcheck"]["status"] == "fail"
    findings = doc["tools"]["memcheck"]["findings"]
    # The load is inlined from flash_kernel_utils.cuh: the finding names the kernel when the tool
    # prints its Device Frame, else the inlined loader; either way the planted line.
    assert any(
        (
            (f["kernel"] or "").startswith("flash_fwd_kernel")
            or (
                (f["kernel"] or "").startswith("load_kv_tile")
                and (f["where"] or "").startswith("flash_kernel_utils.cuh")
            )
        )
        and f["check"].startswith("Invalid __")
        and " read of size " in f["check"]
        for f in findings
    ), findings
    assert "memcheck: Invalid __" in run.stdout and "flash_fwd_kernel" in run.stdout


def test_every_kernel_is_instrumented():
    """compute-sanitizer and ncu only look at kernels whose names pass their filters, so a kernel
    missing from them would go unchecked without a word. Every __global__ in csrc/ must pass both."""
    import re

    from flashmoe_science.pipeline.paths import REPO_ROOT
    from flashmoe_science.pipeline.tools import profile

    source = "\n".join(p.read_text() for p in sorted((REPO_ROOT / "csrc").glob("*.cuh")))
    kernels = set(
        re.findall(
            r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(",
            source,
        )
    )
    assert {"flash_fwd_kernel", "flash_decode_kernel", "split_kv_combine_kernel"} <= kernels
    assert {"flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel"} <= kernels
    filters = (profile.KERNEL_FILTER, profile.BACKWARD_FILTER)
    for name in kernels:
        assert any(s in name for s in sanitize.KERNEL_SUBSTRINGS), (
            name,
            sanitize.KERNEL_SUBSTRINGS,
        )
        assert any(re.search(f.removeprefix("regex:"), name) for f in filters), (name, filters)


def test_an_inlined_fault_is_attributed_to_its_kernel():
    """A fault in an inlined helper (load_kv_tile) names the kernel from its Device Frame and keeps
    the faulting line."""
    text = f"""\
========= COMPUTE-SANITIZER
sanitize-case: {CASE}
========= Invalid __global__ read of size 16 bytes
=========     at void flashmoe::cuda::load_kv_tile<(int)64, (int)64, (int)128, __half>(__half *, \
const __half *, long, int, int, int)+0x1b70 in /work/main/csrc/flash_kernel_utils.cuh:157
=========     by thread (8,0,0) in block (0,0,0)
=========     Access at 0x7f5e3c200410 is out of bounds
=========     Device Frame: {FWD}+0x1b70 in /work/main/csrc/flash_fwd_kernel.cuh:92
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2e0c6f] in libcuda.so.1
=========
========= ERROR SUMMARY: 1 error
"""
    (finding,) = sanitize.parse_sanitizer_output("memcheck", text).findings
    assert finding.kernel == FWD_SHORT
    assert finding.where == "flash_kernel_utils.cuh:157 (load_kv_tile)"


def test_workload_covers_padded_head_dims_last():
    """80 and 96 on the 128 tile and v's 128 under 192: each mma.sync forward configuration the
    card runs and the automatic choice, split partials and their combine, decode with a fused
    combine, the backward (automatic, 1, 2 and the wgmma one where the card runs them, atomic and
    deterministic dQ), and paged decode and
    packed batches where v's head dim is q's; appended after the wide head dims, before the wide
    wgmma backward's block."""
    from flashmoe_science.pipeline.gates.paged import PagedCase
    from flashmoe_science.pipeline.gates.varlen import VarlenCase

    workload = sanitize.workload_cases()
    padded = sanitize.padded_head_dim_workload(sanitize.workload_configs())
    end = len(workload) - len(sanitize.wide_wgmma_backward_workload())
    assert workload[end - len(padded) : end] == padded
    assert sanitize.PADDED_HEAD_DIMS == ((80, 80), (96, 96), (192, 128))
    for dims in sanitize.PADDED_HEAD_DIMS:
        mine = [c for c in padded if isinstance(c, Case) and (c.head_dim, c.value_head_dim) == dims]
        fwd = [c for c in mine if c.kind == "prefill"]
        wgmma = dims in sanitize.WGMMA_PADDED_FORCED and 5 in sanitize.workload_configs()
        assert {c.config for c in fwd} == {
            0,
            *[k for k in (1, 2, 4) if k in sanitize.workload_configs()],
            *([5] if wgmma else []),
        }
        assert any(c.num_splits > 1 for c in fwd)
        assert all(c.num_splits > 1 for c in fwd if c.config == 5)
        decode = [
            (c.num_splits, c.config, bool(c.cache_seqlens)) for c in mine if c.kind == "decode"
        ]
        assert decode == [*([(0, 5, True)] if wgmma else []), (7, 0, True)]
        bwd = {(c.config, c.deterministic) for c in mine if c.kind == "backward"}
        forced = sanitize.workload_backward_configs()
        configs = {0, 1, *(c for c in (2,) if c in forced)}
        if dims in sanitize.WGMMA_BWD_PADDED_FORCED and 3 in forced:
            configs.add(3)  # the wgmma backward's 128 tile padded
        assert bwd == {(c, d) for c in configs for d in (False, True)}
        others = [c for c in padded if not isinstance(c, Case) and c.head_dim == dims[0]]
        expected = {PagedCase, VarlenCase} if dims[0] == dims[1] else set()
        assert {type(c) for c in others} == expected


# --------------------------------------------------------------------------------------------------
# Runs at once: racecheck in shares of the workload, the other tools beside it
# --------------------------------------------------------------------------------------------------


def test_the_plan_splits_racecheck_and_runs_the_longest_first():
    tools = list(sanitize.TOOLS)
    assert sanitize.plan(tools, 1) == [(t, (0, 1)) for t in tools]  # one after another
    assert sanitize.plan(tools, 2) == [
        ("racecheck", (0, 2)),
        ("racecheck", (1, 2)),
        *[(t, (0, 1)) for t in ("memcheck", "initcheck", "synccheck")],
    ]
    seven = sanitize.plan(tools, 7)
    assert seven[:4] == [("racecheck", (k, 4)) for k in range(4)] and len(seven) == 7
    assert sanitize.plan(["memcheck"], 7) == [("memcheck", (0, 1))]


def test_the_workloads_shares_split_it_without_loss_or_overlap(capsys):
    cases = sanitize.workload_cases()
    shares = [sanitize.workload_share(cases, (k, 4)) for k in range(4)]
    assert sorted(c.id for share in shares for c in share) == sorted(c.id for c in cases)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    kinds = {type(c).__name__ + getattr(c, "kind", "") for c in cases}
    assert all(
        {type(c).__name__ + getattr(c, "kind", "") for c in share} == kinds for share in shares
    )
    assert sanitize.main(["--list", "--share", "2/4"]) == exitcodes.OK
    assert capsys.readouterr().out.split() == [c.id for c in shares[1]]
    with pytest.raises(SystemExit):
        sanitize.main(["--list", "--share", "5/4"])


def test_runs_go_at_once_and_each_tool_reports_over_its_shares(
    isolated, fake_gpu, fake_sanitizer, monkeypatch, capsys
):
    """--jobs 7: racecheck's four shares and the three other tools start together (the stand-in
    waits until all seven have started, else fails); a hazard in one share fails racecheck, with
    the errors of every share summed, and each tool keeps one log."""
    monkeypatch.setenv("FAKE_BARRIER", "7")
    for tool in ("memcheck", "initcheck", "synccheck", "racecheck"):
        fake_sanitizer(tool, CLEAN if tool != "racecheck" else RACECHECK_CLEAN)
    fake = isolated / "fake"
    (fake / "racecheck.3o4.txt").write_text(RACECHECK_HAZARD)
    (fake / "racecheck.3o4.rc").write_text("99")
    assert sanitize.main(["--jobs", "7"]) == exitcodes.GATE_FAILED
    out = capsys.readouterr().out
    assert "sanitize: 7 runs, 7 at a time (racecheck in 4 shares)" in out
    assert "waited alone" not in (isolated / "reports" / "sanitize-racecheck.log").read_text()
    calls = sorted((fake / "calls").read_text().splitlines())
    assert [c for c in calls if "racecheck" in c] == [
        f"tool=racecheck caching=on ws=0 defines= share={k}/4" for k in range(1, 5)
    ]
    doc = json.loads((isolated / "reports" / "sanitize.json").read_text())
    racecheck = doc["tools"]["racecheck"]
    assert (racecheck["status"], racecheck["shares"], racecheck["errors"]) == ("fail", 4, 1)
    assert racecheck["findings"][0]["check"] == "Potential RAW hazard on __shared__"
    assert "--share 3/4" in racecheck["command"], "the command of the run that failed"
    assert {t: doc["tools"][t]["status"] for t in ("memcheck", "initcheck", "synccheck")} == {
        "memcheck": "pass", "initcheck": "pass", "synccheck": "pass"
    }  # fmt: skip
    assert doc["status"] == "fail" and out.strip().splitlines()[-1].startswith(
        "sanitize: FAILED (racecheck) in "
    )
    logs = sorted(p.name for p in (isolated / "reports").glob("sanitize-*.log"))
    assert logs == [
        f"sanitize-{t}.log" for t in ("initcheck", "memcheck", "racecheck", "synccheck")
    ]
    log = (isolated / "reports" / "sanitize-racecheck.log").read_text()
    assert [line.split(" (")[0] for line in log.splitlines() if line.startswith("=== share")] == [
        f"=== share {k}/4" for k in range(1, 5)
    ]
