"""The benchmark section, from bench.json as benches/bench.schema.json defines it (the report reads
only a file that matches the schema: flashmoe_science.pipeline.report.inputs.bench_problem).

A bench without a head-vs-base comparison ran, but says nothing about a regression: its row and the
verdict say "not compared" and why, never a plain pass. The SDPA ratio is information, not a gate.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ... import _loader
from .. import load
from .. import markdown as md
from ..bench import stats
from ..bench.records import (
    CUDA_ONLY_BASELINES,
    FLEX_LABEL,
    FLEX_NAME,
    NOT_INSTALLED,
    NOT_ON_CPU,
    PEER_LABELS,
    PEER_NAMES,
    SUBSET_LABELS,
)
from ..bench.summary import not_judged_line
from ..bench.targets import UNSTABLE_MARK, unstable_note
from .inputs import Inputs
from .sections import (
    FAIL,
    NOTE,
    OK,
    WARN,
    Detail,
    Section,
    absent,
    stale_section,
    unreadable_section,
)

BASELINES = ("sdpa-default", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")  # the schema's names
BASELINE_LABELS = {
    "sdpa-default": "SDPA default",
    "sdpa-flash": "SDPA flash",
    "sdpa-cudnn": "SDPA cuDNN",
    "sdpa-efficient": "SDPA efficient",
    **PEER_LABELS,
    FLEX_NAME: FLEX_LABEL,
}
# Columns a group's table has only where its cases have them
EXTRA_COLUMNS = (*PEER_NAMES, FLEX_NAME)
DETERMINISTIC_LABEL = "ours deterministic"
GROUPS = ("prefill", "decode", "small", "backward", "train", "features")
OVER_COPY = "†"  # marks a bandwidth above the measured copy ceiling
SDPA_RATIO_LINE = (
    f"SDPA ratio ({md.TIMES}): SDPA's time over ours, so above 1.00{md.TIMES} we are faster. "
    "It describes speed on this machine and is not a gate: only a head-vs-base regression is."
)
# SDPA explains a refusal in warnings that end with where in PyTorch they were raised; the reason
# is the part before that, and "X kernel not used because:" is followed by the reason's own warning.
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")


def refusal_reason(reason: str) -> str:
    """'Memory efficient kernel not used because: (Triggered internally at ...); Memory Efficient
    attention requires ... (Triggered internally at ...); RuntimeError: No available kernel.'
    -> 'Memory Efficient attention requires ...; RuntimeError: No available kernel.'"""
    parts = [_TRIGGERED.sub("", part).strip() for part in reason.split("; ")]
    parts = [part for part in parts if part and not part.endswith("because:")]
    return "; ".join(dict.fromkeys(parts)) or reason.strip()


def _result(container: Any, name: str) -> dict | None:
    value = container.get(name) if isinstance(container, dict) else None
    return value if isinstance(value, dict) else None


def _measured(result: dict | None) -> bool:
    return (
        isinstance(result, dict)
        and result.get("status") == "ok"
        and md.num(result.get("median_ms")) is not None
    )


def _not_measured(result: dict | None) -> tuple[str, str] | None:
    """(status, reason) of a result without a timing: "unsupported" (the backend refuses the case)
    or "error" (it failed)."""
    if not isinstance(result, dict) or _measured(result):
        return None
    status = "unsupported" if result.get("status") == "unsupported" else "error"
    return status, refusal_reason(str(result.get("reason") or "no timing"))


def _over_ours(case: dict, result: dict | None) -> float | None:
    """Another result's time over ours."""
    ours = case.get("ours")
    if _measured(ours) and _measured(result) and md.num(ours["median_ms"]):
        return md.num(result["median_ms"]) / md.num(ours["median_ms"])
    return None


def _speedup(case: dict, name: str) -> float | None:
    """A baseline's time over ours: above 1 we are faster."""
    return _over_ours(case, _result(case.get("baselines"), name))


def _baseline_tflops(case: dict, name: str) -> float | None:
    base = _result(case.get("baselines"), name)
    return md.num(base.get("tflops")) if _measured(base) else None


def _group(case: dict) -> str:
    """prefill, decode or small: where in the matrix the case comes from."""
    return str(case.get("group", "?"))


def _seqlen(case: dict) -> int | None:
    return md.integer(case.get("seqlen_k"))


