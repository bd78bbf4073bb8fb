"""Main's performance over its last commits: one point per push to main, a noise band per case,
and where a run stands against it.

A *point* is what a push to main keeps of one leg's bench.json: per case, our kernel's median time,
with the commit, the date and the GPU. The trusted `history` job (bench-history.yml) stores one file
per point on the `bench-history` branch (points/<kind>/<date>-<sha>.json beside the whole
bench.json: pipeline.ci.historybranch, one folder per GPU kind; nothing else writes there). From the
last KEEP points of the same kind and GPU:

    band(case)   the history's median ± max(NOISE_K robust standard deviations, MIN_BAND of it):
                 what main's own run-to-run noise reaches
    alerts       the cases of a run whose median leaves their band (slower or faster)
    markdown     a chart of the key cases over the commits (each relative to its history median,
                 so that cases of any size share an axis) and a table that sets a run beside
                 main's distribution and beside its interleaved base (bench.json's comparison)

The interleaved head-vs-base comparison stays the regression gate: the history is a second
opinion that sees slow drift across many merges, which no head-vs-base pair can.

    python -m flashmoe_science.pipeline.bench.trend point --bench B --sha SHA --out FILE
    python -m flashmoe_science.pipeline.bench.trend check --bench B --history DIR [--markdown FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from .. import markdown as md
from . import records as benchrecords

POINT_SCHEMA = "flashmoe-science/bench-point/1"
KEEP = 30  # main commits the trend and the band look back over
NOISE_K = 3.0  # robust standard deviations (1.4826 x MAD) either side of the median
MIN_BAND = 0.03  # never narrower than ±3%: timings of one machine drift that much between days
MIN_POINTS = 5  # fewer points give no band: no alert, the table says so
KEY_CASES = 4  # lines on the chart
MAX_POINT_BYTES = 1 << 20
MAX_CASES = 2_000
_SHA = re.compile(r"^[0-9a-f]{7,64}$")
_CASE_ID = re.compile(r"^[A-Za-z0-9_.:+=-]{1,200}$")


class InvalidPoint(ValueError):
    """A stored point that is not one this module writes."""


@dataclasses.dataclass(frozen=True)
class Point:
    sha: str
    date: str  # ISO 8601, UTC
    gpu: str
    medians: dict[str, float]  # case id -> our median ms

    def to_json(self) -> dict:
        return {"schema": POINT_SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, doc: object) -> Point:
        """A point from stored JSON, every field checked (the branch is ours, but a point is
        still data)."""
        if not isinstance(doc, dict) or doc.get("schema") != POINT_SCHEMA:
            raise InvalidPoint(f"not a {POINT_SCHEMA} document")
        sha, date, gpu, medians = (doc.get(k) for k in ("sha", "date", "gpu", "medians"))
        if not isinstance(sha, str) or not _SHA.match(sha):
            raise InvalidPoint("sha is not a commit id")
        if not isinstance(date, str) or _parse_date(date) is None:
            raise InvalidPoint("date is not an ISO 8601 time")
        if not isinstance(gpu, str) or len(gpu) > 200:
            raise InvalidPoint("gpu is not a short string")
        if not isinstance(medians, dict) or len(medians) > MAX_CASES:
            raise InvalidPoint(f"medians is not an object of at most {MAX_CASES} cases")
        clean = {}
        for case, value in medians.items():
            number = md.num(value)
            if not _CASE_ID.match(case) or number is None or number <= 0:
                raise InvalidPoint(f"medians has a bad entry {md.flat(case, 60)!r}")
            clean[case] = number
        return cls(sha, date, gpu, clean)


def _parse_date(text: str) -> datetime | None:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def point_of(record: benchrecords.BenchRecord, sha: str, date: str | None = None) -> Point:
    """The point a bench record makes: our measured cases' medians."""
    if not _SHA.match(sha):
        raise InvalidPoint(f"--sha {sha!r} is not a commit id (7 to 64 hex digits)")
    medians = {
        case.id: case.ours.median_ms
        for case in record.cases
        if getattr(case.ours, "status", None) == "ok" and md.num(case.ours.median_ms)
    }
    gpu = record.gpu.name if record.gpu else f"{record.backend} (no GPU)"
    when = date or record.timestamp or datetime.now(timezone.utc).isoformat(timespec="seconds")
    return Point(sha, when, gpu, medians)


