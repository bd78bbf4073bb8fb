"""The speed-targets section, from bench.json: the verdicts of pipeline.bench.targets (varlen against our
dense kernel, paged against contiguous decode, decode against the read floor, host cost against
SDPA, the matrix's, the training step's, the features' and the training run's targets of the card
the run is on), FlashAttention-3's and -4's geomeans beside ours, and the small model's figures
beside SDPA's.

The section is left out when bench.json is missing, unusable (the benchmark section says why) or
judges nothing. A missed target marks the section (a note in the summary table) but stays out of the
report's verdict line, like the SDPA ratio: the targets say where the kernels should get, not
whether this change broke something. Only our kernel failing on a speed case fails the section.
"""

from __future__ import annotations

from .. import markdown as md
from ..bench import records as benchrecords
from ..bench import targets
from ..bench.records import (
    FLEX_LABEL,
    PEER_LABELS,
    HostCost,
    LossRun,
    Measured,
    ModelTiming,
    NotMeasured,
    ReadFloor,
)
from .inputs import Inputs
from .sections import FAIL, NOTE, OK, Detail, Section

TITLE = "Speed targets"

# Said of paged records that were timed in several shuffled page orders (older ones had one)
_ORDERS_NOTE = "; paged: the median of its shuffled page orders (bench.md lists each)"


STYLE = targets.CellStyle(
    md.TIMES, md.DASH, "✅ ≥ {:.2f}" + md.TIMES, "⚠️ **missed** (< {:.2f}" + md.TIMES + ")"
)
_x, _judged = STYLE.ratio, STYLE.judged


def _ms(result) -> str:
    if isinstance(result, (Measured, ReadFloor)):
        return md.sig(result.median_ms) + targets.unstable_mark(result)
    return md.DASH if result is None else md.text(result.status)


def _tflops(result) -> str:
    return md.sig(result.tflops) if isinstance(result, Measured) else md.DASH


def _us(result) -> str:
    if isinstance(result, HostCost):
        return md.sig(result.us_per_call) + targets.unstable_mark(result)
    return md.text(result.status)


def _model(result, field: str) -> str:
    return (
        md.sig(getattr(result, field))
        if isinstance(result, ModelTiming)
        else md.text(result.status)
    )


def _final(run) -> str:
    return md.sig(run.final_loss) if isinstance(run, LossRun) else md.text(run.status)


def _failed(target) -> bool:
    sides = [target.ours] + [getattr(target, name, None) for name in ("dense", "contiguous")]
    return any(isinstance(side, NotMeasured) and side.status == "error" for side in sides)


def _kept(rows: list[tuple[bool, list[str]]], detail: Detail, what: str) -> list[list[str]]:
    """The rows shown: all, or under a size cut the flagged ones first, up to detail.bench_rows."""
    if detail.bench_rows is None or len(rows) <= detail.bench_rows:
        return [cells for _, cells in rows]
    ordered = sorted(rows, key=lambda row: not row[0])
    detail.omitted.append(f"{len(rows) - detail.bench_rows} of {len(rows)} {what} rows")
    return [cells for _, cells in ordered[: detail.bench_rows]]


