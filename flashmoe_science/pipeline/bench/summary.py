"""bench.md: the benchmark record as a markdown table (ours, SDPA's backends, FlashAttention-3 and -4
and FlexAttention where the record has their columns, our deterministic backward), the speed
targets' tables and verdicts (pipeline.bench.targets), and the head-against-base section."""

from __future__ import annotations

import dataclasses

from ... import _loader
from .. import load
from . import stats, targets
from .records import (
    BASELINE_NAMES,
    FLEX_LABEL,
    FLEX_NAME,
    NOT_INSTALLED,
    PEER_LABELS,
    PEER_NAMES,
    SUBSET_LABELS,
    BenchRecord,
    CaseRecord,
    Comparison,
    HostCost,
    Measured,
    MissingVerdict,
    ModelTiming,
    NotMeasured,
    ReadFloor,
)

_mark = targets.unstable_mark


def _ms(result) -> str:
    return (
        f"{result.median_ms:.4g} ({result.iqr_ms:.2g}){_mark(result)}"
        if isinstance(result, Measured)
        else result.status
    )


def _ratio(result) -> str:
    if result is None:
        return "-"
    if getattr(result, "ratio", None):
        return f"{result.ratio:.2f}x{_mark(result)}"
    if isinstance(result, Measured):  # no time of ours to set it against: its own
        return f"{result.median_ms:.4g} ms{_mark(result)}"
    if isinstance(result, NotMeasured) and result.reason.startswith(NOT_INSTALLED):
        return NOT_INSTALLED
    return result.status


def columns_of(record: BenchRecord) -> tuple[list[str], bool]:
    """The baselines' columns of the case table (the peers only where the record has them) and
    whether it has the deterministic column."""
    peers = [n for n in (*PEER_NAMES, FLEX_NAME) if any(n in c.baselines for c in record.cases)]
    deterministic = any(c.ours_deterministic is not None for c in record.cases)
    return [*BASELINE_NAMES, *peers], deterministic


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _header_lines(record: BenchRecord) -> list[str]:
    gpu, commit, timing = record.gpu, record.commit, record.timing
    if gpu:
        sm = gpu.capability.replace(".", "")
        where = f"{gpu.name} (sm_{sm}, {gpu.sm_count} SMs), driver {record.driver}"
    else:
        where = "CPU backend (plumbing numbers, not a performance claim)"
    files = (record.provenance.get("commit") or {}).get("fingerprint")
    sha = (
        f"{commit.sha[:12]}{' (dirty)' if commit.dirty else ''}"
        if commit
        else f"none (not a git checkout{f'; files {files}' if files else ''})"
    )
    flush = timing.l2_flush_bytes // 2**20
    copy, matmul = record.ceilings.copy, record.ceilings.matmul
    return [
        "# Attention benchmark: flashmoe-science against PyTorch SDPA",
        "",
        f"{where}; torch {record.torch}, CUDA {record.cuda}; commit {sha}"
        + (
            f"; **not the default build**: {_loader.define_flags(record.defines)}."
            if record.defines
            else "."
        ),
        f"Timing: {timing.method}"
        + (
            f", each sample the time per call of back-to-back calls lasting at least "
            f"{timing.min_sample_ms:g} ms"
            if timing.min_sample_ms
            else ""
        )
        + (f", {flush} MiB L2 flush before every call" if flush else ", no cache flush")
        + "; median ms (IQR)"
        + (
            f" of ours and each baseline, timed in turn over {timing.rounds} interleaved rounds"
            if timing.rounds
            else ""
        )
        + (
            f"; a case with a timing whose IQR exceeds {100 * timing.unstable_spread:.0f}% of its "
            + (
                f"median is measured again, up to {timing.retakes} times "
                if timing.retakes
                else "median is marked, not measured again (--retakes 0) "
            )
            + f"({targets.UNSTABLE_MARK}: still over it)"
            if timing.unstable_spread is not None
            else ""
        )
        + ". vs X = X's time / ours (above 1: ours is faster); the read floor "
        "(decode on CUDA) is a bare read of the case's K and V.",
        f"Ceilings measured in this run: copy {_num(copy and copy.gbps, '.0f')} GB/s, "
        f"{matmul.dtype if matmul else '?'} matmul {matmul.n if matmul else '?'}^3 "
        f"{_num(matmul and matmul.tflops, '.3g')} TFLOP/s; "
        "% ceiling is decode against the copy, prefill against the matmul.",
        *_load_lines(record),
        *_subset_lines(record),
    ]


