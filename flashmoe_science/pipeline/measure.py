"""One case of the benchmark matrix, measured: our kernel, the read floor (decode on CUDA) and the
SDPA baselines, each timed as timing.benchmark does and turned into a record; a refusal or a failure
becomes a record too, never a raise.

Ours and the baselines are timed in ROUNDS interleaved rounds, forward then backward (ours, flash,
..., default, default, ..., flash, ours, ours, ...), each with a ROUNDS-th of the budget, and each
median is over all of its samples: drift of clocks or temperature during a case then hits every
column alike (a steady drift cancels over each pair of rounds), as --base does for head against
base. (Timed one after another, the same cuDNN kernel differed by up to 11% between the
cuDNN and default columns of one H100 run; benches/NOTES.md v3.1.)

Read floor ("read_floor"): the fastest of a few Triton kernels that only read the case's K and V
(flashmoe_science.pipeline.readfloor). No decode kernel is expected to beat it by much, so SDPA's
time over it bounds what any kernel can gain on SDPA there.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import readfloor
from .baselines import BASELINES, backend_context, first_call, is_refusal, our_call, sdpa_call
from .benchrecords import CaseRecord, Measured, NotMeasured, ReadFloor, Result
from .cases import Case, Inputs, make_inputs
from .stats import sig, summarize
from .timing import Timing, TimingConfig, benchmark, first_line, peak_memory_bytes

ROUNDS = 4


def figures(case: Case, timing: Timing, ceilings: dict, peak: int | None) -> Measured:
    seconds = timing.median_ms * 1e-3
    tflops = case.flops / seconds / 1e12 if seconds > 0 else None
    gbps = case.bytes_moved / seconds / 1e9 if seconds > 0 else None
    peak_tflops = ceilings.get("matmul", {}).get("tflops")
    peak_gbps = ceilings.get("copy", {}).get("gbps")
    s = timing.summary
    return Measured(
        median_ms=sig(s.median),
        q1_ms=sig(s.q1),
        q3_ms=sig(s.q3),
        iqr_ms=sig(s.iqr),
        n=s.n,
        tflops=sig(tflops, 4),
        gbps=sig(gbps, 4),
        pct_matmul_ceiling=sig(100 * tflops / peak_tflops, 3) if tflops and peak_tflops else None,
        pct_copy_ceiling=sig(100 * gbps / peak_gbps, 3) if gbps and peak_gbps else None,
        peak_mem_bytes=peak,
        samples_ms=[sig(t) for t in timing.samples_ms],
    )


def measure(
    fn, backend, case: Case, device: str, timer, config: TimingConfig, ceilings: dict
) -> Result:
    """Time one implementation on one case; a refusal or a failure becomes a record, not a raise."""
    calls = {"it": (fn, backend)}
    return measure_interleaved(calls, case, device, timer, config, ceilings, rounds=1)["it"]


def read_floor(
    case: Case, x: Inputs, device: str, timer, config: TimingConfig, calls=None
) -> ReadFloor | NotMeasured:
    """The fastest of readfloor's pure reads of this case's K and V, each measured as the cases
    are (`measure`): what any decode kernel that reads those bytes could reach on this card."""
    try:
        calls = calls if calls is not None else readfloor.read_calls(x.k, x.v)
    except ImportError as exc:
        return NotMeasured("unsupported", f"the read floor needs Triton: {exc}")
    best = None
    for name, fn in calls.items():
        result = measure(fn, None, case, device, timer, config, {})
        if isinstance(result, NotMeasured):
            return NotMeasured(result.status, f"{name}: {result.reason}")
        if best is None or result.median_ms < best[1]:
            best = (name, result.median_ms)
    name, median_ms = best
    return ReadFloor(median_ms=median_ms, gbps=sig(case.kv_bytes / median_ms / 1e6, 4), config=name)


def round_config(config: TimingConfig, rounds: int) -> TimingConfig:
    """One round's share of a measurement's budget: warm-up, timed calls and repeat bounds."""
    return dataclasses.replace(
        config,
        warmup_ms=config.warmup_ms / rounds,
        rep_ms=config.rep_ms / rounds,
        min_reps=math.ceil(config.min_reps / rounds),
        max_reps=math.ceil(config.max_reps / rounds),
    )


def measure_interleaved(
    calls: dict, case: Case, device: str, timer, config: TimingConfig, ceilings: dict, rounds: int
) -> dict[str, Result]:
    """Time each of calls {name: (fn, backend)} in `rounds` interleaved rounds, every other one in
    reverse order; the results in the order of calls. A refusal or a failure (in any round)
    becomes that name's record."""
    results: dict[str, Result] = {}
    live: dict[str, tuple] = {}  # name -> (fn, backend, peak, samples)
    for name, (fn, backend) in calls.items():
        with backend_context(backend):
            problem = first_call(fn)
            if problem is not None:
                status = "unsupported" if is_refusal(problem) else "error"
                results[name] = NotMeasured(status, problem)
                continue
            try:
                live[name] = (fn, backend, peak_memory_bytes(fn, device), [])
            except RuntimeError as exc:
                results[name] = NotMeasured("error", first_line(exc))
    per_round = round_config(config, rounds)
    for index in range(rounds):
        order = list(live.items())
        for name, (fn, backend, _, samples) in order[::-1] if index % 2 else order:
            with backend_context(backend):
                try:
                    samples += benchmark(fn, timer, per_round).samples_ms
                except RuntimeError as exc:  # out of memory, or a failure only repetition shows
                    results[name] = NotMeasured("error", first_line(exc))
                    del live[name]
    for name, (_, _, peak, samples) in live.items():
        results[name] = figures(case, Timing(samples, summarize(samples)), ceilings, peak)
    return {name: results[name] for name in calls}


def run_case(
    case: Case,
    device: str,
    timer,
    config: TimingConfig,
    ceilings: dict,
    baselines: bool,
    rounds: int = ROUNDS,
) -> CaseRecord:
    x = make_inputs(case, device)
    calls = {"ours": (our_call(case, x), None)}
    unsupported = {}
    for name, backend in BASELINES.items() if baselines else ():
        fn, reason = sdpa_call(case, x)
        if fn:
            calls[name] = (fn, backend)
        else:
            unsupported[name] = NotMeasured("unsupported", reason)
    measured = measure_interleaved(calls, case, device, timer, config, ceilings, rounds)
    record = CaseRecord(
        id=case.id,
        **case.to_dict(),
        flops=case.flops,
        bytes=case.bytes_moved,
        ours=measured.pop("ours"),
        baselines={},
    )
    ours = record.ours if isinstance(record.ours, Measured) else None
    if case.kind == "decode" and device == "cuda":
        floor = read_floor(case, x, device, timer, config)
        if isinstance(floor, ReadFloor) and ours:
            floor.ratio = sig(floor.median_ms / ours.median_ms, 4)
        record.read_floor = floor
    for name in BASELINES if baselines else ():
        result = measured.get(name) or unsupported[name]
        if isinstance(result, Measured):
            # raw samples are kept for our kernel only (history, comparison)
            result.samples_ms = None
            if ours:
                result.ratio = sig(result.median_ms / ours.median_ms, 4)
        record.baselines[name] = result
    del x
    if device == "cuda":
        torch.cuda.empty_cache()  # the next case may need what this one's SDPA workspaces held
    return record
