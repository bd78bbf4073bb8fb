"""`python -m flashmoe_science profile CASE` (`nox -s profile -- CASE`): Nsight Compute (ncu) on one
benchmark case, a short summary per kernel, and a one-line verdict of what bounds it.

    python -m flashmoe_science profile fwd-bf16-d128-h16-b1-s16384-causal
    python -m flashmoe_science profile dec-bf16-d128-h32-b1-q1-k131072 --output /tmp/prof
    python -m flashmoe_science profile CASE --import reports/profile-CASE.ncu-rep   # summary only
    python -m flashmoe_science profile bwd-bf16-d128-h16-b8-s2048-causal --against sdpa-cudnn

CASE is a bench case id (`python -m flashmoe_science bench --list`), parsed and given inputs exactly
as bench does. ncu runs `python -m flashmoe_science.pipeline.tools.profile --workload CASE`, which calls our
operator 2 * WARMUP_CALLS + PROFILED_LAUNCHES times; ncu skips the first 2 * WARMUP_CALLS launches
of our kernels (a call launches one or two: the forward kernel and, when it splits, the combine
kernel, so that many launches are always past the warm-up) and profiles the next PROFILED_LAUNCHES,
with `--clock-control none` (the clocks bench and its ceilings run at) and a fixed set of sections
and metrics (ncu_command, the one place to adjust them). The full report goes to
<reports>/profile-CASE.ncu-rep (open it in Nsight Compute); the summary is read back with `ncu
--import ... --csv --page raw --print-units base` (parse_ncu_csv) and written to
<reports>/profile-CASE.json.

`--against NAME` profiles a bench baseline (sdpa-cudnn, sdpa-flash, ...) on the same inputs
instead of our operator: the workload's last call runs inside the NVTX range AGAINST_RANGE, and ncu
profiles every kernel launched in it (`--nvtx --nvtx-include`; a baseline's kernel names are its
own), so the record is a whole call of the baseline. Its files are profile-CASE-NAME.*, and when
this folder holds our profile of the same case the summary ends with the two calls side by side.

Per kernel: time; achieved TFLOP/s (the case's FLOPs over the forward kernel's time) and DRAM GB/s,
each against the ceilings bench measures on this card (the large matmul and the large copy; read
from <reports>/bench.json when it was measured on this GPU model, else measured here first);
achieved and theoretical occupancy and what limits it (the smallest of ncu's blocks-per-SM limits:
registers, shared memory, blocks, warps); shared-memory bank conflicts; where the report holds
them, the L2's and L1's throughput (the L2's bytes by operation) and the three busiest pipes (which
of the SM's units a kernel that DRAM does not bound waits on); the top 3 warp stall reasons; then
the verdict, by this decision tree (classify_bound):

    1. launch   time < 10 us and the grid is less than one wave (fewer blocks than SMs)
                lever: more work per launch (batch heads or sequences, split along KV to fill the
                SMs, CUDA graphs for the launch overhead)
    2. memory   DRAM GB/s > 60% of the copy ceiling (ncu's DRAM % of peak when no ceiling)
                lever: fewer bytes (read each K/V byte once: GQA packing), wider loads (16-byte
                cp.async, whole sectors), a better split so every SM streams
    3. compute  SM throughput or TFLOP/s > 60% of peak (of the matmul ceiling); when memory is
                also > 60%, the larger of the two wins
                lever: fewer non-matmul instructions (exp2 with the scale folded in, fewer
                rescales), larger tiles (more MMA per byte loaded)
    4. latency  otherwise: neither memory nor compute is busy
                lever: more work in flight: occupancy (its limiter), double buffering, and fewer
                stalls on the top stall reason (STALL_HINTS says what each usually means)

Exit codes: 0 ok; 1 ncu ran but profiled nothing or the workload failed; 2 bad CASE or options; 125
the extension does not build; 126 ncu missing or not permitted to read the GPU's counters
(ERR_NVGPUCTRPERM); 255 no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..._toolkit import find_cuda_tool, run_streaming
from .. import exitcodes, paths
from ..bench.records import BASELINE_NAMES
from ..cli import program
from ..provenance import provenance
from .cudatools import UNUSABLE_PATTERNS, paths_display, short_kernel

SCHEMA = "flashmoe-science/profile/1"
NCU_GLOBS = ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda*/nsight-compute*/ncu")
KERNEL_FILTER = "regex:flash_fwd|flash_decode|split_kv|varlen_offsets"
# Backward and training-step cases: the backward's kernels alone, three launches a call (the
# pre-pass, dK/dV, then the dQ conversion or the deterministic dQ pass), all three profiled.
BACKWARD_FILTER = "regex:flash_bwd"
BACKWARD_KERNELS_PER_CALL = 3
WARMUP_CALLS = 3
MAX_KERNELS_PER_CALL = 2  # flash_fwd_kernel, then split_kv_combine_kernel when the call splits
# (flash_decode_kernel combines its splits itself: one launch per call)
PROFILED_LAUNCHES = 2
# --against: the baseline's last call runs in this NVTX range, the only one ncu profiles.
AGAINST_RANGE = "flashmoe-profile"
NCU_TIMEOUT_S = 600
SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
    "MemoryWorkloadAnalysis_Tables",
    "ComputeWorkloadAnalysis",
)
# Named explicitly so the summary finds them whatever the sections hold in this ncu version.
METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__maximum_warps_per_active_cycle_pct",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__occupancy_limit_blocks",
    "launch__occupancy_limit_warps",
    "launch__registers_per_thread",
    "launch__grid_size",
    "launch__block_size",
    "launch__waves_per_multiprocessor",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
)
# The L2's figures where the report holds them (the sections' own breakdowns; not asked for by
# name, so an ncu that lacks one still profiles): its throughput, and its sectors (32 bytes) by
# operation, all sources or the SMs' alone, whichever the report has: reads, writes, reductions
# (the backward's dQ adds) and atomics.
L2_PCT_METRICS = (
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
)
L2_OPS = ("read", "write", "red", "atom")
# L1 and shared memory (one unit on the SM), and the pipes' busy cycles (ComputeWorkloadAnalysis):
# with the L2's, they say which of the SM's units a kernel that is not DRAM-bound waits on.
L1_PCT_METRIC = "l1tex__throughput.avg.pct_of_peak_sustained_elapsed"
SHARED_WAVEFRONTS_METRIC = "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
_PIPE_FAMILIES = (  # busy cycles preferred; then instructions issued
    re.compile(r"^sm__pipe_(?P<p>\w+?)_cycles_active\.avg\.pct_of_peak_sustained_active$"),
    re.compile(r"^sm__inst_executed_pipe_(?P<p>\w+?)\.avg\.pct_of_peak_sustained_active$"),
)
L2_SECTOR_BYTES = 32
NCU_UNUSABLE = (
    re.compile(r"ERR_NVGPUCTRPERM"),
    re.compile(r"Failed to initialize the profiler", re.IGNORECASE),
    re.compile(r"Profiling is not supported on this device", re.IGNORECASE),
    re.compile(r"does not have permission to access NVIDIA GPU Performance Counters", re.I),
    *UNUSABLE_PATTERNS,
)

LAUNCH_MAX_US = 10.0
BUSY_PCT = 60.0
LEVERS = {
    "launch": "more work per launch: batch heads or sequences, split along KV to fill the SMs, "
    "CUDA graphs for the launch overhead",
    "memory": "fewer bytes (read each K/V byte once: GQA packing), wider loads (16-byte cp.async, "
    "whole sectors), a better split so every SM streams",
    "compute": "fewer non-matmul instructions (exp2 with the scale folded in, fewer rescales), "
    "larger tiles (more MMA per byte loaded)",
}
STALL_HINTS = {
    "long_scoreboard": "waiting on global memory: issue the next tile's loads earlier",
    "barrier": "waiting at __syncthreads: fewer barriers per tile",
    "short_scoreboard": "waiting on shared memory or exp/MUFU: fewer ldmatrix/exp per MMA",
    "mio_throttle": "shared-memory instruction queue full: fewer, wider shared accesses",
    "math_pipe_throttle": "a math pipe is saturated: move work to another pipe",
    "wait": "fixed-latency dependencies: more independent instructions",
    "not_selected": "warps ready but not picked: parallelism is there, look elsewhere",
    "lg_throttle": "global memory queue full: fewer, wider global accesses",
    "no_instruction": "instruction cache misses: less unrolled code",
    "dispatch_stall": "dispatch stalls: pipeline conflicts",
    "drain": "waiting for stores to drain at exit",
    "imc_miss": "constant cache misses",
    "branch_resolving": "branch resolution: fewer divergent branches",
}


# --------------------------------------------------------------------------------------------------
# ncu: the command lines
# --------------------------------------------------------------------------------------------------


def workload_calls() -> int:
    return MAX_KERNELS_PER_CALL * WARMUP_CALLS + PROFILED_LAUNCHES


def is_backward(case_id: str) -> bool:
    return case_id.startswith(("bwd-", "fwdbwd-"))


def kernel_filter(case_id: str) -> str:
    """ncu's --kernel-name for our kernels of this case."""
    return BACKWARD_FILTER if is_backward(case_id) else KERNEL_FILTER