def targets_section(inputs: Inputs, detail: Detail) -> Section | None:
    usable = "bench.json" not in inputs.unreadable and "bench.json" not in inputs.stale
    if inputs.bench is None or not usable:
        return None
    record = benchrecords.from_json(inputs.bench)
    found = targets.verdicts(record)
    if not record.targets and not any(targets.judged_here(v) for v in found):
        return None
    by = {(v.id, v.what): v for v in found}
    count = targets.counts(found)
    flagged = {v.id for v in found if v.status == targets.MISSED}
    parts = [
        f"Targets: {count[targets.MET]} met, {count[targets.MISSED]} missed, "
        f"{count[targets.NOT_JUDGED]} not judged. Each ratio is a speed over another (the other's "
        f"time over ours), so at or above its target is met."
        + (f" {targets.CPU_REASON}: nothing is judged." if record.backend == "cpu" else "")
    ]
    floor_cases = [c for c in record.cases if (c.id, targets.DECODE_VS_FLOOR) in by]
    if floor_cases:
        rows = []
        for case in floor_cases:
            verdict = by[case.id, targets.DECODE_VS_FLOOR]
            cells = [
                md.code(case.id, 150),
                md.nbytes(targets.case_kv_bytes(case)),
                _ms(case.ours),
                _ms(case.read_floor),
                _judged(verdict.ratio, verdict),
            ]
            rows.append((case.id in flagged, cells))
        parts.append(
            f"**Decode against the read floor** (K+V ≥ {targets.READ_FLOOR_MIN_BYTES // 2**20} MiB)"
            "\n\n"
            + md.table(
                ["case", "K+V", "ours ms", "read floor ms", f"floor / ours ({md.TIMES})"],
                _kept(rows, detail, "read-floor"),
            )
        )
    matrix = [v for v in found if v.what in targets.MATRIX_LABELS]
    if matrix:
        rows = _verdict_rows(matrix)
        card, card_targets = targets.shown_targets(record.gpu, record.backend == "cpu")
        parts.append(
            f"**The matrix's targets**, set for the {md.text(card.removeprefix('NVIDIA '))}: "
            f"{md.text(card_targets.summary, 600)}\n\n"
            + md.table(["case", "ratio", "verdict"], _kept(rows, detail, "matrix target"))
        )
    peer_rows = targets.peer_geomeans(record)
    if peer_rows:
        rows = [
            [
                md.text(PEER_LABELS[p.peer]),
                md.text(p.group),
                f"{p.measured} of {p.total}",
                _x(p.ratio),
                md.text(p.reason, 200) if p.reason else md.DASH,
            ]
            for p in peer_rows
        ]
        parts.append(
            "**FlashAttention-3 and -4 beside ours** (reported, no target): their time over ours, "
            "a geomean over the matrix's automatic cases of each group\n\n"
            + md.table(
                ["peer", "cases", "measured", f"theirs / ours ({md.TIMES})", "why none"], rows
            )
        )
    features = [v for v in found if v.what in targets.FEATURE_LABELS]
    if features:
        rows = _verdict_rows(features)
        parts.append(
            "**Sliding windows, softcap and sinks**, each against its twin without the feature in "
            f"the same run, the window also against {FLEX_LABEL}\n\n"
            + md.table(["case", "ratio", "verdict"], _kept(rows, detail, "feature target"))
        )
    kinds: dict[str, list] = {}
    for target in record.targets or []:
        kinds.setdefault(target.kind, []).append(target)
    if "loss" in kinds:
        rows = []
        for t in kinds["loss"]:
            verdict = by.get((t.id, targets.LOSS_AGREEMENT))
            rows.append(
                [
                    md.code(t.id, 150),
                    f"{_final(t.ours)} / {_final(t.eager)}",
                    _judged(verdict.ratio if verdict else None, verdict)
                    + (
                        f" ({md.text(verdict.reason, 200)})"
                        if verdict and verdict.status == targets.NOT_JUDGED
                        else ""
                    ),
                ]
            )
        parts.append(
            "**The Gemma-2-style training run**: our attention and eager's from one "
            "initialisation on the same batches\n\n"
            + md.table(
                ["case", "final loss ours / eager", f"1 - |ours / eager - 1| ({md.TIMES})"], rows
            )
        )
    if "varlen" in kinds:
        rows = [
            (
                t.id in flagged,
                [
                    md.code(t.id, 150),
                    md.text(
                        f"{len(t.lengths)} ({min(t.lengths, default=0)}-{max(t.lengths, default=0)})"
                    ),
                    _ms(t.ours),
                    _tflops(t.ours),
                    _ms(t.dense),
                    _tflops(t.dense),
                    _judged(t.ratio, by.get((t.id, targets.VARLEN_VS_DENSE))),
                ],
            )
            for t in kinds["varlen"]
        ]
        parts.append(
            "**Varlen against our dense kernel** on the same sequences (one dense call per "
            "distinct length, one timing window)\n\n"
            + md.table(
                [
                    "case",
                    "sequences",
                    "varlen ms",
                    "TFLOP/s",
                    "dense ms",
                    "TFLOP/s",
                    f"dense / varlen ({md.TIMES})",
                ],
                _kept(rows, detail, "varlen"),
            )
        )
    if "paged" in kinds:
        rows = [
            (
                t.id in flagged,
                [
                    md.code(t.id, 150),
                    md.nbytes(t.kv_bytes),
                    _ms(t.ours),
                    _ms(t.contiguous),
                    _ms(t.read_floor),
                    _judged(t.ratio, by.get((t.id, targets.PAGED_VS_CONTIGUOUS))),
                    _judged(t.floor_ratio, by.get((t.id, targets.PAGED_VS_FLOOR))),
                    _judged(t.contiguous_floor_ratio, by.get((t.id, targets.CONTIGUOUS_VS_FLOOR))),
                ],
            )
            for t in kinds["paged"]
        ]
        parts.append(
            "**Paged decode against contiguous decode** on the same cache contents (target for "
            f"block sizes ≥ {targets.PAGED_MIN_BLOCK}), both against the read floor"
            + _ORDERS_NOTE * any(t.orders_ms for t in kinds["paged"])
            + "\n\n"
            + md.table(
                [
                    "case",
                    "K+V",
                    "paged ms",
                    "contiguous ms",
                    "read floor ms",
                    "contiguous / paged",
                    "floor / paged",
                    "floor / contiguous",
                ],
                _kept(rows, detail, "paged"),
            )
        )
    if "host" in kinds:
        rows = [
            [
                md.code(t.id, 150),
                _us(t.ours),
                _us(t.sdpa),
                _judged(t.ratio, by.get((t.id, targets.OURS_VS_SDPA_HOST))),
            ]
            for t in kinds["host"]
        ]
        calls = kinds["host"][0].calls
        parts.append(
            f"**Host cost**: time per call of {calls:,} back-to-back calls, no synchronisation "
            "in the loop\n\n"
            + md.table(["case", "ours µs/call", "SDPA µs/call", f"SDPA / ours ({md.TIMES})"], rows)
        )
    if "step" in kinds:
        rows = [
            (
                t.id in flagged,
                [
                    md.code(t.id, 150),
                    f"{_ms(t.ours)} / {_ms(t.sdpa)}",
                    f"{md.sig(t.ours_tokens_per_s)} / {md.sig(t.sdpa_tokens_per_s)}",
                    _judged(t.ratio, by.get((t.id, targets.STEP_VS_SDPA))),
                ],
            )
            for t in kinds["step"]
        ]
        parts.append(
            "**The training step**: forward, backward and AdamW of a Llama-style model, our "
            "attention against SDPA's from the same initialisation, timed in the same rounds\n\n"
            + md.table(
                [
                    "case",
                    "ms/step ours / SDPA",
                    "tokens/s ours / SDPA",
                    f"ours / SDPA tokens/s ({md.TIMES})",
                ],
                _kept(rows, detail, "training step"),
            )
        )
    if "model" in kinds:
        rows = [
            [
                md.code(t.id, 150),
                f"{_model(t.ours, 'prefill_ms')} / {_model(t.sdpa, 'prefill_ms')}",
                _x(t.prefill_ratio),
                f"{_model(t.ours, 'decode_tokens_per_s')} / "
                f"{_model(t.sdpa, 'decode_tokens_per_s')}",
                _x(t.decode_ratio),
            ]
            for t in kinds["model"]
        ]
        parts.append(
            "**The small Llama-style model**, our attention against SDPA (no target; decode: "
            "tokens after the first per second of greedy generation with the KV cache)\n\n"
            + md.table(
                [
                    "case",
                    "prefill ms ours / SDPA",
                    f"SDPA / ours ({md.TIMES})",
                    "decode tok/s ours / SDPA",
                    f"ours / SDPA ({md.TIMES})",
                ],
                rows,
            )
        )
    note = targets.records_note(record.targets or [])
    if note:
        parts.append(note)
    reasons: dict[str, set[str]] = {}
    for target in record.targets or []:
        for name in ("ours", "dense", "contiguous", "sdpa", "eager", "read_floor"):
            side = getattr(target, name, None)
            if isinstance(side, NotMeasured):
                reasons.setdefault(f"{target.kind} {name}: {side.status}", set()).add(side.reason)
    if reasons:
        parts.append(
            "\n".join(
                f"- {md.text(what)}: " + " / ".join(md.text(r, 300) for r in sorted(texts)[:3])
                for what, texts in sorted(reasons.items())
            )
        )
    failed = [t.id for t in record.targets or [] if _failed(t)]
    problems = []
    severity = OK
    if count[targets.MISSED] or not count[targets.MET]:  # a miss, or nothing judged: not a ✅
        severity = NOTE  # shown in the summary table, kept out of the verdict line
    if failed:
        severity = FAIL
        problems.append((FAIL, f"our kernel failed on {md.plural(len(failed), 'speed case')}"))
    summary = (
        f"{count[targets.MET]} met, {count[targets.MISSED]} missed, "
        f"{count[targets.NOT_JUDGED]} not judged"
        + (" (CPU backend)" if record.backend == "cpu" else "")
        + (f", {len(failed)} failed" if failed else "")
    )
    return Section("speed", TITLE, severity, summary, "\n\n".join(parts), problems)


def _verdict_rows(verdicts) -> list[tuple[bool, list[str]]]:
    """(missed, [case, what, verdict]) rows of the matrix's and the features' targets; a target
    not judged says why."""
    return [
        (
            v.status == targets.MISSED,
            [
                md.code(v.id, 150),
                md.text(v.what),
                _judged(v.ratio, v)
                + (f" ({md.text(v.reason, 200)})" if v.status == targets.NOT_JUDGED else ""),
            ],
        )
        for v in verdicts
    ]
