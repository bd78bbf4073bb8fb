"""One case of the benchmark matrix, measured: our kernel, the read floor (decode on CUDA), the
SDPA baselines, FlashAttention-3 and -4 where installed (peers: prefill and backward kinds), and
for an automatic backward case our kernel with deterministic=True, each timed as timing.benchmark
does and turned into a record; a refusal or a failure becomes a record too, never a raise.

Ours and the baselines are timed in ROUNDS interleaved rounds, forward then backward (ours, flash,
..., default, default, ..., flash, ours, ours, ...), each with a ROUNDS-th of the budget, and each
median is over all of its samples: drift of clocks or temperature during a case then hits every
column alike (a steady drift cancels over each pair of rounds), as --base does for head against
base. (Timed one after another, the same cuDNN kernel differed between the cuDNN and default
columns of one run by more than the threshold: benches/notes/harness.md, v3.2.)

A case whose timing of ours or of any baseline shows a disturbance (an IQR over
stats.UNSTABLE_SPREAD of its median) is measured again whole, up to TimingConfig.retakes times, and keeps its
least disturbed attempt; the record says how often, and which columns stayed unstable (their
ratios are then not judged: pipeline.bench.targets).

Read floor ("read_floor"): the fastest of a few Triton kernels that only read the case's K and V
(flashmoe_science.pipeline.bench.readfloor), timed in the same interleaved rounds as ours and the
baselines. No decode kernel is expected to beat it by much, so SDPA's time over it bounds what any
kernel can gain on SDPA there.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..cases import Case, Inputs, make_inputs
from . import flex, peers, readfloor, stats
from .baselines import (
    BASELINES,
    backend_context,
    first_call,
    has_features,
    is_refusal,
    our_call,
    sdpa_call,
)
from .records import (
    CUDA_ONLY_BASELINES,
    NOT_ON_CPU,
    CaseRecord,
    Measured,
    NotMeasured,
    ReadFloor,
    Result,
)
from .stats import sig, summarize
from .timing import Timing, TimingConfig, benchmark, first_line, peak_memory_bytes

ROUNDS = 4
# Our kernel with deterministic=True, among a backward case's calls (CaseRecord.ours_deterministic)
DETERMINISTIC = "ours, deterministic"


def figures(case: Case, timing: Timing, ceilings: dict, peak: int | None) -> Measured:
    seconds = timing.median_ms * 1e-3
    tflops = case.flops / seconds / 1e12 if seconds > 0 else None
    gbps = case.bytes_moved / seconds / 1e9 if seconds > 0 and case.bytes_moved else None
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
    fn, backend, case: Case, device: str, timer, config: TimingConfig, ceilings: dict, say=None
) -> Result:
    """Time one implementation on one case; a refusal or a failure becomes a record, not a raise."""
    calls = {"it": (fn, backend)}
    return measure_interleaved(calls, case, device, timer, config, ceilings, 1, say=say)["it"]


# The read floor's columns among a decode case's calls: FLOOR + readfloor's configuration name.
FLOOR = "read floor: "


def floor_calls(x: Inputs, calls=None) -> dict | NotMeasured:
    """readfloor's pure reads of x's K and V (or `calls`, {name: fn}) as measure_interleaved calls
    named FLOOR + name, or why there are none (no Triton)."""
    try:
        calls = calls if calls is not None else readfloor.read_calls(x.k, x.v)
    except ImportError as exc:
        return NotMeasured("unsupported", f"the read floor needs Triton: {exc}")
    return {FLOOR + name: (fn, None) for name, fn in calls.items()}


def take_floor(case: Case, results: dict[str, Result]) -> ReadFloor | NotMeasured:
    """Removes the FLOOR columns from `results` and returns the fastest as the case's read floor
    (or the first failure, named)."""
    floors = {n[len(FLOOR) :]: results.pop(n) for n in list(results) if n.startswith(FLOOR)}
    best = None
    for name, result in floors.items():
        if isinstance(result, NotMeasured):
            return NotMeasured(result.status, f"{name}: {result.reason}")
        if best is None or result.median_ms < best[1].median_ms:
            best = (name, result)
    name, fastest = best
    return ReadFloor(
        median_ms=fastest.median_ms,
        gbps=sig(case.kv_bytes / fastest.median_ms / 1e6, 4),
        config=name,
        iqr_ms=fastest.iqr_ms,
        retakes=fastest.retakes,
    )


def read_floor(
    case: Case,
    x: Inputs,
    device: str,
    timer,
    config: TimingConfig,
    calls=None,
    say=None,
    alongside: dict | None = None,
    ceilings: dict | None = None,
    rounds: int = ROUNDS,
) -> tuple[ReadFloor | NotMeasured, dict[str, Result]]:
    """The fastest of readfloor's pure reads of this case's K and V: what any decode kernel that
    reads those bytes could reach on this card. They are timed in the same `rounds` interleaved
    rounds as `alongside` ({name: (fn, backend)}: the kernels set against the floor), so drift
    during the case hits both sides alike; returns the floor and alongside's results. (Timed after
    them instead, the floor swung from run to run by as much as a target's margin:
    benches/notes/harness.md, v4.0.)"""
    calls_now = dict(alongside or {})
    floors = floor_calls(x, calls)
    if not isinstance(floors, NotMeasured):
        calls_now.update(floors)
    results = (
        measure_interleaved(calls_now, case, device, timer, config, ceilings or {}, rounds, say=say)
        if calls_now
        else {}
    )
    return (floors if isinstance(floors, NotMeasured) else take_floor(case, results)), results


def round_config(config: TimingConfig, rounds: int) -> TimingConfig:
    """One round's share of a measurement's budget: warm-up, timed calls and repeat bounds."""
    return dataclasses.replace(
        config,
        warmup_ms=config.warmup_ms / rounds,
        rep_ms=config.rep_ms / rounds,
        min_reps=math.ceil(config.min_reps / rounds),
        max_reps=math.ceil(config.max_reps / rounds),
    )


def unstable_names(results: dict[str, Result]) -> list[str]:
    """The measured results whose spread shows a disturbance (stats.unstable)."""
    return [name for name, r in results.items() if isinstance(r, Measured) and r.is_unstable()]


def _disturbance(results: dict[str, Result]) -> tuple[int, float]:
    """How disturbed one attempt was: its failures, then its widest spread (lower is better)."""
    failures = sum(isinstance(r, NotMeasured) for r in results.values())
    spreads = [
        stats.spread(r.median_ms, r.iqr_ms) for r in results.values() if isinstance(r, Measured)
    ]
    return failures, max(spreads, default=0.0)


def _spread_text(results: dict[str, Result], names: list[str]) -> str:
    return ", ".join(f"{name} IQR {100 * results[name].spread():.0f}%" for name in names)


def first_call_record(fn) -> NotMeasured | None:
    """None if fn runs once, else the record of why not: "unsupported" for a refusal, "error"."""
    problem = first_call(fn)
    if problem is None:
        return None
    return NotMeasured("unsupported" if is_refusal(problem) else "error", problem)


def in_turn(items: list, index: int) -> list:
    """Round `index`'s order of interleaved rounds: forward on even rounds, backward on odd ones,
    so a steady drift cancels over each pair of rounds."""
    return items[::-1] if index % 2 else items


def _timed_rounds(
    live: dict, case: Case, timer, config: TimingConfig, ceilings: dict, rounds: int
) -> dict[str, Result]:
    """One attempt: each of live {name: (fn, backend, peak)} timed in `rounds` interleaved rounds,
    every other one in reverse order; a failure in any round becomes that name's record."""
    samples: dict[str, list[float]] = {name: [] for name in live}
    failed: dict[str, Result] = {}
    per_round = round_config(config, rounds)
    for index in range(rounds):
        order = [item for item in live.items() if item[0] not in failed]
        for name, (fn, backend, _) in in_turn(order, index):
            with backend_context(backend):
                try:
                    samples[name] += benchmark(fn, timer, per_round).samples_ms
                except RuntimeError as exc:  # out of memory, or a failure only repetition shows
                    failed[name] = NotMeasured("error", first_line(exc))
    return {
        name: failed.get(name)
        or figures(case, Timing(samples[name], summarize(samples[name])), ceilings, peak)
        for name, (_, _, peak) in live.items()
    }