def _series(case: dict) -> str:
    """The case with batch and sequence length left out: one line of the chart."""
    heads = f"h{case.get('heads_q')}"
    if case.get("heads_kv") != case.get("heads_q"):
        heads += f"kv{case.get('heads_kv')}"
    mask = "causal" if case.get("causal") else "full"
    return f"{case.get('dtype')} d{case.get('head_dim')} {heads} {mask}"


def prefill_chart(cases: list[dict]) -> str:
    """A mermaid xychart of our TFLOP/s against SDPA's over sequence length, for the prefill series
    with the most points."""
    series: dict[str, dict[int, dict]] = {}
    for case in cases:
        ours = case.get("ours")
        if (
            _group(case) == "prefill"
            and _seqlen(case)
            and _measured(ours)
            and md.num(ours.get("tflops"))
        ):
            series.setdefault(_series(case), {}).setdefault(_seqlen(case), case)
    best = None
    for key, by_len in series.items():
        for name in BASELINES:  # in order of preference
            points = [
                (n, c) for n, c in sorted(by_len.items()) if _baseline_tflops(c, name) is not None
            ]
            if len(points) >= 2 and (best is None or len(points) > len(best[2])):
                best = (key, name, points)
            if len(points) == len(by_len):
                break
    if best is None:
        return ""
    key, name, points = best
    ours = [round(md.num(c["ours"]["tflops"]), 1) for _, c in points]
    theirs = [round(_baseline_tflops(c, name), 1) for _, c in points]
    if not any(ours + theirs):  # a CPU's TFLOP/s round to 0.0: a chart of zeros says nothing
        return ""
    y_max = max(10, math.ceil(max(ours + theirs) * 1.1 / 10.0) * 10)
    title = re.sub(r"[^A-Za-z0-9 _.,:+-]", " ", f"prefill {key}").strip()
    chart = "\n".join(
        [
            "xychart-beta",
            f'    title "{title}: TFLOP/s"',
            f'    x-axis "sequence length" [{", ".join(str(n) for n, _ in points)}]',
            f'    y-axis "TFLOP/s" 0 --> {y_max}',
            f"    bar [{', '.join(f'{v:g}' for v in theirs)}]",
            f"    line [{', '.join(f'{v:g}' for v in ours)}]",
        ]
    )
    return (
        md.fenced(chart, "mermaid")
        + f"\n\n_Bars: {BASELINE_LABELS[name]}; line: flashmoe-science._"
    )


def _bench_facts(bench: dict) -> list[str]:
    facts = []
    gpu = bench.get("gpu")
    if isinstance(gpu, dict):
        sm = md.sm(gpu.get("capability"))
        facts.append(f"**GPU** {md.text(gpu.get('name', '?'))}" + (f" ({sm})" if sm else ""))
    for key, label in (
        ("torch", "torch"),
        ("cuda", "CUDA"),
        ("driver", "driver"),
        ("backend", "backend"),
    ):
        if bench.get(key):
            facts.append(f"**{label}** {md.text(bench[key])}")
    commit = bench.get("commit")
    if isinstance(commit, dict) and commit.get("sha"):
        facts.append(
            f"**commit** {md.code(str(commit['sha'])[:12])}"
            + (" (dirty tree)" if commit.get("dirty") else "")
        )
    timing = bench.get("timing")
    if isinstance(timing, dict) and timing.get("method"):
        facts.append(f"**timer** {md.text(timing['method'])}")
    seen = load.describe(bench.get("load"))
    if seen:
        facts.append(md.text(seen))
    subset = SUBSET_LABELS.get(bench.get("subset"))
    if subset:
        facts.append(f"**cases** {md.text(subset)}; the whole matrix runs on pushes to main")
    return facts


def _ceilings(bench: dict) -> str:
    ceilings = bench.get("ceilings")
    if not isinstance(ceilings, dict) or not ceilings:
        return ""
    items = []
    copy, matmul = ceilings.get("copy"), ceilings.get("matmul")
    if isinstance(copy, dict) and md.num(copy.get("gbps")):
        items.append(f"copy {md.sig(copy['gbps'])} GB/s")
    if isinstance(matmul, dict) and md.num(matmul.get("tflops")):
        shape = f" ({md.text(matmul.get('dtype', ''))} {md.text(matmul.get('n', ''))}³)"
        items.append(f"matmul{shape} {md.sig(matmul['tflops'])} TFLOP/s")
    if ceilings.get("error"):
        items.append(f"not measured: {md.text(ceilings['error'], 160)}")
    if not items:
        return ""
    if bench.get("backend") == "cpu":
        return (
            "CPU backend: these figures are plumbing checks of the CPU path (the cases run, the "
            "timer and the comparison work), not a card's performance. Ceilings measured on this "
            "CPU: " + ", ".join(items) + "."
        )
    return "Ceilings measured on this card: " + ", ".join(items) + "."