def point_name(point: Point) -> str:
    """The point's file name on the history branch: names sort by date."""
    when = _parse_date(point.date) or datetime.now(timezone.utc)
    return f"{when.astimezone(timezone.utc):%Y%m%dT%H%M%S}-{point.sha[:12]}.json"


def load_points(directory: Path, gpu: str | None = None) -> tuple[list[Point], list[str]]:
    """(the last KEEP points in `directory`, oldest first, of `gpu` when given; what was skipped)."""
    points, skipped = [], []
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    for path in files:
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_POINT_BYTES:
                raise InvalidPoint("not a regular file under 1 MiB")
            point = Point.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, RecursionError) as exc:
            skipped.append(f"{path.name}: {md.flat(exc, 120)}")
            continue
        if gpu is None or point.gpu == gpu:
            points.append(point)
    points.sort(key=lambda p: _parse_date(p.date))
    return points[-KEEP:], skipped


@dataclasses.dataclass(frozen=True)
class Band:
    median: float
    low: float
    high: float
    n: int

    def where(self, value: float) -> str:
        return "slower" if value > self.high else "faster" if value < self.low else "inside"


def band(values: Sequence[float]) -> Band | None:
    """Median ± max(NOISE_K x 1.4826 x MAD, MIN_BAND x median); None below MIN_POINTS values."""
    if len(values) < MIN_POINTS:
        return None
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    half = max(NOISE_K * 1.4826 * mad, MIN_BAND * mid)
    return Band(mid, mid - half, mid + half, len(values))


def bands(points: Iterable[Point]) -> dict[str, Band]:
    series: dict[str, list[float]] = {}
    for point in points:
        for case, value in point.medians.items():
            series.setdefault(case, []).append(value)
    return {case: b for case, values in series.items() if (b := band(values)) is not None}


def alerts(points: Sequence[Point], current: Point) -> list[tuple[str, float, Band]]:
    """The cases of `current` outside their history's band (its own point left out), slowest
    first."""
    history = [p for p in points if p.sha != current.sha]
    found = [
        (case, value, b)
        for case, b in bands(history).items()
        if (value := current.medians.get(case)) is not None and b.where(value) != "inside"
    ]
    return sorted(found, key=lambda item: -item[1] / item[2].median)


def key_cases(points: Sequence[Point], current: Point | None, n: int = KEY_CASES) -> list[str]:
    """The cases to chart: those the current run measured (when given) with the longest history,
    then by id."""
    counts: dict[str, int] = {}
    for point in points:
        for case in point.medians:
            counts[case] = counts.get(case, 0) + 1
    wanted = [c for c in counts if counts[c] >= 2 and (current is None or c in current.medians)]
    return sorted(wanted, key=lambda c: (-counts[c], c))[:n]


def chart(points: Sequence[Point], cases: Sequence[str]) -> str:
    """A mermaid xychart: each case's median over the commits, relative to its history median
    (1.00 = typical, above is slower)."""
    cases = [c for c in cases if any(c in p.medians for p in points)]
    if len(points) < 2 or not cases:
        return ""
    typical = {c: statistics.median(p.medians[c] for p in points if c in p.medians) for c in cases}
    lines = []
    top = 1.1
    for case in cases:
        values = []
        for point in points:
            value = point.medians.get(case)
            # A commit without this case repeats the last value: mermaid needs one per x.
            values.append(value / typical[case] if value else (values[-1] if values else 1.0))
        top = max(top, *values)
        lines.append(f"    line [{', '.join(f'{v:.3f}' for v in values)}]")
    x = ", ".join(f'"{p.sha[:7]}"' for p in points)
    return md.fenced(
        "\n".join(
            [
                "xychart-beta",
                f'    title "main, last {len(points)} commits: time relative to its median"',
                f"    x-axis [{x}]",
                f'    y-axis "time / median" 0 --> {round(top * 1.1, 2)}',
                *lines,
            ]
        ),
        "mermaid",
    )