def _subset_lines(record: BenchRecord) -> list[str]:
    if not record.subset:
        return []
    partial = ", ".join(record.partial_groups or ())
    return [
        f"Cases: {SUBSET_LABELS[record.subset]}, {len(record.cases)} matrix cases"
        + (
            f"; the geomeans of {partial} are judged over all of the matrix's cases of each "
            "(pushes to main, the nightly run)."
            if partial
            else "."
        )
    ]


def _load_lines(record: BenchRecord) -> list[str]:
    """The machine's load, and for a CPU run under load, that its timings are not judged."""
    block = dataclasses.asdict(record.load) if record.load else None
    seen = load.describe(block)
    busy = load.busy(block) if record.backend == "cpu" else None
    lines = [f"Load: {seen} (1 minute, at the start and the end)."] if seen else []
    if busy:
        lines.append(not_judged_line(busy))
    return lines


def not_judged_line(busy: str) -> str:
    return (
        f"**Not judged**: {busy} (the 1-minute average, so a stage that ended within the minute "
        f"counts too): CPU timings on busy cores are not judged; {load.RERUN}."
    )


def _case_row(case: CaseRecord, names: list[str], deterministic: bool) -> str:
    ours = case.ours
    measured = isinstance(ours, Measured)
    pct = None
    if measured:
        pct = ours.pct_copy_ceiling if case.kind == "decode" else ours.pct_matmul_ceiling
    default = case.baselines.get("sdpa-default")
    sdpa_mem = default.peak_mem_bytes if isinstance(default, Measured) else None
    cells = [
        case.id,
        _ms(ours),
        _num(ours.tflops if measured else None, ".3g"),
        _num(ours.gbps if measured else None, ".3g"),
        _num(pct, ".2g"),
        *(_ratio(case.baselines.get(name)) for name in names),
        *([_ratio(case.ours_deterministic)] if deterministic else []),
        _ratio(case.read_floor),
        f"{_mib(ours.peak_mem_bytes if measured else None)} / {_mib(sdpa_mem)}",
    ]
    return "| " + " | ".join(cells) + " |"


def render_markdown(record: BenchRecord) -> str:
    names, deterministic = columns_of(record)
    vs = [f"vs {name.removeprefix('sdpa-')}" for name in names]
    vs += ["vs deterministic"] if deterministic else []
    columns = ["case", "ours ms (IQR)", "TFLOP/s", "GB/s", "% ceiling", *vs, "vs read floor"]
    columns.append("peak MiB ours / sdpa")
    lines = [
        *_header_lines(record),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += [_case_row(case, names, deterministic) for case in record.cases]
    if any(name in (*PEER_NAMES, FLEX_NAME) for name in names) or deterministic:
        lines += ["", _columns_note(names, deterministic)]
    reasons: dict[str, set[str]] = {}
    for case in record.cases:
        results = [("ours", case.ours), *case.baselines.items()]
        results += [("read floor", case.read_floor)] if case.read_floor is not None else []
        if case.ours_deterministic is not None:
            results.append(("ours deterministic", case.ours_deterministic))
        for name, result in results:
            if not isinstance(result, (Measured, ReadFloor)):
                reasons.setdefault(f"{name} {result.status}", set()).add(result.reason[:200])
    for what, texts in sorted(reasons.items()):
        lines += ["", f"{what}: " + " / ".join(sorted(texts)[:3])]
    note = targets.records_note(record.cases)
    lines += ["", note] if note else []
    lines += render_targets(record)
    if record.comparison:
        lines += ["", *render_comparison(record.comparison)]
    return "\n".join(lines) + "\n"


def _columns_note(names: list[str], deterministic: bool) -> str:
    peers = [f"{name} is {PEER_LABELS[name]}" for name in names if name in PEER_NAMES]
    parts = [", ".join(peers) + " (prefill and backward kinds)"] if peers else []
    if FLEX_NAME in names:
        parts.append(
            f"flex is {FLEX_LABEL} under torch.compile (the window, softcap and sinks cases)"
        )
    if deterministic:
        parts.append("deterministic is ours with deterministic=True (automatic backward cases)")
    return "Columns: " + "; ".join(parts) + "; each timed in the same rounds as ours."


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(columns), "|" + "---|" * len(columns), *(_row(r) for r in rows)]


_x, _cell, _judged = targets.PLAIN.ratio, targets.PLAIN.verdict, targets.PLAIN.judged


