"""bench.md: the benchmark record as a markdown table, with the head-against-base section."""

from __future__ import annotations

from . import stats
from .benchrecords import (
    BASELINE_NAMES,
    BenchRecord,
    CaseRecord,
    Comparison,
    Measured,
    MissingVerdict,
    ReadFloor,
)


def _ms(result) -> str:
    return (
        f"{result.median_ms:.4g} ({result.iqr_ms:.2g})"
        if isinstance(result, Measured)
        else result.status
    )


def _ratio(result) -> str:
    if result is None:
        return "-"
    return f"{result.ratio:.2f}x" if getattr(result, "ratio", None) else result.status


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
    sha = f"{commit.sha[:12]}{' (dirty)' if commit.dirty else ''}" if commit else "None"
    flush = timing.l2_flush_bytes // 2**20
    copy, matmul = record.ceilings.copy, record.ceilings.matmul
    return [
        "# Attention benchmark: flashmoe-science against PyTorch SDPA",
        "",
        f"{where}; torch {record.torch}, CUDA {record.cuda}; commit {sha}.",
        f"Timing: {timing.method}"
        + (f", {flush} MiB L2 flush before every call" if flush else ", no cache flush")
        + "; median ms (IQR). vs X = X's time / ours (above 1: ours is faster); the read floor "
        "(decode on CUDA) is a bare read of the case's K and V.",
        f"Ceilings measured in this run: copy {_num(copy and copy.gbps, '.0f')} GB/s, "
        f"{matmul.dtype if matmul else '?'} matmul {matmul.n if matmul else '?'}^3 "
        f"{_num(matmul and matmul.tflops, '.3g')} TFLOP/s; "
        "% ceiling is decode against the copy, prefill against the matmul.",
    ]


def _case_row(case: CaseRecord) -> str:
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
        *(_ratio(case.baselines.get(name)) for name in BASELINE_NAMES),
        _ratio(case.read_floor),
        f"{_mib(ours.peak_mem_bytes if measured else None)} / {_mib(sdpa_mem)}",
    ]
    return "| " + " | ".join(cells) + " |"


def render_markdown(record: BenchRecord) -> str:
    vs = [f"vs {name.removeprefix('sdpa-')}" for name in BASELINE_NAMES]
    columns = ["case", "ours ms (IQR)", "TFLOP/s", "GB/s", "% ceiling", *vs, "vs read floor"]
    columns.append("peak MiB ours / sdpa")
    lines = [
        *_header_lines(record),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += [_case_row(case) for case in record.cases]
    reasons: dict[str, set[str]] = {}
    for case in record.cases:
        results = [("ours", case.ours), *case.baselines.items()]
        results += [("read floor", case.read_floor)] if case.read_floor is not None else []
        for name, result in results:
            if not isinstance(result, (Measured, ReadFloor)):
                reasons.setdefault(f"{name} {result.status}", set()).add(result.reason[:200])
    for what, texts in sorted(reasons.items()):
        lines += ["", f"{what}: " + " / ".join(sorted(texts)[:3])]
    if record.comparison:
        lines += ["", *render_comparison(record.comparison)]
    return "\n".join(lines) + "\n"


def _comparison_row(r) -> str:
    if isinstance(r, MissingVerdict):
        return f"| {r.id} | - | - | - | - | missing: {r.reason[:80]} |"
    p = "-" if r.p_value is None else f"{r.p_value:.2g}"
    cells = [r.id, f"{r.base_median_ms:.4g}", f"{r.head_median_ms:.4g}"]
    cells += [f"{r.change_pct:+.1f}%", p, r.verdict]
    return "| " + " | ".join(cells) + " |"


def render_comparison(comparison: Comparison) -> list[str]:
    base = comparison.base
    lines = [
        f"## Head against base {base.ref} ({str(base.sha)[:12]}), source: {comparison.source}",
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