def ncu_command(ncu: str, case_id: str, report_base: Path, against: str | None = None) -> list[str]:
    """The one place the profiling command line is put together (ncu adds .ncu-rep to -o).
    Ours: our kernels by name, past the warm-up launches. `against` (a baseline): every kernel
    of the one call inside AGAINST_RANGE (run_workload), whatever its names."""
    command = [ncu, "--force-overwrite", "-o", str(report_base)]
    if against:
        command += ["--nvtx", "--nvtx-include", AGAINST_RANGE]  # a start/end range (nvtx_range)
    else:
        backward = is_backward(case_id)
        per_call = BACKWARD_KERNELS_PER_CALL if backward else MAX_KERNELS_PER_CALL
        launches = BACKWARD_KERNELS_PER_CALL if backward else PROFILED_LAUNCHES
        command += ["--kernel-name", kernel_filter(case_id)]
        command += ["--launch-skip", str(per_call * WARMUP_CALLS)]
        command += ["--launch-count", str(launches)]
    command += ["--clock-control", "none"]
    for section in SECTIONS:
        command += ["--section", section]
    command += ["--metrics", ",".join(METRICS)]
    workload = ["-m", "flashmoe_science.pipeline.tools.profile", "--workload", case_id]
    workload += ["--against", against] if against else []
    return [*command, sys.executable, *workload, "--calls", str(workload_calls())]