def _side_ms(result) -> str:
    if isinstance(result, (Measured, ReadFloor)):
        return f"{result.median_ms:.4g}{_mark(result)}"
    return "-" if result is None else result.status


def _orders_ms(orders: list | None) -> str:
    """Each page order's median time, or "-" for a record of one order (before page orders)."""
    if not orders:
        return "-"
    return " / ".join("-" if ms is None else f"{ms:.4g}" for ms in orders)


def _tflops(result) -> str:
    return _num(result.tflops, ".3g") if isinstance(result, Measured) else "-"


def render_targets(record: BenchRecord) -> list[str]:
    """The speed targets: one table per kind, a verdict per ratio that has a target."""
    found = targets.verdicts(record)
    if not record.targets and not any(targets.judged_here(v) for v in found):
        return []
    by = {(v.id, v.what): v for v in found}
    count = targets.counts(found)
    lines = [
        "",
        "## Speed targets",
        "",
        f"{count[targets.MET]} met, {count[targets.MISSED]} missed, "
        f"{count[targets.NOT_JUDGED]} not judged. Every ratio is a speed over another "
        "(the other's time over ours): above the target is good."
        + (f" {targets.CPU_REASON}: nothing is judged." if record.backend == "cpu" else ""),
    ]
    floors = [c for c in record.cases if (c.id, targets.DECODE_VS_FLOOR) in by]
    if floors:
        rows = [
            [
                c.id,
                _mib(targets.case_kv_bytes(c)),
                _side_ms(c.ours),
                _side_ms(c.read_floor),
                _x(by[c.id, targets.DECODE_VS_FLOOR].ratio),
                _cell(by[c.id, targets.DECODE_VS_FLOOR]),
            ]
            for c in floors
        ]
        lines += [
            "",
            f"Decode against the read floor (K+V >= {targets.READ_FLOOR_MIN_BYTES // 2**20} MiB; "
            f"target {targets.READ_FLOOR_TARGET:.2f}x):",
            "",
            *_table(
                ["case", "K+V MiB", "ours ms", "read floor ms", "floor / ours", "verdict"], rows
            ),
        ]
    matrix = [v for v in found if v.what in targets.MATRIX_LABELS]
    card, card_targets = targets.shown_targets(record.gpu, record.backend == "cpu")
    if matrix:
        rows = _verdict_rows(matrix)
        lines += [
            "",
            f"The matrix's targets, set for the {card.removeprefix('NVIDIA ')} "
            f"({card_targets.summary}):",
            "",
            *_table(["case", "ratio", "value", "verdict"], rows),
        ]
    peer_rows = targets.peer_geomeans(record)
    if peer_rows:
        rows = [
            [
                PEER_LABELS[p.peer],
                p.group,
                f"{p.measured} of {p.total}",
                _x(p.ratio),
                p.reason[:200] or "-",
            ]
            for p in peer_rows
        ]
        lines += [
            "",
            "FlashAttention-3 and -4 beside ours (reported, no target): their time over ours, a "
            "geomean over the matrix's automatic cases of each group:",
            "",
            *_table(["peer", "cases", "measured", "theirs / ours", "why none"], rows),
        ]
    kinds = {}
    for t in record.targets or []:
        kinds.setdefault(t.kind, []).append(t)
    if "varlen" in kinds:
        rows = [
            [
                t.id,
                f"{len(t.lengths)} ({min(t.lengths, default=0)}-{max(t.lengths, default=0)})",
                _side_ms(t.ours),
                _tflops(t.ours),
                _side_ms(t.dense),
                _tflops(t.dense),
                _x(t.ratio),
                _cell(by.get((t.id, targets.VARLEN_VS_DENSE))),
            ]
            for t in kinds["varlen"]
        ]
        lines += [
            "",
            "Varlen against our dense kernel on the same sequences (one dense call per distinct "
            f"length, in one timing window; target {targets.VARLEN_TARGET:.2f}x):",
            "",
            *_table(
                [
                    "case",
                    "sequences",
                    "varlen ms",
                    "TFLOP/s",
                    "dense ms",
                    "TFLOP/s",
                    "dense / varlen",
                    "verdict",
                ],
                rows,
            ),
        ]
    if "paged" in kinds:
        rows = []
        for t in kinds["paged"]:
            rows.append(
                [
                    t.id,
                    _mib(t.kv_bytes),
                    _side_ms(t.ours),
                    _orders_ms(t.orders_ms),
                    _side_ms(t.contiguous),
                    _side_ms(t.read_floor),
                    _judged(t.ratio, by.get((t.id, targets.PAGED_VS_CONTIGUOUS))),
                    _judged(t.floor_ratio, by.get((t.id, targets.PAGED_VS_FLOOR))),
                    _judged(t.contiguous_floor_ratio, by.get((t.id, targets.CONTIGUOUS_VS_FLOOR))),
                ]
            )
        lines += [
            "",
            "Paged decode against contiguous decode on the same cache contents (target "
            f"{targets.PAGED_TARGET:.2f}x for block sizes >= {targets.PAGED_MIN_BLOCK}), and both "
            f"against the read floor (target {targets.READ_FLOOR_TARGET:.2f}x)"
            + (
                ". The paged side is the median of its shuffled page orders, each timed in the "
                "same rounds:"
                if any(t.orders_ms for t in kinds["paged"])
                else ":"
            ),
            "",
            *_table(
                [
                    "case",
                    "K+V MiB",
                    "paged ms",
                    "each page order ms",
                    "contiguous ms",
                    "read floor ms",
                    "contiguous / paged",
                    "floor / paged",
                    "floor / contiguous",
                ],
                rows,
            ),
        ]
    if "host" in kinds:
        rows = [
            [
                t.id,
                _us(t.ours),
                _us(t.sdpa),
                _x(t.ratio),
                _cell(by.get((t.id, targets.OURS_VS_SDPA_HOST))),
            ]
            for t in kinds["host"]
        ]
        lines += [
            "",
            "Host cost: time per call of back-to-back calls, no synchronisation in the loop "
            f"(target: SDPA's time over ours >= {targets.HOST_TARGET:.2f}x):",
            "",
            *_table(["case", "ours us/call", "SDPA us/call", "SDPA / ours", "verdict"], rows),
        ]
    if "step" in kinds:
        rows = [
            [
                t.id,
                _side_ms(t.ours),
                _side_ms(t.sdpa),
                _num(t.ours_tokens_per_s, ".4g"),
                _num(t.sdpa_tokens_per_s, ".4g"),
                _judged(t.ratio, by.get((t.id, targets.STEP_VS_SDPA))),
            ]
            for t in kinds["step"]
        ]
        lines += [
            "",
            "The training step: forward, backward and AdamW of a Llama-style model, our attention "
            "against SDPA's, from the same initialisation, timed in the same rounds (target: our "
            f"tokens/s >= {targets.STEP_TARGET:.2f}x SDPA's, on the {targets.step_cards()}):",
            "",
            *_table(
                [
                    "case",
                    "ours ms/step",
                    "SDPA ms/step",
                    "ours tokens/s",
                    "SDPA tokens/s",
                    "ours / SDPA",
                ],
                rows,
            ),
        ]
    features = [v for v in found if v.what in targets.FEATURE_LABELS]
    if features:
        rows = _verdict_rows(features)
        lines += [
            "",
            "Sliding windows, softcap and sinks, each against its twin without the feature in the "
            f"same run, and the window against {FLEX_LABEL} (targets: the window at least "
            f"{targets.FLEX_TARGET:.2f}x {FLEX_LABEL}'s speed and at most "
            f"{targets.WINDOW_MAX_SLOWDOWN:.2f}x the causal time scaled by the pairs it lets "
            f"through; a softcap at most {targets.SOFTCAP_MAX_SLOWDOWN:.2f}x and sinks at most "
            f"{targets.SINKS_MAX_SLOWDOWN:.2f}x the time without; on the "
            f"{targets.feature_cards()}):",
            "",
            *_table(["case", "ratio", "value", "verdict"], rows),
        ]
    if "loss" in kinds:
        rows = [
            [
                t.id,
                _final(t.ours),
                _final(t.eager),
                _num(t.ratio, ".5g"),
                _judged(
                    by[t.id, targets.LOSS_AGREEMENT].ratio, by.get((t.id, targets.LOSS_AGREEMENT))
                ),
            ]
            for t in kinds["loss"]
        ]
        lines += [
            "",
            "The Gemma-2-style training run (sliding and global layers, a softcap), our attention "
            "and eager's from one initialisation on the same batches (target: final losses within "
            f"{100 * targets.LOSS_MAX_DIFFERENCE:.0f}% of eager's, on the "
            f"{targets.feature_cards()}):",
            "",
            *_table(
                ["case", "final loss ours", "final loss eager", "ours / eager", "agreement"], rows
            ),
        ]
    if "model" in kinds:
        rows = [
            [
                t.id,
                _model(t.ours, "prefill_ms", ".4g"),
                _model(t.sdpa, "prefill_ms", ".4g"),
                _x(t.prefill_ratio),
                _model(t.ours, "decode_tokens_per_s", ".4g"),
                _model(t.sdpa, "decode_tokens_per_s", ".4g"),
                _x(t.decode_ratio),
            ]
            for t in kinds["model"]
        ]
        lines += [
            "",
            "The small Llama-style model, our attention against SDPA (no target; decode: tokens "
            "after the first per second of greedy generation with the KV cache):",
            "",
            *_table(
                [
                    "case",
                    "prefill ms ours",
                    "prefill ms SDPA",
                    "SDPA / ours",
                    "decode tok/s ours",
                    "decode tok/s SDPA",
                    "ours / SDPA",
                ],
                rows,
            ),
        ]
    # each case of the matrix's targets is in its table above; the list keeps their geomeans
    per_case = [v for v in found if v.what in targets.MATRIX_CASE_LABELS]
    missed = [v.text() for v in found if v.status == targets.MISSED and v not in per_case]
    missed_cases = sum(v.status == targets.MISSED for v in per_case)
    if missed_cases:
        missed.append(f"{missed_cases} of {len(per_case)} matrix cases (the table above)")
    if missed:
        lines += ["", "Missed:", *(f"- {text}" for text in missed)]
    note = targets.records_note(record.targets or [])
    lines += ["", note] if note else []
    reasons: dict[str, set[str]] = {}
    for t in record.targets or []:
        for name in ("ours", "dense", "contiguous", "sdpa", "eager", "read_floor"):
            side = getattr(t, name, None)
            if isinstance(side, NotMeasured):
                reasons.setdefault(f"{t.kind} {name} {side.status}", set()).add(side.reason[:200])
    for what, texts in sorted(reasons.items()):
        lines += ["", f"{what}: " + " / ".join(sorted(texts)[:3])]
    return lines