def _pct(value: Any, mark: str = "") -> str:
    return f" ({md.sig(value, 2)}%{mark})" if md.num(value) is not None else ""


def _unstable(result: Any) -> bool:
    """Whether a measured result's spread shows a disturbance (stats.unstable); older read floors
    have no IQR and count as stable."""
    if not isinstance(result, dict):
        return False
    median, iqr = md.num(result.get("median_ms")), md.num(result.get("iqr_ms"))
    return median is not None and iqr is not None and stats.unstable(median, iqr)


def _mark(result: Any) -> str:
    return UNSTABLE_MARK if _unstable(result) else ""


def _timings(case: dict) -> list:
    baselines = case.get("baselines") if isinstance(case.get("baselines"), dict) else {}
    return [
        case.get("ours"),
        *baselines.values(),
        case.get("read_floor"),
        case.get("ours_deterministic"),
    ]


def _measured_cell(
    result: Any, label: str, speed: float | None, reasons: dict, cuda_only: bool = False
) -> str:
    """A baseline's or the read floor's cell: ms (its time over ours), or why it has none. A
    CUDA-only backend refusing a CPU bench says so, not the exception it raised."""
    if result is None:
        return md.DASH
    problem = _not_measured(result)
    if problem and cuda_only and problem[0] == "unsupported":
        return NOT_ON_CPU
    if problem and problem[1].startswith(NOT_INSTALLED):  # a peer: why, once, under the tables
        reasons.setdefault(label, set()).add(problem[1])
        return NOT_INSTALLED
    if problem:
        reasons.setdefault(f"{label}: {problem[0]}", set()).add(problem[1])
        return problem[0]  # one word per status, the same on every backend
    speed_text = f" ({speed:.2f}{md.TIMES})" if speed else ""
    return md.sig(result.get("median_ms")) + speed_text + _mark(result)


def _over_copy(ours: dict) -> bool:
    pct = md.num(ours.get("pct_copy_ceiling"))
    return pct is not None and pct > 100


def _flash_peak(case: dict) -> str:
    """For the backward kinds, SDPA flash's peak beside ours: the backward's memory beyond the
    saved tensors is held to FlashAttention-2's."""
    if case.get("kind") not in ("backward", "train"):
        return ""
    flash = _result(case.get("baselines"), "sdpa-flash")
    peak = flash.get("peak_mem_bytes") if isinstance(flash, dict) else None
    return f" (flash {md.nbytes(peak)})" if isinstance(peak, int) else ""


def _bench_row(
    case: dict,
    regressed: bool,
    reasons: dict[str, set[str]],
    read_floor: bool = False,
    cpu: bool = False,
    peers: list[str] = (),
    deterministic: bool = False,
) -> list[str]:
    """A case's row: ours, then BASELINES, the `peers` columns, our deterministic backward
    (`deterministic`) and the read floor, as the group's table has them."""
    ours = case.get("ours") or {}
    label = ("⚠️ " if regressed else "") + md.code(case.get("id", "?"), 150)
    problem = _not_measured(ours)
    if problem:
        reasons.setdefault(f"ours: {problem[0]}", set()).add(problem[1])
        dashes = len(BASELINES) + len(peers) + deterministic + read_floor
        mark = "❌ " if problem[0] == "error" else ""  # a refusal is said, not failed
        return [f"{mark}{label}", f"**{md.text(problem[0])}**", md.DASH, md.DASH, md.DASH] + [
            md.DASH
        ] * dashes
    decode = case.get("kind") == "decode"
    iqr = md.num(ours.get("iqr_ms"))
    mark = OVER_COPY if _over_copy(ours) else ""
    row = [
        label,
        md.sig(ours.get("median_ms"))
        + (f" ± {md.sig(iqr, 2)}" if iqr is not None else "")
        + _mark(ours),
        md.sig(ours.get("tflops")) + ("" if decode else _pct(ours.get("pct_matmul_ceiling"))),
        md.sig(ours.get("gbps")) + (_pct(ours.get("pct_copy_ceiling"), mark) if decode else ""),
        md.nbytes(ours.get("peak_mem_bytes")) + _flash_peak(case),
    ]
    for name in [*BASELINES, *peers]:
        base = _result(case.get("baselines"), name)
        speed, cuda_only = _speedup(case, name), cpu and name in CUDA_ONLY_BASELINES
        row.append(_measured_cell(base, BASELINE_LABELS[name], speed, reasons, cuda_only))
    if deterministic:
        same = _result(case, "ours_deterministic")
        row.append(_measured_cell(same, DETERMINISTIC_LABEL, _over_ours(case, same), reasons))
    if read_floor:
        floor = _result(case, "read_floor")
        row.append(_measured_cell(floor, "read floor", _over_ours(case, floor), reasons))
    return row