def markdown(
    points: Sequence[Point],
    current: Point | None,
    comparison: dict | None = None,
    skipped: Sequence[str] = (),
    rows: int = 20,
) -> tuple[str, list[str]]:
    """(the history section's body, the cases of `current` outside their band)."""
    if not points:
        return "No stored main runs of this GPU yet (the `bench-history` branch has none).", []
    first, last = points[0], points[-1]
    parts = [
        f"Main's last {md.plural(len(points), 'stored run')} on {md.text(last.gpu, 80)}, "
        f"{md.code(first.sha[:12])} ({md.text(first.date[:10])}) to {md.code(last.sha[:12])} "
        f"({md.text(last.date[:10])}). The band is the history's median ± "
        f"max({NOISE_K:g} robust SD, {MIN_BAND:.0%}); the head-vs-base comparison stays the gate."
    ]
    keys = key_cases(points, current)
    graph = chart(points, keys)
    if graph:
        parts.append(graph)
        parts.append(
            "Lines, in order: " + ", ".join(md.code(c, 120) for c in keys) + " (1.00 = median)."
        )
    history = [p for p in points if current is None or p.sha != current.sha]
    by_case = bands(history)
    outside = [case for case, _, _ in alerts(points, current)] if current else []
    base = {}
    for row in (comparison or {}).get("cases") or []:
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            base[row["id"]] = row
    table = []
    cases = outside + [c for c in keys if c not in outside]
    cases += [c for c in sorted(current.medians) if c not in cases] if current else []
    for case in cases[:rows]:
        b = by_case.get(case)
        value = current.medians.get(case) if current else None
        versus = md.DASH
        if b and value:
            versus = f"{(value / b.median - 1) * 100:+.1f}%" + (
                f" ⚠️ {b.where(value)}" if b.where(value) != "inside" else ""
            )
        cmp = base.get(case) or {}
        change = md.num(cmp.get("change_pct"))
        table.append(
            [
                md.code(case, 120),
                md.sig(b.median) + f" (n={b.n})" if b else "too few runs",
                f"{md.sig(b.low)} to {md.sig(b.high)}" if b else md.DASH,
                md.sig(value),
                versus,
                (f"{change:+.1f}% " if change is not None else "")
                + md.text(cmp.get("verdict") or md.DASH, 40),
            ]
        )
    if table:
        parts.append(
            md.table(
                ["case", "main median ms", "noise band ms", "this run ms", "vs main", "vs base"],
                table,
            )
        )
    if len(cases) > rows:
        parts.append(f"_{len(cases) - rows} more cases not shown (all are in `bench.json`)._")
    if skipped:
        parts.append(f"_{md.plural(len(skipped), 'stored point')} skipped as unreadable._")
    return "\n\n".join(parts), outside


# --------------------------------------------------------------------------------------------------
# Command line (the thin workflow steps call these)
# --------------------------------------------------------------------------------------------------


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashmoe_science.pipeline.bench.trend", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    point = sub.add_parser("point", help="write the history point of a bench.json")
    point.add_argument("--bench", type=Path, required=True)
    point.add_argument("--sha", required=True, help="the commit the bench ran on")
    point.add_argument("--out", type=Path, required=True, help="the point file to write")
    check = sub.add_parser("check", help="alert when a case leaves its history's noise band")
    check.add_argument("--bench", type=Path, required=True)
    check.add_argument("--sha", default=None, help="the commit (default: bench.json's)")
    check.add_argument("--history", type=Path, required=True, help="a folder of point files")
    check.add_argument("--markdown", type=Path, default=None, help="write the section here")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        record = benchrecords.load(args.bench)
        sha = args.sha or (record.commit.sha if record.commit else "")
        current = point_of(record, sha)
    except (benchrecords.InvalidBenchFile, InvalidPoint) as exc:
        print(f"trend: {md.flat(exc, 400)}", file=sys.stderr)
        return 2
    if args.command == "point":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(current.to_json(), indent=1) + "\n", encoding="utf-8")
        print(f"trend: point of {sha[:12]} ({len(current.medians)} cases) -> {args.out}")
        return 0
    points, skipped = load_points(args.history, current.gpu)
    body, outside = markdown(points, current, None, skipped)
    if args.markdown:
        args.markdown.write_text(
            f"## {'⚠️' if outside else '✅'} main's benchmark history\n\n{body}\n", encoding="utf-8"
        )
    if outside:
        print(
            f"trend: {md.plural(len(outside), 'case')} of {sha[:12]} left main's noise band: "
            + ", ".join(md.flat(c, 80) for c in outside[:10])
        )
        return 1
    print(
        f"trend: {sha[:12]}: every case inside main's noise band ({md.plural(len(points), 'stored run')})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
