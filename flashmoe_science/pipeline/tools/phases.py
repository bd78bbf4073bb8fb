"""`python -m flashmoe_science phases CASE` (`nox -s phases -- CASE`): where the sm_90a forward
kernel's time goes, phase by phase of each tile; for a decode case (dec-...), where the split-KV
decode's goes, block by block (decode_phases.py).

    python -m flashmoe_science phases fwd-bf16-d128-h16-b32-s512-full
    python -m flashmoe_science phases fwd-bf16-d64-h32-b32-s512-causal --output /tmp/phases
    python -m flashmoe_science phases dec-bf16-d128-h32kv8-b4-q1-k8192 --block-size 64

The wgmma forward (configurations 5 to 7) is persistent: each block walks tiles of 128 or 192
query rows, and a tile's time is its key blocks plus a fixed cost (waiting for Q, the first S and
its softmax with nothing to overlap, the last P V alone, the output, the step to the next tile).
Nsight Compute sees the kernel whole; this command sees the phases. It builds the extension with
FLASHMOE_PHASE_TRACE=1 (its own build folder; the kernels without the define are unchanged), then
runs `python -m flashmoe_science.pipeline.tools.phases --workload CASE --json FILE` on that build: the
case's inputs made as bench makes them, a few warm-up calls, the call timed (CUDA events, median
of TIMED_CALLS, no L2 flush: a comparison in the same run, not a benchmark), SDPA's default timed
the same way when it can express the case, then one traced call. In that call the first thread of
each math warpgroup stamps clock64 at each of MARKS and the producer's thread 0 around its Q copy
(csrc/flash_fwd_sm90_kernel.cuh, namespace phase_trace; the slot numbers below are its). %globaltimer
and clock64 at each block's start and end turn cycles into microseconds.

Printed: per phase the median and mean over every (tile, warpgroup) in microseconds, the time per
tile against SDPA's time over the same number of tiles (against the traced kernel, which its stamps
slow: `bench` gives the ratio of record), and what the producer waited for. Written:
<reports>/phases-CASE.json. Steps of a block's walk past ROUNDS are not recorded (the summary says
how many blocks reached it).

Exit codes: 0 ok; 1 the workload failed or no traced block ran (a prefill case the GPU does not run
with configurations 5 to 7); 2 bad CASE or --block-size; 125 the traced build fails; 255 no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .. import exitcodes, paths
from ..cli import program
from ..provenance import provenance
from .cudatools import median_or_none, paths_display, trace_cell

SCHEMA = "flashmoe-phases/1"
DEFINE = "FLASHMOE_PHASE_TRACE=1"
# csrc/flash_fwd_sm90_kernel.cuh, namespace phase_trace (a test holds the two together)
BLOCKS, ROUNDS, SLOTS, PER_WARPGROUP, MAX_WARPGROUPS = 256, 64, 40, 9, 3
KEY_BLOCKS = PER_WARPGROUP * MAX_WARPGROUPS  # slot of warpgroup w's key-block count: KEY_BLOCKS + w
PRODUCER = KEY_BLOCKS + MAX_WARPGROUPS  # + 0 before the Q-free wait, + 1 after it, + 2 Q issued
MARKS = (
    "tile_start",
    "q_ready",
    "first_k_ready",
    "first_s",
    "first_softmax",
    "loop_done",
    "last_pv_issued",
    "last_pv",
    "output",
)
# (name, from mark, to mark, what it is); "per_key_block" divides by the tile's key blocks - 1
PHASES = (
    ("q_wait", "tile_start", "q_ready", "waiting for the tile's Q"),
    ("first_k_wait", "q_ready", "first_k_ready", "waiting for the first K block"),
    ("first_s", "first_k_ready", "first_s", "the first S = Q K^T, alone"),
    ("first_softmax", "first_s", "first_softmax", "its softmax, nothing to overlap"),
    ("per_key_block", "first_softmax", "loop_done", "S(n) with P V(n + 1), per key block"),
    (
        "last_pv_issue",
        "loop_done",
        "last_pv_issued",
        "the last V, this warpgroup's turn, the issue",
    ),
    (
        "last_pv",
        "last_pv_issued",
        "last_pv",
        "the last P V after its issue (rows finished under it)",
    ),
    ("output", "last_pv", "output", "the output and LSE written"),
)
WARMUP_CALLS, TIMED_CALLS = 3, 20
WORKLOAD_TIMEOUT_S = 600


def _say(text: str) -> None:
    print(text, flush=True)


# --------------------------------------------------------------------------------------------------
# The summary (pure: tests give it synthetic traces)
# --------------------------------------------------------------------------------------------------


def summarize(stamps: Sequence[int], spans: Sequence[int]) -> dict:
    """Per-phase medians and means (us) from the kernel's flat buffers: stamps
    [BLOCKS][ROUNDS][SLOTS] and spans [BLOCKS][4] (globaltimer ns and clock64 at start, then end).
    A (tile, warpgroup) counts when its start and output stamps are both there."""
    if len(stamps) != BLOCKS * ROUNDS * SLOTS or len(spans) != BLOCKS * 4:
        raise ValueError(
            f"a phase trace holds {BLOCKS * ROUNDS * SLOTS} stamps and {BLOCKS * 4} span values, "
            f"got {len(stamps)} and {len(spans)}: the build and phases.py disagree"
        )
    rates = []
    for b in range(BLOCKS):
        t0, c0, t1, c1 = spans[4 * b : 4 * b + 4]
        if t1 > t0 > 0 and c1 > c0:
            rates.append((c1 - c0) / (t1 - t0))  # cycles per ns = GHz
    ghz = median_or_none(rates)
    samples: dict[str, list[float]] = {name: [] for name, *_ in PHASES}
    samples |= {"to_next_tile": [], "tile": [], "producer_q_free_wait": [], "producer_q_issue": []}
    key_blocks, warpgroups, blocks_at_limit = [], set(), 0
    tiles = 0

    def at(b: int, r: int, slot: int) -> int:
        return stamps[(b * ROUNDS + r) * SLOTS + slot]

    for b in range(BLOCKS):
        if at(b, ROUNDS - 1, 0):
            blocks_at_limit += 1
        for r in range(ROUNDS):
            if any(at(b, r, w * PER_WARPGROUP) for w in range(MAX_WARPGROUPS)):
                tiles += 1
            for w in range(MAX_WARPGROUPS):
                mark = {m: at(b, r, w * PER_WARPGROUP + i) for i, m in enumerate(MARKS)}
                n_blocks = at(b, r, KEY_BLOCKS + w)
                if not mark["tile_start"] or not mark["output"] or n_blocks <= 0:
                    continue
                warpgroups.add(w)
                key_blocks.append(n_blocks)
                for name, start, end, _ in PHASES:
                    if name == "per_key_block":
                        if n_blocks > 1:
                            samples[name].append((mark[end] - mark[start]) / (n_blocks - 1))
                    else:
                        samples[name].append(mark[end] - mark[start])
                if r + 1 < ROUNDS and at(b, r + 1, w * PER_WARPGROUP):
                    samples["to_next_tile"].append(at(b, r + 1, w * PER_WARPGROUP) - mark["output"])
                    samples["tile"].append(at(b, r + 1, w * PER_WARPGROUP) - mark["tile_start"])
            before, after, issued = (at(b, r, PRODUCER + i) for i in range(3))
            if before and after and issued:
                samples["producer_q_free_wait"].append(after - before)
                samples["producer_q_issue"].append(issued - after)

    def us(cycles: float | None) -> float | None:
        return None if cycles is None or not ghz else cycles / ghz / 1000

    phases = {
        name: {
            "median_us": us(median_or_none(values)),
            "mean_us": us(sum(values) / len(values)) if values else None,
            "n": len(values),
        }
        for name, values in samples.items()
    }
    return {
        "clock_ghz": ghz,
        "tiles": tiles,
        "warpgroups": len(warpgroups),
        "key_blocks_median": median_or_none(key_blocks),
        "blocks_at_round_limit": blocks_at_limit,
        "phases": phases,
    }


def fixed_cost_us(summary: dict) -> float | None:
    """A tile's time less its key blocks at the loop's rate: what each tile pays once."""
    tile = summary["phases"]["tile"]["median_us"]
    per_block = summary["phases"]["per_key_block"]["median_us"]
    blocks = summary["key_blocks_median"]
    if tile is None or per_block is None or blocks is None:
        return None
    return tile - per_block * blocks


def format_table(summary: dict) -> list[str]:
    described = {name: what for name, _, _, what in PHASES}
    described |= {
        "to_next_tile": "from the output to the next tile's start",
        "tile": "one tile, start to start",
        "producer_q_free_wait": "producer: waiting for Q's buffer to be free",
        "producer_q_issue": "producer: issuing Q's copy",
    }
    lines = [f"  {'phase':<22} {'median us':>10} {'mean us':>9} {'n':>6}  what"]
    for name, fig in summary["phases"].items():
        med, mean = fig["median_us"], fig["mean_us"]
        cells = f"{trace_cell(med):>10} {trace_cell(mean):>9} {fig['n']:>6}"
        lines.append(f"  {name:<22} {cells}  {described[name]}")
    return lines


# --------------------------------------------------------------------------------------------------
# The workload (runs on the traced build, in its own process)
# --------------------------------------------------------------------------------------------------


def _time_ms(fn) -> float:
    import torch

    times = []
    for _ in range(TIMED_CALLS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _flush_l2() -> None:
    """The bench's L2 flush before a call (timing.CudaTimer's)."""
    import torch

    from ..bench.timing import L2_FLUSH_BYTES

    torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").zero_()


def _kernels_of(fn) -> list[str]:
    import torch

    from .cudatools import short_kernel

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "flashmoe" in e.name or "flash_" in e.name]
    return sorted({short_kernel(n) for n in names})


def run_workload(case_id: str, json_path: Path, block_size: int | None = None) -> int:
    """One traced call of the case (a decode one after an L2 flush, as bench times it), the trace's
    buffers and the untraced timings, into json_path."""
    import torch

    from ..bench.baselines import ops, our_call, sdpa_call
    from ..cases import make_inputs, parse_case_id
    from . import decode_phases

    case = parse_case_id(case_id)
    ops().load_library()
    library = torch.ops.flashmoe_science
    decode = case.kind == "decode"
    name = "decode_trace" if decode else "phase_trace"
    if not hasattr(library, f"{name}_dump"):
        _say(f"phases: the loaded build has no {name} (built without -D{DEFINE})")
        return exitcodes.GATE_FAILED
    x = make_inputs(case, "cuda")
    fn = decode_phases.decode_call(case, x, block_size) if decode else our_call(case, x)
    for _ in range(WARMUP_CALLS):
        fn()
    torch.cuda.synchronize()
    ours_ms = _time_ms(fn)
    sdpa, why_not = sdpa_call(case, x)
    sdpa_ms = _time_ms(sdpa) if sdpa is not None else None
    kernels = _kernels_of(fn)
    getattr(library, f"{name}_reset")()
    if decode:
        _flush_l2()
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    trace = getattr(library, f"{name}_dump")().tolist()
    doc = {"ours_ms": ours_ms, "sdpa_default_ms": sdpa_ms, "sdpa_missing": why_not}
    if decode:
        doc |= {"kernels": kernels, "stamps": trace}
    else:
        stamps, spans = trace[: BLOCKS * ROUNDS * SLOTS], trace[BLOCKS * ROUNDS * SLOTS :]
        doc |= {"kernels": kernels, "stamps": stamps, "spans": spans}
    json_path.write_text(json.dumps(doc))
    return exitcodes.OK


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{program()} phases",
        description="Trace the sm_90a forward kernel's phases tile by tile, or the decode's block "
        "by block, on one bench case.",
    )
    p.add_argument(
        "case", metavar="CASE", help="a bench case id, e.g. fwd-bf16-d128-h16-b32-s512-full"
    )
    p.add_argument("--output", type=Path, help="folder for phases-CASE.json (default: reports/)")
    p.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="decode cases: read the same cache through a shuffled block table of N-key pages "
        "(the paged decode; a power of two from 16)",
    )
    p.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ..cases import parse_case_arg

    case = parse_case_arg("phases", args.case)
    if case is None:
        return exitcodes.USAGE
    block_size = args.block_size
    if block_size is not None and (
        case.kind != "decode" or block_size < 16 or block_size & (block_size - 1)
    ):
        _say(
            f"phases: --block-size {block_size} with {case.id}: a paged cache is read by decode "
            "cases (dec-...), in pages of a power of two from 16 keys, e.g. --block-size 64"
        )
        return exitcodes.USAGE
    if args.workload:
        return run_workload(args.case, args.json, block_size)
    import torch

    if not torch.cuda.is_available():
        _say(
            "phases: torch sees no GPU, and the trace is of a GPU kernel; run on a machine with an "
            f"H100 (check `nvidia-smi`) (exit {exitcodes.ENV_BROKEN})"
        )
        return exitcodes.ENV_BROKEN
    out = args.output or paths.report_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = case.id if block_size is None else f"{case.id}-page{block_size}"
    json_path = out / f"phases-{name}.json"
    json_path.unlink(missing_ok=True)  # never an older run's record
    if case.kind == "decode":
        return run_decode(case, json_path, block_size)
    return run(case, json_path)


def traced_run(case, extra: Sequence[str] = ()) -> dict | int:
    """Build with the trace, run the case's workload in a process of its own: its record, or an
    exit code (said why)."""
    from ..build import unit as build

    _say(f"phases: building with -D{DEFINE} (a build folder of its own)")
    library = build.ensure_built_for("phases", (DEFINE,))
    if isinstance(library, int):
        return library
    _say(f"phases: {case.id}: tracing one call (build {paths_display(library.parent)})")
    env = dict(os.environ, FLASHMOE_BUILD_DEFINES=DEFINE, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "trace.json"
        command = [sys.executable, "-m", "flashmoe_science.pipeline.tools.phases", case.id, *extra]
        command += ["--workload", "--json", str(raw_path)]
        try:
            done = _workload(command, env)
        except subprocess.TimeoutExpired:
            _say(f"phases: the traced call did not finish in {WORKLOAD_TIMEOUT_S} s")
            return exitcodes.GATE_FAILED
        if done.returncode != 0 or not raw_path.exists():
            tail = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()][-5:]
            _say(f"phases: the traced workload exited {done.returncode}:")
            for line in tail:
                _say(f"  {line[:300]}")
            return exitcodes.GATE_FAILED
        return json.loads(raw_path.read_text())


def run(case, json_path: Path) -> int:
    start = time.monotonic()
    raw = traced_run(case)
    if isinstance(raw, int):
        return raw
    summary = summarize(raw["stamps"], raw["spans"])
    if summary["tiles"] == 0:
        _say(
            f"phases: no wgmma forward tile ran in {case.id} (kernels: "
            f"{', '.join(raw['kernels']) or 'none'}): the trace covers configurations 5 to 7, "
            "which run on a compute capability 9.0 GPU with an sm_90a build; for other kernels "
            f"use `python -m flashmoe_science profile {case.id}`"
        )
        return exitcodes.GATE_FAILED
    ours_ms, sdpa_ms = raw["ours_ms"], raw["sdpa_default_ms"]
    tiles = summary["tiles"]
    doc = {
        "schema": SCHEMA,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "provenance": provenance(),
        "case": case.id,
        "gpu": _gpu_name(),
        "kernels": raw["kernels"],
        "ours_ms": ours_ms,
        "sdpa_default_ms": sdpa_ms,
        "sdpa_missing": raw["sdpa_missing"],
        "fixed_cost_us": fixed_cost_us(summary),
        **summary,
    }
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    _say(f"phases: {case.id} on {doc['gpu']}: {', '.join(raw['kernels'])}")
    _say(
        f"  {tiles} tiles, {summary['warpgroups']} math warpgroups, median key blocks a tile "
        f"{summary['key_blocks_median']}, clock {trace_cell(summary['clock_ghz'])} GHz"
    )
    if summary["blocks_at_round_limit"]:
        _say(
            f"  {summary['blocks_at_round_limit']} blocks walked past {ROUNDS} tiles: not all traced"
        )
    per_tile = ours_ms * 1000 * _blocks(summary) / tiles
    sdpa = (
        f"SDPA default {sdpa_ms * 1000 * _blocks(summary) / tiles:.2f} us over as many tiles "
        f"({sdpa_ms / ours_ms:.3f}x the traced kernel; its stamps slow it, so `bench` gives the "
        "ratio of record)"
        if sdpa_ms
        else f"SDPA default not timed ({raw['sdpa_missing']})"
    )
    _say(f"  a traced call {ours_ms * 1000:.1f} us: {per_tile:.2f} us a tile a block; {sdpa}")
    for line in format_table(summary):
        _say(line)
    _say(
        f"phases: a tile's fixed cost (its time less its key blocks at the loop's rate) "
        f"{trace_cell(doc['fixed_cost_us'])} us; wrote {paths_display(json_path)} "
        f"({time.monotonic() - start:.0f} s)"
    )
    return exitcodes.OK


def run_decode(case, json_path: Path, block_size: int | None) -> int:
    from . import decode_phases

    start = time.monotonic()
    extra = () if block_size is None else ("--block-size", str(block_size))
    raw = traced_run(case, extra)
    if isinstance(raw, int):
        return raw
    summary = decode_phases.summarize(raw["stamps"])
    if not summary["phases"]:
        _say(
            f"phases: no decode block of {case.id} was traced (kernels: "
            f"{', '.join(raw['kernels']) or 'none'}); the trace covers the split-KV decode kernel "
            f"(configuration 3); for other kernels use `python -m flashmoe_science profile {case.id}`"
        )
        return exitcodes.GATE_FAILED
    ours_ms, sdpa_ms = raw["ours_ms"], raw["sdpa_default_ms"]
    doc = {
        "schema": SCHEMA,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "provenance": provenance(),
        "case": case.id,
        "block_size": block_size,
        "gpu": _gpu_name(),
        "kernels": raw["kernels"],
        "ours_ms": ours_ms,
        "sdpa_default_ms": sdpa_ms,
        "sdpa_missing": raw["sdpa_missing"],
        "tail_us": decode_phases.tail_us(summary),
        **summary,
    }
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    paged = "" if block_size is None else f", paged in {block_size}-key blocks"
    _say(f"phases: {case.id}{paged} on {doc['gpu']}: {', '.join(raw['kernels'])}")
    _say(
        f"  {summary['blocks']} blocks on {summary['sms']} SMs, {summary['combining_blocks']} of "
        f"them combined splits, median stages a block {summary['stages_median']}, clock "
        f"{trace_cell(summary['clock_ghz'])} GHz"
    )
    sdpa = (
        f"SDPA default {sdpa_ms * 1000:.1f} us ({sdpa_ms / ours_ms:.3f}x; no L2 flush here: "
        "`bench` gives the ratio of record)"
        if sdpa_ms
        else f"SDPA default not timed ({raw['sdpa_missing']})"
    )
    _say(f"  a call {ours_ms * 1000:.1f} us (the traced build, warm L2); {sdpa}")
    for line in decode_phases.format_table(summary):
        _say(line)
    _say(
        f"phases: the latest block's tail (its loop's end to its end) {trace_cell(doc['tail_us'])} us; "
        f"wrote {paths_display(json_path)} ({time.monotonic() - start:.0f} s)"
    )
    return exitcodes.OK


def _workload(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The traced call's process (its output kept for a failure's last lines)."""
    return subprocess.run(
        command, env=env, cwd=paths.REPO_ROOT, timeout=WORKLOAD_TIMEOUT_S, text=True,
        capture_output=True,
    )  # fmt: skip


def _blocks(summary: dict) -> int:
    """The blocks the kernel ran with (one per SM, at most the tiles): the GPU's SM count."""
    import torch

    return min(torch.cuda.get_device_properties(0).multi_processor_count, summary["tiles"])


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