def measure_interleaved(
    calls: dict,
    case: Case,
    device: str,
    timer,
    config: TimingConfig,
    ceilings: dict,
    rounds: int,
    say=None,
) -> dict[str, Result]:
    """Time each of calls {name: (fn, backend)} in `rounds` interleaved rounds (`_timed_rounds`);
    the results in the order of calls. A refusal or a failure becomes that name's record.

    While any result's spread shows a disturbance (stats.unstable), all of them are timed again,
    up to config.retakes times, and the least disturbed attempt is kept whole: every ratio stays between
    columns of one attempt, and a disturbance that comes back on a retake does not replace a clean
    attempt. Each measured result records the retakes taken."""
    results: dict[str, Result] = {}
    live: dict[str, tuple] = {}  # name -> (fn, backend, peak)
    for name, (fn, backend) in calls.items():
        with backend_context(backend):
            refused = first_call_record(fn)
            if refused is not None:
                results[name] = refused
                continue
            try:
                live[name] = (fn, backend, peak_memory_bytes(fn, device))
            except RuntimeError as exc:
                results[name] = NotMeasured("error", first_line(exc))
    kept = _timed_rounds(live, case, timer, config, ceilings, rounds)
    taken, retakes = 0, config.retakes
    while taken < retakes and unstable_names(kept):
        taken += 1
        if say:
            names = unstable_names(kept)
            say(
                f"  retaking {case.id} ({taken} of {retakes}): {_spread_text(kept, names)} of the "
                f"median, over {100 * stats.UNSTABLE_SPREAD:.0f}%"
            )
        attempt = _timed_rounds(live, case, timer, config, ceilings, rounds)
        if _disturbance(attempt) < _disturbance(kept):
            kept = attempt
    for result in kept.values():
        if isinstance(result, Measured) and taken:
            result.retakes = taken
    results.update(kept)
    return {name: results[name] for name in calls}