def not_compared_reason(bench: dict) -> str | None:
    """Why this bench has no head-vs-base comparison; None when it has one."""
    comparison = bench.get("comparison")
    if not isinstance(comparison, dict):
        return "no base given"
    if _comparison_source(comparison) == "none":
        return str(comparison.get("reason") or "no base measurement")
    rows = [c for c in comparison.get("cases") or [] if isinstance(c, dict)]
    if not any(c.get("verdict") in ("regression", "improvement", "no change") for c in rows):
        return f"no case has a base timing, {md.plural(len(rows), 'case')} missing"
    return None


def bench_section(inputs: Inputs, detail: Detail) -> Section:
    title = "Benchmark"
    if "bench.json" in inputs.unreadable:
        return unreadable_section("bench", title, "bench.json", inputs.unreadable["bench.json"])
    if "bench.json" in inputs.stale:
        return stale_section("bench", title, "bench.json", inputs.stale["bench.json"])
    bench = inputs.bench
    if bench is None:
        return absent(
            inputs,
            "bench",
            title,
            "bench.json",
            "bench stage failed",
            "The bench stage failed and left no `bench.json`; see the job log. "
            "Reproduce: `nox -s bench`.",
        )
    cases = [c for c in bench.get("cases") or [] if isinstance(c, dict)]
    comparison = bench.get("comparison") if isinstance(bench.get("comparison"), dict) else None
    compared = [c for c in (comparison or {}).get("cases") or [] if isinstance(c, dict)]
    regressions = [c for c in compared if c.get("verdict") == "regression"]
    improvements = [c for c in compared if c.get("verdict") == "improvement"]
    regressed_ids = {c.get("id") for c in regressions}
    # our kernel failed; a refusal ("unsupported": a feature not on this device yet) is not broken
    broken = [c for c in cases if (_not_measured(c.get("ours")) or ("",))[0] == "error"]
    not_compared = not_compared_reason(bench)

    facts = _bench_facts(bench)
    parts = [" · ".join(facts)] if facts else []
    ceilings = _ceilings(bench)
    if ceilings:
        parts.append(ceilings)
    speedups = [s for s in (_speedup(c, "sdpa-default") for c in cases) if s]
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups)) if speedups else None
    cpu = bench.get("backend") == "cpu"
    busy = load.busy(bench.get("load")) if cpu else None
    if busy:  # the news: above the tables
        parts.append(not_judged_line(busy))

    # Rows kept when truncating: our failures, regressions, then where we trail SDPA the most.
    def priority(i: int) -> tuple:
        case = cases[i]
        return (
            case not in broken,
            case.get("id") not in regressed_ids,
            _speedup(case, "sdpa-default") or math.inf,
        )

    order = sorted(range(len(cases)), key=priority)
    keep = set(order if detail.bench_rows is None else order[: detail.bench_rows])
    reasons: dict[str, set[str]] = {}
    tables = []
    groups = [g for g in GROUPS if any(_group(c) == g for c in cases)]
    groups += sorted({_group(c) for c in cases} - set(groups))
    header = ["case", "ours ms", "TFLOP/s", "GB/s", "peak mem"]
    header += [f"{BASELINE_LABELS[n]} ms ({md.TIMES})" for n in BASELINES]
    for group in groups:
        in_group = [(i, c) for i, c in enumerate(cases) if _group(c) == group]
        floor = any("read_floor" in c for _, c in in_group)
        peers = [
            p for p in EXTRA_COLUMNS if any(_result(c.get("baselines"), p) for _, c in in_group)
        ]
        deterministic = any("ours_deterministic" in c for _, c in in_group)
        rows = [
            _bench_row(
                case, case.get("id") in regressed_ids, reasons, floor, cpu, peers, deterministic
            )
            for index, case in in_group
            if index in keep
        ]
        if rows:
            columns = header + [f"{BASELINE_LABELS[p]} ms ({md.TIMES})" for p in peers]
            columns += [f"{DETERMINISTIC_LABEL} ms ({md.TIMES})"] if deterministic else []
            columns += [f"read floor ms ({md.TIMES})"] if floor else []
            tables.append(f"**{md.text(group)}**\n\n" + md.table(columns, rows))
    if cases:
        parts.append(
            f"Times are medians ± IQR; ({md.TIMES}) is SDPA's time over ours, so above "
            f"1.00{md.TIMES} we are faster; (%) is the share of the measured ceiling."
            + (
                f" The read floor is a bare read of the case's K and V, timed alike; its ({md.TIMES}) "
                f"is its time over ours, so 1.00{md.TIMES} would be a decode as fast as reading the cache."
                if any("read_floor" in c for c in cases)
                else ""
            )
            + (
                f" FlashAttention-3 and -4 are timed alike where installed; {DETERMINISTIC_LABEL} is "
                f"ours with deterministic=True, its ({md.TIMES}) its time over ours."
                if any(_result(c, "ours_deterministic") for c in cases)
                or any(_result(c.get("baselines"), p) for c in cases for p in PEER_NAMES)
                else ""
            )
            + (
                f" {FLEX_LABEL} (torch.compile) is the baseline of the window, softcap and sinks "
                "cases, which SDPA cannot express."
                if any(_result(c.get("baselines"), FLEX_NAME) for c in cases)
                else ""
            )
            + (
                f" Geometric mean against SDPA default: **{geo:.2f}{md.TIMES}**"
                + (" (not judged)." if busy else ".")
                if geo
                else ""
            )
        )
    parts += tables
    if any(_over_copy(c.get("ours") or {}) for c in cases if c.get("kind") == "decode"):
        parts.append(
            f"{OVER_COPY} Above 100% of the copy ceiling: that ceiling streams through DRAM, while a "
            "kernel whose K and V partly sit in L2 (small enough to stay there between calls) reads "
            "part of them faster than DRAM can deliver."
        )
    unstable = [c for c in cases if any(_unstable(r) for r in _timings(c))]
    retaken = [c for c in cases if isinstance(c.get("retakes"), int) and c["retakes"] > 0]
    note = unstable_note(len(unstable), len(cases), len(retaken))
    if note:
        parts.append(note)
    if reasons:
        parts.append(
            "\n".join(
                f"- {md.text(what)}: " + " / ".join(md.text(r, 400) for r in sorted(texts))
                for what, texts in sorted(reasons.items())
            )
        )
    if len(keep) < len(cases):
        parts.append(
            f"_{len(cases) - len(keep)} of {len(cases)} benchmark rows not shown (all are in `bench.json`)._"
        )
        detail.omitted.append(f"{len(cases) - len(keep)} of {len(cases)} benchmark rows")
    chart = prefill_chart(cases)
    if chart:
        parts.append(chart)
    head_vs_base = _comparison(comparison, compared, detail, not_compared)
    if regressions or not_compared:  # the news: put it above the tables
        parts.insert(1 if facts else 0, head_vs_base)
    else:
        parts.append(head_vs_base)

    problems = []
    severity = OK
    if broken:
        severity = FAIL
        problems.append((FAIL, f"our kernel failed on {md.plural(len(broken), 'bench case')}"))
    if regressions and busy:  # timings of shared cores: shown, not judged
        severity = max(severity, NOTE)
    elif regressions:
        severity = max(severity, WARN)
        problems.append((WARN, md.plural(len(regressions), "regression")))
    if busy:
        severity = max(severity, NOTE)
        problems.append((NOTE, f"bench not judged ({busy})"))
    if not_compared:
        severity = max(severity, NOTE)
        problems.append((NOTE, f"bench not compared ({md.text(not_compared, 120)})"))
    variant = [d for d in bench.get("defines") or [] if isinstance(d, str)]
    if variant:  # a planted bug or an experiment's switch: not the library users get
        severity = max(severity, WARN)
        problems.append(
            (
                WARN,
                "timed a variant build, not the default one: "
                + md.text(_loader.define_flags(variant), 200),
            )
        )
    summary = md.plural(len(cases), "case")
    if broken:
        summary += f", {len(broken)} failed"
    if unstable:
        summary += f", {len(unstable)} unstable"
    if busy:
        summary += f", not judged ({busy})"
    elif geo:
        summary += f", {geo:.2f}{md.TIMES} SDPA default (geo-mean)"
    if not_compared:
        summary += f", not compared ({md.text(not_compared, 120)})"
    else:
        summary += (
            f", {md.plural(len(regressions), 'regression')}, "
            f"{md.plural(len(improvements), 'improvement')} vs {md.text(_base_ref(comparison))}"
        )
    return Section("bench", title, severity, summary, "\n\n".join(p for p in parts if p), problems)