def _final(run) -> str:
    return run.status if isinstance(run, NotMeasured) else f"{run.final_loss:.5g}"


def _us(result) -> str:
    if isinstance(result, HostCost):
        return f"{result.us_per_call:.3g}{_mark(result)}"
    return result.status


def _model(result, field: str, fmt: str) -> str:
    return format(getattr(result, field), fmt) if isinstance(result, ModelTiming) else result.status


def _comparison_row(r) -> str:
    if isinstance(r, MissingVerdict):
        return f"| {r.id} | - | - | - | - | missing: {r.reason[:80]} |"
    p = "-" if r.p_value is None else f"{r.p_value:.2g}"
    cells = [r.id, f"{r.base_median_ms:.4g}", f"{r.head_median_ms:.4g}"]
    cells += [f"{r.change_pct:+.1f}%", p, r.verdict]
    return "| " + " | ".join(cells) + " |"


def render_comparison(comparison: Comparison) -> list[str]:
    base = comparison.base
    built = (
        f", built with {_loader.define_flags(base.defines) or 'no extra defines'}"
        if base.defines is not None
        else ""
    )
    lines = [
        f"## Head against base {base.ref} ({str(base.sha)[:12]}{built}), source: "
        f"{comparison.source}",
        "",
        f"Threshold {comparison.threshold * 100:.0f}% and Mann-Whitney p < "
        f"{comparison.alpha}: {comparison.summary_text()}.",
    ]
    if comparison.reason:
        lines += ["", f"Why not side by side: {comparison.reason}"]
    if comparison.source == "stored":
        lines += [
            f"Base samples from the stored run of {base.stored_commit[:12]} "
            f"({base.stored_at}): another run, so machine drift is not controlled."
        ]
    if comparison.cases:
        order = {stats.REGRESSION: 0, stats.IMPROVEMENT: 1, "missing": 2, stats.NO_CHANGE: 3}
        rows = sorted(comparison.cases, key=lambda r: (order.get(r.verdict, 9), r.id))
        lines += [
            "",
            "| case | base ms | head ms | change | p | verdict |",
            "|---|---|---|---|---|---|",
        ]
        lines += [_comparison_row(r) for r in rows]
    return lines


def _verdict_rows(verdicts) -> list[list[str]]:
    """[case, what, ratio, verdict] rows of the matrix's and the features' targets; a target not
    judged says why."""
    return [
        [
            v.id,
            v.what,
            _x(v.ratio),
            _cell(v) if v.status != targets.NOT_JUDGED else f"not judged ({v.reason})",
        ]
        for v in verdicts
    ]