def ncu_import_command(ncu: str, report: Path) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]


def unusable_reason(text: str) -> str | None:
    for line in text.splitlines():
        if any(p.search(line) for p in NCU_UNUSABLE):
            return line.replace("==ERROR==", "").strip()[:300]
    return None


# --------------------------------------------------------------------------------------------------
# Reading the raw CSV page (pure)
# --------------------------------------------------------------------------------------------------

_SCALE = {
    "": 1.0,
    "nsecond": 1.0,
    "usecond": 1e3,
    "msecond": 1e6,
    "second": 1e9,
    "byte": 1.0,
    "Kbyte": 1e3,
    "Mbyte": 1e6,
    "Gbyte": 1e9,
    "Tbyte": 1e12,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
}


def _unit_scale(unit: str) -> float:
    """Factor to the base unit (nanoseconds, bytes, bytes/second); 1 for %, counts, cycles."""
    unit = unit.strip()
    if unit.endswith("/second") or unit.endswith("/s"):
        head = unit.rsplit("/", 1)[0]
        return _SCALE.get(head, 1.0)
    if unit.endswith("/usecond"):
        return _SCALE.get(unit.rsplit("/", 1)[0], 1.0) * 1e6
    return _SCALE.get(unit, 1.0)


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> list[dict]:
    """`ncu --import R --csv --page raw` -> one dict per profiled launch: the kernel's name (long
    and short) and every numeric metric in base units. Lines before the header ("==PROF==",
    warnings) are skipped; the row after the header holds the units when its ID cell is empty."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(lines[start:]))
    header, rows = rows[0], [r for r in rows[1:] if r]
    units = [""] * len(header)
    if rows and rows[0] and rows[0][0] == "":
        units, rows = rows[0], rows[1:]
    launches = []
    for row in rows:
        if len(row) != len(header):
            continue
        cells = dict(zip(header, row, strict=True))
        metrics = {}
        for name, raw, unit in zip(header, row, units, strict=True):
            if "__" not in name:  # "ID", "Kernel Name", "Grid Size", ...: not metrics
                continue
            value = _number(raw)
            if value is not None:
                metrics[name] = value * _unit_scale(unit)
        name = cells.get("Kernel Name", "?")
        launches.append(
            {
                "id": cells.get("ID"),
                "name": name,
                "kernel": short_kernel(name),
                "metrics": metrics,
            }
        )
    return launches


_STALL_FAMILIES = (  # cycles per issued instruction, preferred; then the other spellings
    re.compile(r"^smsp__average_warp_latency_issue_stalled_(?P<r>\w+?)(?:\.ratio|\.pct)?$"),
    re.compile(
        r"^smsp__average_warps_issue_stalled_(?P<r>\w+?)_per_issue_active(?:\.ratio|\.pct)?$"
    ),
    re.compile(r"^smsp__pcsamp_warps_issue_stalled_(?P<r>\w+?)(?:\.sum)?$"),
)
_NOT_STALLS = {"selected", "not_issued", "issued", "sleeping_not_issued"}


def top_stalls(metrics: dict, count: int = 3) -> list[tuple[str, float]]:
    """The `count` largest warp stall reasons from the first metric family present."""
    for family in _STALL_FAMILIES:
        found = {}
        for name, value in metrics.items():
            match = family.match(name)
            if match and not match["r"].endswith("_not_issued") and match["r"] not in _NOT_STALLS:
                found[match["r"]] = value
        if found:
            return _largest(found, count)
    return []


def _largest(found: dict[str, float], count: int) -> list[tuple[str, float]]:
    """The `count` largest positive values of `found`, largest first, with their names."""
    ranked = sorted(found.items(), key=lambda kv: kv[1], reverse=True)
    return [(name, value) for name, value in ranked[:count] if value > 0]


def busiest_pipes(metrics: dict, count: int = 3) -> list[tuple[str, float]]:
    """The `count` busiest pipes (% of their peak) from the first metric family present."""
    for family in _PIPE_FAMILIES:
        found = {m["p"]: value for name, value in metrics.items() if (m := family.match(name))}
        if found:
            return _largest(found, count)
    return []


def occupancy_limiter(metrics: dict) -> tuple[str | None, dict[str, float]]:
    """(what limits blocks per SM, the limits): the smallest of ncu's per-resource limits."""
    limits = {
        key: metrics[f"launch__occupancy_limit_{key}"]
        for key in ("registers", "shared_mem", "blocks", "warps")
        if f"launch__occupancy_limit_{key}" in metrics
    }
    if not limits:
        return None, {}
    low = min(limits.values())
    names = {"registers": "registers", "shared_mem": "shared memory", "blocks": "blocks per SM"}
    names["warps"] = "warps per SM"
    lowest = [names[k] for k, v in limits.items() if v == low]
    text = lowest[0] if len(lowest) == 1 else f"{', '.join(lowest[:-1])} and {lowest[-1]}"
    return text, limits