def _comparison_source(comparison: dict | None) -> str:
    return str((comparison or {}).get("source") or "none")


def _base_ref(comparison: dict | None) -> str:
    base = (comparison or {}).get("base")
    ref = base.get("ref") if isinstance(base, dict) else None
    defines = base.get("defines") if isinstance(base, dict) else None
    built = (
        f" ({_loader.define_flags(map(str, defines)) or 'no extra defines'})"
        if isinstance(defines, list)
        else ""
    )
    return str(ref or "base") + built


def _comparison(
    comparison: dict | None, compared: list[dict], detail: Detail, not_compared: str | None
) -> str:
    if not_compared:
        hint = (
            " (`nox -s bench -- --base REF` times a base beside the head)"
            if comparison is None
            else ""
        )
        return (
            f"**Head vs base: not compared**: {md.text(not_compared, 300)}{hint}. This run cannot "
            "show a regression."
        )
    why = comparison.get("reason")
    source = _comparison_source(comparison)
    how = {
        "worktree": "base built and timed side by side in this job",
        "stored": "base samples from a stored run, so machine drift is not controlled",
    }.get(source, md.text(source))
    base = comparison.get("base") if isinstance(comparison.get("base"), dict) else {}
    sha = f" at {md.code(str(base['sha'])[:12])}" if base.get("sha") else ""
    stored = ""
    if base.get("stored_commit"):
        stored = (
            f" Stored run: {md.code(str(base['stored_commit'])[:12])}"
            + (f" ({md.text(base['stored_at'])})" if base.get("stored_at") else "")
            + "."
        )
    rule = ""
    if md.num(comparison.get("threshold")) is not None:
        rule = f" A change counts when it exceeds {md.sig(comparison['threshold'] * 100, 2)}%"
        rule += (
            f" and Mann-Whitney p < {md.sig(comparison.get('alpha'), 2)}."
            if md.num(comparison.get("alpha"))
            else "."
        )
    head = f"**Head vs base** {md.code(_base_ref(comparison))}{sha}: {how}.{rule}{stored}"
    if why:
        head += f" Why not side by side: {md.text(why, 300)}"
    if not compared:
        return head + "\n\nNo cases compared."
    rank = {"regression": 0, "improvement": 1, "missing": 2}
    ordered = sorted(
        compared,
        key=lambda c: (rank.get(str(c.get("verdict")), 3), -abs(md.num(c.get("change_pct")) or 0)),
    )
    shown = ordered
    if detail.bench_rows is not None:
        regressed = [c for c in ordered if c.get("verdict") == "regression"]
        shown = (
            regressed
            + [c for c in ordered if c.get("verdict") != "regression"][
                : max(0, detail.bench_rows - len(regressed))
            ]
        )
    icons = {"regression": "⚠️", "improvement": "🚀", "missing": "❔"}
    rows = []
    for c in shown:
        change = md.num(c.get("change_pct"))
        verdict_text = md.text(c.get("verdict", "?"))
        if c.get("verdict") == "missing" and c.get("reason"):
            verdict_text += f": {md.text(c['reason'], 120)}"
        rows.append(
            [
                icons.get(str(c.get("verdict")), ""),
                md.code(c.get("id", "?"), 150),
                md.sig(c.get("head_median_ms")),
                md.sig(c.get("base_median_ms")),
                f"{change:+.1f}%" if change is not None else "—",
                md.sig(c.get("p_value"), 2),
                verdict_text,
            ]
        )
    text = (
        head + "\n\n" + md.table(["", "case", "head ms", "base ms", "change", "p", "verdict"], rows)
    )
    if len(shown) < len(compared):
        text += f"\n\n_{len(compared) - len(shown)} unchanged comparisons not shown._"
        detail.omitted.append(f"{len(compared) - len(shown)} of {len(compared)} comparison rows")
    return text