def times_deterministic(case: Case) -> bool:
    """Whether a case also times our kernel with deterministic=True beside ours: an automatic
    backward case that is not deterministic itself (the features' cases are timed for their
    twins' ratios alone)."""
    return (
        case.kind == "backward"
        and not case.deterministic
        and not case.config
        and case.group != "features"
    )


def _beside_ours(result: Result, ours: Measured | None) -> Result:
    """A column other than ours: without raw samples (kept for our kernel only, for the history
    and the comparison), with its time over ours as its ratio."""
    if isinstance(result, Measured):
        result.samples_ms = None
        if ours:
            result.ratio = sig(result.median_ms / ours.median_ms, 4)
    return result


def run_case(
    case: Case,
    device: str,
    timer,
    config: TimingConfig,
    ceilings: dict,
    baselines: bool,
    rounds: int = ROUNDS,
    say=None,
    flex_column: bool = True,
) -> CaseRecord:
    """One case measured into its record. A case with a window, softcap or sinks times
    FlexAttention beside ours (the flex column); on the CPU, never (flex.NOT_ON_CPU), nor where
    `flex_column` is off (the pull request's subset: flex.NOT_ON_PR)."""
    x = make_inputs(case, device)
    calls = {"ours": (our_call(case, x), None)}
    if times_deterministic(case):
        deterministic = dataclasses.replace(case, deterministic=True)
        calls[DETERMINISTIC] = (our_call(deterministic, x), None)
    unsupported = {}
    for name, backend in BASELINES.items() if baselines else ():
        fn, reason = sdpa_call(case, x)
        if fn:
            calls[name] = (fn, backend)
        else:
            unsupported[name] = NotMeasured("unsupported", reason)
    compared = list(BASELINES) if baselines else []
    if baselines and case.kind in peers.KINDS:
        for name, (fn, reason) in peers.availability(device).items():
            compared.append(name)
            if fn and has_features(case):
                fn, reason = None, peers.FEATURES_REASON
            if fn:
                calls[name] = (peers.peer_call(fn, case, x), None)
            else:
                unsupported[name] = NotMeasured("unsupported", reason)
    if baselines and flex.applies(case):
        compared.append(flex.NAME)
        if device == "cpu":
            fn, reason = None, flex.NOT_ON_CPU
        elif not flex_column:
            fn, reason = None, flex.NOT_ON_PR
        else:
            try:
                fn, reason = flex.flex_call(case, x, device)
            except Exception as exc:  # its block mask is built (and compiled) here, not timed
                fn, reason = None, f"building FlexAttention's block mask: {first_line(exc)}"
                unsupported[flex.NAME] = NotMeasured("error", reason)
        if fn:
            calls[flex.NAME] = (fn, None)
        elif flex.NAME not in unsupported:
            unsupported[flex.NAME] = NotMeasured("unsupported", reason)
    if case.kind == "decode" and device == "cuda":  # the floor is timed among the case's calls
        floor, measured = read_floor(
            case,
            x,
            device,
            timer,
            config,
            say=say,
            alongside=calls,
            ceilings=ceilings,
            rounds=rounds,
        )
    else:
        floor = None
        measured = measure_interleaved(
            calls, case, device, timer, config, ceilings, rounds, say=say
        )
    still = unstable_names(measured)
    retakes = next((r.retakes for r in measured.values() if isinstance(r, Measured)), None)
    record = CaseRecord(
        id=case.id,
        **case.to_dict(),
        flops=case.flops,
        bytes=case.bytes_moved,
        ours=measured.pop("ours"),
        baselines={},
        retakes=retakes,
        unstable=still or None,
    )
    ours = record.ours if isinstance(record.ours, Measured) else None
    if floor is not None:
        if isinstance(floor, ReadFloor) and ours:
            floor.ratio = sig(floor.median_ms / ours.median_ms, 4)
        record.read_floor = floor
    if DETERMINISTIC in measured:
        record.ours_deterministic = _beside_ours(measured.pop(DETERMINISTIC), ours)
    for name in compared:
        result = measured.get(name) or unsupported[name]
        refused = isinstance(result, NotMeasured) and result.status == "unsupported"
        if refused and device == "cpu" and name in CUDA_ONLY_BASELINES:
            result = NotMeasured("unsupported", NOT_ON_CPU)  # not the exception SDPA raised
        record.baselines[name] = _beside_ours(result, ours)
    del x
    if device == "cuda":
        torch.cuda.empty_cache()  # the next case may need what this one's SDPA workspaces held
    return record