# --------------------------------------------------------------------------------------------------
# Figures and the verdict (pure)
# --------------------------------------------------------------------------------------------------


def _pct(value: float | None, ceiling: float | None) -> float | None:
    return 100.0 * value / ceiling if value is not None and ceiling else None


def l2_figures(metrics: dict) -> tuple[float | None, dict[str, float]]:
    """(the L2's throughput in % of its peak, bytes by operation) from one launch's metrics; None
    and {} where the report has none of them."""
    pct = next((metrics[name] for name in L2_PCT_METRICS if name in metrics), None)
    by_op = {}
    for op in L2_OPS:
        for name in (f"lts__t_sectors_op_{op}.sum", f"lts__t_sectors_srcunit_tex_op_{op}.sum"):
            if name in metrics:
                by_op[op] = metrics[name] * L2_SECTOR_BYTES
                break
    return pct, by_op


def kernel_figures(
    launches: list[dict], flops: int | None, ceilings: dict, sm_count: int | None
) -> dict:
    """Figures of one kernel from its profiled launches (time averaged, the rest from the first).
    `flops` is the case's FLOP count when this is the kernel that does the matmuls, else None."""
    metrics = launches[0]["metrics"]
    times = [
        x["metrics"]["gpu__time_duration.sum"]
        for x in launches
        if "gpu__time_duration.sum" in x["metrics"]
    ]
    time_ns = sum(times) / len(times) if times else None
    seconds = time_ns * 1e-9 if time_ns else None
    dram_bytes = None
    if "dram__bytes_read.sum" in metrics or "dram__bytes_write.sum" in metrics:
        dram_bytes = metrics.get("dram__bytes_read.sum", 0.0) + metrics.get(
            "dram__bytes_write.sum", 0.0
        )
    gbps = dram_bytes / seconds / 1e9 if dram_bytes is not None and seconds else None
    tflops = flops / seconds / 1e12 if flops and seconds else None
    limiter, limits = occupancy_limiter(metrics)
    copy_gbps = (ceilings.get("copy") or {}).get("gbps")
    matmul_tflops = (ceilings.get("matmul") or {}).get("tflops")
    if sm_count is None and "device__attribute_multiprocessor_count" in metrics:
        sm_count = int(metrics["device__attribute_multiprocessor_count"])
    l2_pct, l2_bytes = l2_figures(metrics)
    return {
        "kernel": launches[0]["kernel"],
        "name": launches[0]["name"],
        "launches": len(launches),
        "time_us": time_ns / 1e3 if time_ns is not None else None,
        "tflops": tflops,
        "pct_matmul_ceiling": _pct(tflops, matmul_tflops),
        "dram_gbps": gbps,
        "pct_copy_ceiling": _pct(gbps, copy_gbps),
        "dram_pct_of_peak": metrics.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        "sm_pct_of_peak": metrics.get("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
        "memory_pct_of_peak": metrics.get(
            "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"
        ),
        "occupancy_achieved_pct": metrics.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
        "occupancy_theoretical_pct": metrics.get("sm__maximum_warps_per_active_cycle_pct"),
        "occupancy_limiter": limiter,
        "blocks_per_sm_limits": limits,
        "registers_per_thread": metrics.get("launch__registers_per_thread"),
        "grid_blocks": metrics.get("launch__grid_size"),
        "block_threads": metrics.get("launch__block_size"),
        "waves": metrics.get("launch__waves_per_multiprocessor"),
        "sm_count": sm_count,
        "bank_conflicts_ld": metrics.get(
            "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
        ),
        "bank_conflicts_st": metrics.get(
            "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
        ),
        "l2_pct_of_peak": l2_pct,
        "l2_bytes": l2_bytes,
        "l1_pct_of_peak": metrics.get(L1_PCT_METRIC),
        "shared_wavefronts": metrics.get(SHARED_WAVEFRONTS_METRIC),
        "busiest_pipes": busiest_pipes(metrics),
        "top_stalls": top_stalls(metrics),
    }


def classify_bound(fig: dict) -> dict:
    """The decision tree of the module docstring: {"bound", "why", "lever"}."""
    time_us, waves, grid, sms = (
        fig.get("time_us"),
        fig.get("waves"),
        fig.get("grid_blocks"),
        fig.get("sm_count"),
    )
    small_grid = waves < 1 if waves is not None else (grid is not None and sms and grid < sms)
    if time_us is not None and time_us < LAUNCH_MAX_US and small_grid:
        size = f"{waves:.2g} waves" if waves is not None else f"{grid:.0f} blocks on {sms} SMs"
        return {
            "bound": "launch",
            "why": f"{time_us:.3g} us and {size}",
            "lever": LEVERS["launch"],
        }
    memory = fig.get("pct_copy_ceiling")
    memory_what = "of the copy ceiling"
    if memory is None:
        memory, memory_what = fig.get("dram_pct_of_peak"), "of DRAM peak"
    compute_candidates = [
        (fig.get("sm_pct_of_peak"), "SM throughput"),
        (fig.get("pct_matmul_ceiling"), "of the matmul ceiling"),
    ]
    compute, compute_what = max(
        ((v, w) for v, w in compute_candidates if v is not None), default=(None, "")
    )
    busy_memory = memory is not None and memory > BUSY_PCT
    busy_compute = compute is not None and compute > BUSY_PCT
    if busy_memory and (not busy_compute or memory >= compute):
        return {
            "bound": "memory",
            "why": f"DRAM {memory:.0f}% {memory_what}",
            "lever": LEVERS["memory"],
        }
    if busy_compute:
        return {
            "bound": "compute",
            "why": f"{compute:.0f}% {compute_what}",
            "lever": LEVERS["compute"],
        }
    parts = []
    if memory is not None:
        parts.append(f"DRAM {memory:.0f}% {memory_what}")
    if compute is not None:
        parts.append(f"{compute:.0f}% {compute_what}")
    stalls = fig.get("top_stalls") or []
    lever = "more work in flight: occupancy"
    if fig.get("occupancy_limiter"):
        lever += f" (limited by {fig['occupancy_limiter']})"
    lever += ", double buffering"
    if stalls:
        reason = stalls[0][0]
        hint = STALL_HINTS.get(reason)
        lever += f", fewer stalls on {reason}" + (f" ({hint})" if hint else "")
    return {
        "bound": "latency",
        "why": ", ".join(parts) or "no throughput figure above 60%",
        "lever": lever,
    }


def summarize(
    launches: list[dict], case, ceilings: dict, sm_count: int | None, one_call: bool = False
) -> dict:
    """Group launches by kernel, compute the figures and verdict of each, and the call's totals.
    one_call: the launches are one whole call (--against), so the call's time is their sum (a
    kernel may run several times in it); else each kernel's mean launch, summed (ours)."""
    groups: dict[str, list[dict]] = {}
    for launch in launches:
        groups.setdefault(launch["kernel"], []).append(launch)
    kernels = []
    for name, group in groups.items():
        fig = kernel_figures(
            group,
            case.flops if "flash_fwd" in name or "flash_decode" in name else None,
            ceilings,
            sm_count,
        )
        fig["verdict"] = classify_bound(fig)
        kernels.append(fig)
    if one_call:
        total_us = sum(x["metrics"].get("gpu__time_duration.sum", 0.0) for x in launches) / 1e3
    else:
        total_us = sum(k["time_us"] for k in kernels if k["time_us"] is not None)
    seconds = total_us * 1e-6
    call = {
        "time_us": total_us or None,
        "tflops": case.flops / seconds / 1e12 if seconds else None,
        "gbps_min_bytes": case.bytes_moved / seconds / 1e9 if seconds else None,
    }
    return {"kernels": kernels, "call": call}


def _g(value, digits: int = 3, unit: str = "") -> str:
    """`digits` significant digits; whole numbers from 1,000 to 999,999 in full."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if 10**digits <= abs(value) < 1e6:
        return f"{value:.0f}{unit}"
    return f"{value:.{digits}g}{unit}"


def _time(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us / 1e3:.3g} ms" if us >= 1000 else f"{us:.3g} us"


def format_kernel(fig: dict) -> list[str]:
    lines = [
        f"  {fig['kernel']}" + (f" ({fig['launches']} launches)" if fig["launches"] > 1 else "")
    ]
    perf = f"    time {_time(fig['time_us'])}"
    if fig["tflops"] is not None:
        matmul = _g(fig["pct_matmul_ceiling"], 2, "%")
        perf += f"; {_g(fig['tflops'])} TFLOP/s ({matmul} of matmul ceiling)"
    copy, peak = _g(fig["pct_copy_ceiling"], 2, "%"), _g(fig["dram_pct_of_peak"], 2, "%")
    perf += f"; DRAM {_g(fig['dram_gbps'])} GB/s ({copy} of copy ceiling, {peak} of peak)"
    perf += f"; SM throughput {_g(fig['sm_pct_of_peak'], 2, '%')}"
    lines.append(perf)
    limits = ", ".join(f"{k} {v:.0f}" for k, v in fig["blocks_per_sm_limits"].items())
    occupancy = (
        f"    occupancy {_g(fig['occupancy_achieved_pct'], 3, '%')} achieved / "
        f"{_g(fig['occupancy_theoretical_pct'], 3, '%')} theoretical"
    )
    if fig["occupancy_limiter"]:
        occupancy += f", limited by {fig['occupancy_limiter']} (blocks/SM: {limits})"
    occupancy += (
        f"; {_g(fig['registers_per_thread'])} regs/thread; grid {_g(fig['grid_blocks'], 6)} x "
        f"{_g(fig['block_threads'])} threads, {_g(fig['waves'])} waves"
    )
    lines.append(occupancy)
    lines.append(
        f"    shared-memory bank conflicts: {_g(fig['bank_conflicts_ld'])} on loads, "
        f"{_g(fig['bank_conflicts_st'])} on stores"
    )
    if fig.get("l2_pct_of_peak") is not None or fig.get("l2_bytes"):
        ops = ", ".join(f"{op} {_g(b / 1e6)} MB" for op, b in fig["l2_bytes"].items()) or "-"
        lines.append(f"    L2 {_g(fig.get('l2_pct_of_peak'), 2, '%')} of peak; by operation: {ops}")
    if fig.get("l1_pct_of_peak") is not None or fig.get("shared_wavefronts") is not None:
        lines.append(
            f"    L1 and shared memory {_g(fig.get('l1_pct_of_peak'), 2, '%')} of peak; "
            f"shared wavefronts {_g(fig.get('shared_wavefronts'))}"
        )
    if fig.get("busiest_pipes"):
        pipes = ", ".join(f"{p} {v:.2g}%" for p, v in fig["busiest_pipes"])
        lines.append(f"    busiest pipes (% of peak): {pipes}")
    stalls = ", ".join(f"{r} {v:.3g}" for r, v in fig["top_stalls"]) or "-"
    lines.append(f"    top stalls (cycles per issued instruction): {stalls}")
    verdict = fig["verdict"]
    lines.append(
        f"    verdict: {verdict['bound']}-bound ({verdict['why']}); lever: {verdict['lever']}"
    )
    return lines


# --------------------------------------------------------------------------------------------------
# Ceilings: bench's, from bench.json or measured here
# --------------------------------------------------------------------------------------------------


def stored_ceilings(bench_json: Path, gpu_name: str | None) -> dict | None:
    """bench.json's ceilings when they were measured on this GPU model (any GPU when None)."""
    try:
        doc = json.loads(bench_json.read_text())
    except (OSError, ValueError):
        return None
    ceilings = doc.get("ceilings") if isinstance(doc, dict) else None
    gpu = (doc.get("gpu") or {}).get("name") if isinstance(doc, dict) else None
    if not isinstance(ceilings, dict) or "copy" not in ceilings or "matmul" not in ceilings:
        return None
    if gpu_name is not None and gpu != gpu_name:
        return None
    return {**ceilings, "source": f"{bench_json.name} ({doc.get('timestamp', '?')}, {gpu})"}


def measure_ceilings() -> dict:
    from ..bench import timing

    try:
        config = timing.TimingConfig.for_device("cuda")
        result = timing.measure_ceilings("cuda", timing.make_timer("cuda"), config)
    except timing.UnderXdistError as exc:
        return {"error": str(exc), "source": "not measured"}
    return {**result, "source": "measured now"}


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{program()} profile",
        description="Profile one benchmark case with Nsight Compute; say what bounds each kernel.",
    )
    p.add_argument(
        "case", metavar="CASE", help="a bench case id, e.g. fwd-bf16-d128-h16-b1-s16384-causal"
    )
    p.add_argument(
        "--output", type=Path, help="folder for the .ncu-rep and .json (default: reports/)"
    )
    p.add_argument(
        "--import",
        dest="import_report",
        type=Path,
        metavar="REP",
        help="summarize an existing .ncu-rep instead of profiling",
    )
    p.add_argument(
        "--against",
        metavar="NAME",
        help="profile this bench baseline on the case's inputs instead of our operator, every "
        f"kernel of one call ({', '.join(BASELINE_NAMES)})",
    )
    p.add_argument(
        "--no-ceilings", action="store_true", help="neither read nor measure the ceilings"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=NCU_TIMEOUT_S,
        help=f"seconds allowed for ncu (default {NCU_TIMEOUT_S})",
    )
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=workload_calls(), help=argparse.SUPPRESS)
    return p


