"""What the privileged report job adds, from what it verified itself rather than from the artifact:
the header (the commit the run tested, the run's link, a warning when the pull request changes the
workflows or the report's own code) and main's performance history beside this run."""

from __future__ import annotations

from .. import markdown as md
from ..bench import records as benchrecords
from ..bench import trend
from .inputs import Inputs
from .sections import NOTE, OK, WARN, Detail, Section

# A pull request that changes these decides what its own run did and wrote: say so on top.
SENSITIVE = (
    ".github/",
    "scripts/act/",
    "scripts/runner/",
    "flashmoe_science/pipeline/report/",
    "flashmoe_science/pipeline/markdown.py",
    "flashmoe_science/pipeline/ci/",
    "flashmoe_science/pipeline/bench/trend.py",
    "noxfile.py",
)


def trusted_header(inputs: Inputs) -> str:
    """The header lines, or '' when the report was not re-rendered by the trusted job."""
    if not inputs.tested_sha:
        return ""
    line = f"**tested** {md.code(inputs.tested_sha[:12])}"
    if inputs.run_url:
        line += f" · [the GPU CI run]({inputs.run_url})"
    line += " · rendered by the default branch's report code from the run's JSON"
    lines = [line]
    touched = [
        path
        for path in inputs.changed_paths or []
        if any(path == s or path.startswith(s) for s in SENSITIVE)
    ]
    if touched:
        shown = ", ".join(md.code(p, 100) for p in touched[:5])
        more = f" and {len(touched) - 5} more" if len(touched) > 5 else ""
        lines.append(
            f"> ⚠️ **This PR changes the CI or the report code** ({shown}{more}): the run executed "
            "the PR's version, so its figures are claims. Review those changes before trusting them."
        )
    return "\n\n".join(lines)


def history_section(inputs: Inputs, detail: Detail) -> Section:
    """Main's stored runs beside this one: the trend chart, the noise band, both comparisons."""
    title = "Performance history (main)"
    points = inputs.history or []
    bench = inputs.bench if "bench.json" not in inputs.stale else None
    current = None
    if bench:
        record = benchrecords.from_json(bench)
        current = trend.point_of(record, inputs.tested_sha or "0" * 40)
        points = [p for p in points if p.gpu == current.gpu]
    comparison = bench.get("comparison") if bench else None
    rows = 20 if detail.bench_rows is None else max(5, detail.bench_rows)
    if not points and inputs.gpu_kind:
        # Only this kind's runs count: no other card's history stands in for it.
        body = (
            f"No stored main runs of the {md.code(inputs.gpu_kind, 20)} leg yet on the "
            "`bench-history` branch: nothing to set this run beside (another GPU kind's runs "
            "are never used)."
        )
        return Section("trend", title, NOTE, f"no stored {inputs.gpu_kind} runs", body, [])
    body, outside = trend.markdown(points, current, comparison, rows=rows)
    if outside:
        summary = f"{md.plural(len(outside), 'case')} outside main's noise band"
        return Section("trend", title, WARN, summary, body, [])
    summary = f"{md.plural(len(points), 'stored run')} of main" if points else "no stored runs"
    return Section("trend", title, OK if points else NOTE, summary, body, [])