def run_workload(case_id: str, calls: int, against: str | None = None, device: str = "cuda") -> int:
    """What ncu watches: the case's inputs made as bench makes them, then `calls` calls of our
    operator, or of baseline `against` (in its SDPA backend) with the last call inside the NVTX
    range AGAINST_RANGE."""
    import torch

    from ..bench.baselines import BASELINES, backend_context, first_call, ops, our_call, sdpa_call
    from ..cases import make_inputs, parse_case_id

    case = parse_case_id(case_id)
    x = make_inputs(case, device)
    if against is None:
        ops().load_library()
        fn = our_call(case, x)
        for _ in range(calls):
            fn()
    else:
        fn, why = sdpa_call(case, x)
        with backend_context(BASELINES[against]):
            why = why or first_call(fn)  # a backward case's first call runs its forward too
            if why:
                _say(f"profile: {against} cannot run {case_id}: {why}")
                return exitcodes.GATE_FAILED
            for _ in range(calls - 2):
                fn()
            with nvtx_range(AGAINST_RANGE):
                fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return exitcodes.OK


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX start/end range around the block: ncu's `--nvtx-include NAME` (no trailing `/`,
    which would name a push/pop range) profiles the kernels launched inside it from any thread.
    A push/pop range is the calling thread's, and a backward call's kernels are launched by
    autograd's device thread: it profiled none of them. Nothing to start without CUDA."""
    import torch

    started = torch.cuda.nvtx.range_start(name) if torch.cuda.is_available() else None
    try:
        yield
    finally:
        if started is not None:
            torch.cuda.nvtx.range_end(started)


def _say(text: str) -> None:
    print(text, flush=True)


def _show_ncu_line(line: str) -> None:
    """ncu's progress ("==PROF== Profiling ... 38 passes") as it comes; errors are told after."""
    if line.startswith("==PROF== Profiling"):
        _say(f"  {line.rstrip()}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ..cases import parse_case_arg

    case = parse_case_arg("profile", args.case)
    if case is None:
        return exitcodes.USAGE
    if args.against is not None and args.against not in BASELINE_NAMES:
        _say(
            f"profile: --against {args.against!r} is not a baseline; supported: "
            f"{', '.join(BASELINE_NAMES)} (exit {exitcodes.USAGE})"
        )
        return exitcodes.USAGE
    if args.workload:
        return run_workload(args.case, args.calls, args.against)
    out = args.output or paths.report_dir()
    out.mkdir(parents=True, exist_ok=True)
    # never an older run's record
    (out / f"{record_name(case.id, args.against)}.json").unlink(missing_ok=True)
    return run(args, case, out)


def record_name(case_id: str, against: str | None = None) -> str:
    """profile-CASE for ours, profile-CASE-NAME for a baseline's (the .ncu-rep, .json and .log)."""
    return f"profile-{case_id}" + (f"-{against}" if against else "")


def _gpu() -> tuple[str, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.multi_processor_count


def run(args, case, out: Path) -> int:
    start = time.monotonic()
    gpu = None if args.import_report else _gpu()
    if gpu is None and not args.import_report:
        _say(
            "profile: torch sees no GPU, and ncu profiles kernels on one; run on a GPU machine "
            f"(check `nvidia-smi`) (exit {exitcodes.ENV_BROKEN})"
        )
        return exitcodes.ENV_BROKEN
    ncu = find_cuda_tool("ncu", NCU_GLOBS)
    if ncu is None:
        _say(
            "profile: Nsight Compute (ncu) not found in $CUDA_HOME/bin, on PATH, in "
            "/usr/local/cuda/bin or /opt/nvidia/nsight-compute/*/; install Nsight Compute or put "
            f"ncu on PATH (exit {exitcodes.TOOL_MISSING})"
        )
        return exitcodes.TOOL_MISSING
    name = record_name(case.id, args.against)
    report = args.import_report or out / f"{name}.ncu-rep"
    command = None
    ceilings: dict = {}
    if not args.import_report:
        from ..bench import run as bench

        try:
            bench.build_checkout("cuda")
        except bench.Abort as exc:
            _say(f"profile: {exc}")
            return exc.exit_code
        if not args.no_ceilings:
            ceilings = (
                stored_ceilings(paths.report_dir() / "bench.json", gpu[0]) or measure_ceilings()
            )
        command = ncu_command(ncu, case.id, report.with_suffix(""), args.against)
        who = f" ({args.against}, one call)" if args.against else ""
        _say(f"profile: {case.id}{who} on {gpu[0]} with {ncu}")
        log = out / f"{name}.log"
        run = run_streaming(
            command,
            dict(os.environ),
            log,
            cwd=paths.REPO_ROOT,
            timeout_s=args.timeout,
            on_line=_show_ncu_line,
        )
        returncode, text, timed_out = run.returncode, run.text, run.timed_out
        problem = unusable_reason(text)
        if problem:
            _say(
                f"profile: ncu cannot profile this GPU here ({problem}); for ERR_NVGPUCTRPERM run "
                "as root or let users read the counters (`options nvidia "
                "NVreg_RestrictProfilingToAdminUsers=0`, https://developer.nvidia.com/ERR_NVGPUCTRPERM)"
                f" (exit {exitcodes.TOOL_MISSING})"
            )
            return exitcodes.TOOL_MISSING
        if timed_out or returncode != 0 or not report.exists():
            tail = [ln for ln in text.splitlines() if ln.strip()][-5:]
            why = f"timed out after {args.timeout:.0f} s" if timed_out else f"exited {returncode}"
            _say(f"profile: ncu {why}; log {paths_display(log)}:")
            for line in tail:
                _say(f"  {line[:300]}")
            return exitcodes.GATE_FAILED
    elif not args.no_ceilings:
        ceilings = stored_ceilings(paths.report_dir() / "bench.json", None) or {}

    imported = subprocess.run(
        ncu_import_command(ncu, report), capture_output=True, text=True, timeout=600
    )
    launches = parse_ncu_csv(imported.stdout)
    if not launches:
        tail = (imported.stderr or imported.stdout).strip().splitlines()[-3:]
        what = (
            f"no kernel ran inside the NVTX range {AGAINST_RANGE!r}"
            if args.against
            else f"the filter {kernel_filter(case.id)!r} matched nothing"
        )
        _say(
            f"profile: no kernel in {paths_display(report)} ({what}, or the import failed: "
            f"{' / '.join(tail)[:300]})"
        )
        return exitcodes.GATE_FAILED
    summary = summarize(launches, case, ceilings, gpu[1] if gpu else None, bool(args.against))
    doc = {
        "schema": SCHEMA,
        "against": args.against,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "provenance": provenance(),
        "case": case.id,
        "shape": case.to_dict(),
        "flops": case.flops,
        "bytes": case.bytes_moved,
        "gpu": gpu[0] if gpu else None,
        "ceilings": ceilings,
        "ncu": ncu,
        "command": command,
        "report": paths_display(report),
        **summary,
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")

    copy = (ceilings.get("copy") or {}).get("gbps")
    matmul = (ceilings.get("matmul") or {}).get("tflops")
    source = ceilings.get("source", "none")
    _say("")
    for fig in summary["kernels"]:
        for line in format_kernel(fig):
            _say(line)
    _say(
        f"profile: wrote {paths_display(report)} and {paths_display(json_path)} "
        f"({time.monotonic() - start:.0f} s)"
    )
    _say(
        f"profile: {case.id}: {_time(summary['call']['time_us'])} per call, "
        f"{_g(summary['call']['tflops'])} TFLOP/s; ceilings: copy {_g(copy)} GB/s, matmul "
        f"{_g(matmul)} TFLOP/s ({source})"
    )
    for fig in summary["kernels"]:
        verdict = fig["verdict"]
        _say(f"  {fig['kernel']}: {verdict['bound']}-bound ({verdict['why']})")
    if args.against:
        _say(side_by_side(out / f"{record_name(case.id)}.json", args.against, summary))
    return exitcodes.OK


def side_by_side(ours_json: Path, against: str, summary: dict) -> str:
    """One line: our call's time (from our profile of the case in this folder) against the
    baseline's, or how to get ours."""
    theirs = summary["call"]["time_us"]
    try:
        ours = json.loads(ours_json.read_text())["call"]["time_us"]
    except (OSError, ValueError, KeyError, TypeError):
        ours = None
    if not ours or not theirs:
        return (
            f"profile: no profile of ours beside it ({paths_display(ours_json)}); run `profile "
            f"CASE` with the same --output to put the two calls side by side"
        )
    return (
        f"profile: ours {_time(ours)} per call (our kernels, {paths_display(ours_json)}), "
        f"{against} {_time(theirs)} (every kernel of its call): {against} / ours "
        f"{theirs / ours:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
