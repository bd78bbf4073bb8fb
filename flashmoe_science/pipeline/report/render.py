"""The report as a whole: the verdict, the stage table with wall times and the job's total, the
job's critical path under it (where the time went, in order; on an H200, whether the job kept to
GPU CI's budget), the sections in order of severity, and the cuts that keep it under GitHub's
comment limit.

Whatever the inputs hold, the first line is the verdict and the second the MARKER: the verdict
names at most VERDICT_ITEMS problems of each kind, then a count; a section whose renderer fails
on its record becomes a failed section of its own, and the others still render."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable

from .. import gpukinds, provenance, stages
from .. import markdown as md
from .bench_section import SDPA_RATIO_LINE, bench_section
from .build_section import build_section
from .env_section import env_facts, env_section
from .gates_section import MAX_FAILING, case_failed, gates_section
from .inputs import Inputs, stage_failed
from .sanitize_section import sanitize_section
from .sanitize_section import shown as sanitize_shown
from .sections import FAIL, ICONS, NOTE, NOTRUN, OK, STALE, WARN, Detail, Section
from .selection_section import selection_section
from .targets_section import targets_section
from .trusted import history_section, trusted_header

MARKER = "<!-- flashmoe-science-report -->"
MAX_CHARS = 65_536  # GitHub rejects a comment body above this ("Body is too long")
# The sticky-comment action adds its own hidden header line to the body; keep room for it. The
# budget is counted in UTF-8 bytes, which is never less than GitHub's count of characters.
HEADROOM = 512
BUDGET = MAX_CHARS - HEADROOM
SECTION_STAGES = ("env", "build", "test", "bench")
UNFINISHED = "unfinished"
VERDICT_ITEMS = 5  # problems of one kind the verdict names before it counts the rest
VERDICT_ITEM_CHARS = 160
MIN_GAP_SHOWN = 10.0  # seconds between two stages that the critical path names


def _listed(items: list[str]) -> list[str]:
    """The first VERDICT_ITEMS items, each cut short, then '... and N more'."""
    shown = [md.flat(item, VERDICT_ITEM_CHARS) for item in items[:VERDICT_ITEMS]]
    if len(items) > VERDICT_ITEMS:
        shown.append(f"and {len(items) - VERDICT_ITEMS:,} more")
    return shown


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The report's verdict as data: its first line is written from this, and the comment over
    several GPU kinds (report.legs) reads this rather than parsing that line back."""

    severity: int  # the one its icon shows; a verdict on stale records is a warning, never a pass
    sentence: str  # one line, escaped, without the icon and the project's name

    @property
    def line(self) -> str:
        return f"## {ICONS[self.severity]} flashmoe-science: {self.sentence}"


def verdict(inputs: Inputs) -> Verdict:
    """The verdict of the report that render(inputs) writes: the sections' problems do not
    depend on how much of them is shown, so any level of detail gives the same one."""
    return _verdict(_sections(inputs, Detail()), inputs)


def _verdict(sections: list[Section], inputs: Inputs) -> Verdict:
    problems = [p for s in sections for p in s.problems]
    if inputs.tested_sha and inputs.head_sha and inputs.head_sha != inputs.tested_sha:
        problems.append(
            (STALE, f"stale: the PR is now at {md.text(inputs.head_sha[:12])}, untested")
        )
    for name in _extra_stages(inputs):
        if name in inputs.stale_stages:
            problems.append((STALE, f"stale {md.text(name, 64)} stage"))
        elif stage_failed(inputs, name):
            problems.append((FAIL, f"{md.text(name, 64)} failed"))
    main_files = {"env.json", "build.json", "gates.json", "bench.json"}
    problems += [
        (WARN, f"{md.text(name, 120)} unreadable")
        for name in inputs.unreadable
        if name not in main_files
    ]
    by = {
        sev: _listed([text for s, text in problems if s == sev])
        for sev in (FAIL, STALE, WARN, NOTE)
    }
    cpu = cpu_only_text(inputs)
    notes = ("; " + "; ".join(by[NOTE])) if by[NOTE] else ""  # caveats every verdict repeats
    on_cpu = f"; on the CPU: {cpu}" if cpu else ""
    if by[FAIL]:
        return Verdict(FAIL, ", ".join(by[FAIL] + by[STALE] + by[WARN]) + on_cpu + notes)
    if by[STALE]:
        # A record of other code or another run says nothing about this one: never a pass.
        return Verdict(
            WARN, "not a verdict on this commit: " + ", ".join(by[STALE] + by[WARN]) + notes
        )
    if by[WARN]:
        return Verdict(WARN, ", ".join(by[WARN]) + on_cpu + notes)
    not_run = [s.key for s in sections if s.severity == NOTRUN]
    if len(not_run) == len(sections):
        return Verdict(WARN, "nothing ran")
    not_run_text = f" (not run: {', '.join(not_run)})" if not_run else ""
    if cpu:  # a pass of the CPU twins says nothing about the CUDA kernels: information, not ✅
        return Verdict(NOTE, f"passed on the CPU: {cpu}{not_run_text}{notes}")
    return Verdict(OK, "passed" + not_run_text + notes)


def _usable(inputs: Inputs, label: str, record: dict | None) -> dict:
    """A record the report may read: present, readable and not stale (else an empty one)."""
    if not isinstance(record, dict) or label in inputs.stale or label in inputs.unreadable:
        return {}
    return record


def cpu_only_text(inputs: Inputs) -> str | None:
    """'CUDA kernels not run (1,532 gates skipped, need a GPU)' when no CUDA kernel ran in this run but
    something ran on the CPU (the CPU-only build, a CPU bench, or CPU gate cases alone); else None."""
    build = _usable(inputs, "build.json", inputs.build)
    bench = _usable(inputs, "bench.json", inputs.bench)
    gates = _usable(inputs, "gates.json", inputs.gates)
    rows = [c for c in gates.get("cases") or [] if isinstance(c, dict)]
    ran = [c for c in rows if c.get("outcome") != "skipped"]
    if any(c.get("device") == "cuda" for c in ran) or bench.get("backend") == "cuda":
        return None
    cpu_gates = bool(ran) and all(c.get("device") == "cpu" for c in ran)
    if not (cpu_gates or build.get("backend") == "cpu" or bench.get("backend") == "cpu"):
        return None
    counts = gates.get("gates") if isinstance(gates.get("gates"), dict) else {}
    skipped = md.integer(counts.get("skipped")) or 0
    return "CUDA kernels not run" + (
        f" ({md.plural(skipped, 'gate')} skipped, need a GPU)" if skipped else ""
    )


def _extra_stages(inputs: Inputs) -> list[str]:
    """Stages in stages.json without a section of their own (profile; sanitize without a
    sanitize.json)."""
    own = (*SECTION_STAGES, "sanitize") if sanitize_shown(inputs) else SECTION_STAGES
    own += ("select",) if inputs.selection is not None or "selection.json" in inputs.stale else ()
    return [name for name in inputs.stages if name not in own]


def _wall_time(inputs: Inputs, name: str) -> tuple[str, float | None]:
    """(the cell, the seconds that count towards the sum of stages) of one stage."""
    stage = inputs.stages.get(name)
    if stage is None:
        return md.DASH, None
    if name in inputs.stale_stages:
        return f"{md.duration(stage['seconds'])} (stale)", None
    if stage["status"] == "running":
        return UNFINISHED, None
    return md.duration(stage["seconds"]), stage["seconds"]


def _extra_row(inputs: Inputs, name: str) -> list[str]:
    stage = inputs.stages[name]
    status = stage["status"] or "unknown"
    if name in inputs.stale_stages:
        icon, result = ICONS[STALE], f"STALE: {md.text(inputs.stale_stages[name])}"
    elif stage_failed(inputs, name):
        icon = ICONS[FAIL]
        result = "did not finish" if status == "running" else status
        if stage["exit_code"] is not None:
            result += f" (exit {stage['exit_code']})"
    elif status == "skip":
        icon, result = ICONS[NOTRUN], "skipped (a tool is missing)"
    else:
        icon, result = ICONS[OK], status
    return [icon, md.text(name), result, _wall_time(inputs, name)[0]]


def summary_table(sections: list[Section], inputs: Inputs) -> str:
    rows = []
    counted: list[float] = []
    for section in sections:
        cell, seconds = _wall_time(inputs, section.key)
        counted += [seconds] if seconds is not None else []
        rows.append([ICONS[section.severity], section.key, section.summary, cell])
    for name in _extra_stages(inputs):
        rows.append(_extra_row(inputs, name))
        seconds = _wall_time(inputs, name)[1]
        counted += [seconds] if seconds is not None else []
    if inputs.job_seconds is not None:
        rows.append(
            [
                "",
                "**total**",
                "the job, from its first step",
                f"**{md.duration(inputs.job_seconds)}**",
            ]
        )
    elif counted:
        rows.append(
            [
                "",
                "**total**",
                f"sum of this run's stages ({stages.JOB_START_VAR} unset)",
                f"**{md.duration(sum(counted))}**",
            ]
        )
    return md.table(["", "stage", "result", "wall time"], rows)


def critical_path_line(inputs: Inputs) -> str | None:
    """'**Critical path** (3m 40s): setup 1m 10s → env 3.1 s → **test 2m 05s** (57%) → ...':
    where the job's time went, in order (stages.critical_path), its longest step in bold; None
    when fewer than two steps are known."""
    timed = {name: s for name, s in inputs.stages.items() if name not in inputs.stale_stages}
    end = None
    if inputs.job_start is not None and inputs.job_seconds is not None:
        end = inputs.job_start + inputs.job_seconds
    path = stages.critical_path(timed, inputs.job_start, end)
    total = sum(seconds for _, seconds in path)
    # a few seconds between two stages (a process starting) are in the total, not listed
    path = [(n, s) for n, s in path if n != stages.BETWEEN or s >= MIN_GAP_SHOWN]
    if len(path) < 2:
        return None
    longest = max(range(len(path)), key=lambda i: path[i][1])
    steps = []
    for i, (name, seconds) in enumerate(path):
        step = f"{md.text(name, 64)} {md.duration(seconds)}"
        if i == longest and total > 0:
            step = f"**{step}** ({100 * seconds / total:.0f}%)"
        steps.append(step)
    line = f"**Critical path** ({md.duration(total)}): " + " → ".join(steps)
    budget = budget_text(inputs)
    return f"{line} · {budget}" if budget else line


def budget_text(inputs: Inputs) -> str | None:
    """On the card GPU CI's budget was set for (stages.BUDGET_KIND): whether the job and its test
    stage kept to it; None on any other card."""
    kind = gpukinds.KINDS[stages.BUDGET_KIND]
    gpu = (inputs.env or {}).get("gpu") if "env.json" not in inputs.stale else None
    if not isinstance(gpu, dict) or not kind.matches(gpu.get("name")):
        return None
    test = inputs.stages.get("test") if "test" not in inputs.stale_stages else None
    spent = {"job": inputs.job_seconds, "test": (test or {}).get("seconds")}
    over = [
        f"{what} {md.duration(spent[what])} > {md.duration(limit)}"
        for what, limit in stages.BUDGET_S.items()
        if spent.get(what) is not None and spent[what] > limit
    ]
    if over:
        return f"⚠️ over the {kind.card} budget: " + ", ".join(over)
    said = ", ".join(f"{what} {md.duration(limit)}" for what, limit in stages.BUDGET_S.items())
    return f"within the {kind.card} budget ({said})"


def _subject(inputs: Inputs) -> str:
    """The line that names what the report describes."""
    text = f"**commit** {md.code(provenance.describe_commit(inputs.commit))}"
    if inputs.run_id:
        text += f" · **run** {md.code(inputs.run_id, 80)}"
    return text


# A builder returns None for a section with nothing to show (the speed targets of a bench that
# judged none): it is left out, not listed as not run.
SECTIONS: tuple[tuple[str, str, Callable[[Inputs, Detail], Section | None]], ...] = (
    ("env", "Environment", env_section),
    ("select", "Selection", selection_section),
    ("build", "Build", build_section),
    ("test", "Correctness gates", gates_section),
    ("bench", "Benchmark", bench_section),
    ("speed", "Speed targets", targets_section),
    ("sanitize", "Sanitizer", sanitize_section),
)


def _section(
    key: str, title: str, build: Callable[[Inputs, Detail], Section | None], inputs, detail
) -> Section | None:
    """One section; a renderer that fails on its record fails its own section, not the report."""
    try:
        return build(inputs, detail)
    except Exception as exc:
        why = md.text(f"{type(exc).__name__}: {md.flat(exc, 160)}")
        return Section(
            key,
            title,
            FAIL,
            "could not be rendered",
            f"The {key} record has a shape the report cannot show ({why}). The record is in the "
            "run's `reports/` artifact; rerun the stage that writes it.",
            [(FAIL, f"{key} record could not be rendered")],
        )


def _sections(inputs: Inputs, detail: Detail) -> list[Section]:
    built = [_section(key, title, build, inputs, detail) for key, title, build in SECTIONS]
    return [s for s in built if s is not None]


def _render(inputs: Inputs, detail: Detail, note: str | None = None) -> str:
    sections = _sections(inputs, detail)
    bench = next(s for s in sections if s.key == "bench")
    lines = [_verdict(sections, inputs).line, MARKER, ""]
    header = trusted_header(inputs) if detail.header else ""
    if header:
        lines += [header, ""]
    facts = [_subject(inputs)] + ([] if "env.json" in inputs.stale else env_facts(inputs.env))
    lines += [" · ".join(facts), ""]
    if bench.severity in (OK, NOTE, WARN) and inputs.bench and inputs.bench.get("cases"):
        lines += [SDPA_RATIO_LINE, ""]
    if note:
        lines += [note, ""]
    if inputs.unreadable:
        lines += [
            "> **Unreadable inputs:** "
            + "; ".join(
                f"`{md.text(name)}`: {md.text(why, 160)}" for name, why in inputs.unreadable.items()
            ),
            "",
        ]
    for caveat in inputs.notes:
        lines += [f"> **Note:** {md.text(caveat)}", ""]
    lines += [summary_table(sections, inputs), ""]
    path = critical_path_line(inputs)
    if path:
        lines += [path, ""]
    ran = [s for s in sections if s.severity != NOTRUN]
    if inputs.history is not None:  # after the table: not a stage of this run
        ran.append(_section("trend", "Performance history", history_section, inputs, detail))
    for section in sorted(ran, key=lambda s: -s.severity):  # stable: failures first, then warnings
        is_open = " open" if section.severity >= WARN else ""
        lines += [
            f"<details{is_open}><summary>{ICONS[section.severity]} <b>{section.title}</b>: {section.summary}</summary>",
            "",
            section.body,
            "",
            "</details>",
            "",
        ]
    not_run = [s for s in sections if s.severity == NOTRUN]
    if not_run:
        lines += [
            "**Not run:** " + ", ".join(f"{s.title.lower()} ({s.body})" for s in not_run) + ".",
            "",
        ]
    footer = "Reproduce locally: `nox -s env build test bench report`."
    if inputs.run_url:
        footer += (
            f" All inputs of this report are in the {md.code(inputs.artifact, 80)} artifact of "
            f"[this run]({inputs.run_url})."
        )
    lines.append(f"<sub>{footer}</sub>")
    return "\n".join(lines).rstrip("\n") + "\n"


def _truncation_note(detail: Detail) -> str:
    omitted = list(dict.fromkeys(detail.omitted))  # unique, in order
    return (
        f"> ✂️ **Truncated** to fit GitHub's {MAX_CHARS:,}-character comment limit; not shown: "
        + ", ".join(omitted)
        + ". The full data is in the run's `reports/` artifact."
    )


def _render_with(inputs: Inputs, detail: Detail) -> str:
    """Render once to learn what this level of detail omits, then again with the note in place."""
    probe = dataclasses.replace(detail, omitted=[])
    _render(inputs, probe)
    final = dataclasses.replace(detail, omitted=[])
    note = _truncation_note(probe) if probe.omitted else None
    return _render(inputs, final, note)


def render(inputs: Inputs, budget: int = BUDGET, header: bool = True) -> tuple[str, bool]:
    """The report, cut down until it fits in `budget` UTF-8 bytes. Returns (text, truncated).
    `header`: the trusted header (off inside the comment over several GPU kinds, report.legs)."""
    text = _render(inputs, Detail(header=header))
    if md.size(text) <= budget:
        return text, False
    detail = Detail(passing=False, header=header)
    text = _render_with(inputs, detail)
    if md.size(text) <= budget:
        return text, True
    bench_cases = (inputs.bench or {}).get("cases")
    n_bench = len(bench_cases) if isinstance(bench_cases, list) else 0
    detail.bench_rows = _largest(
        lambda n: (
            md.size(_render_with(inputs, dataclasses.replace(detail, bench_rows=n))) <= budget
        ),
        n_bench,
    )
    text = _render_with(inputs, detail)
    if md.size(text) <= budget:
        return text, True
    cases = (inputs.gates or {}).get("cases")
    n_fail = min(
        MAX_FAILING,
        len([c for c in cases if isinstance(c, dict) and case_failed(c)])
        if isinstance(cases, list)
        else 0,
    )
    detail.failing_cases = _largest(
        lambda k: (
            md.size(_render_with(inputs, dataclasses.replace(detail, failing_cases=k))) <= budget
        ),
        n_fail,
    )
    text = _render_with(inputs, detail)
    if md.size(text) <= budget:
        return text, True
    return hard_cut(text, budget), True


def _largest(fits, upper: int) -> int:
    """The largest n in [0, upper] with fits(n), assuming fits is monotone; 0 if none."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def hard_cut(text: str, budget: int) -> str:
    """Last resort: keep whole lines up to the budget, then close what is open and say so."""
    note = f"\n\n> ✂️ **Cut here** to fit GitHub's {MAX_CHARS:,}-character comment limit; the full data is in the run's `reports/` artifact.\n"
    kept: list[str] = []
    used = md.size(note) + 200  # room for the closing fence and tags
    fence: str | None = None
    open_details = 0
    for line in text.splitlines():
        cost = md.size(line) + 1
        if used + cost > budget:
            break
        kept.append(line)
        used += cost
        stripped = line.strip()
        if re.match(r"^`{3,}", stripped):
            ticks = re.match(r"^`+", stripped).group(0)
            if fence is None:
                fence = ticks
            elif stripped == fence:
                fence = None
        elif fence is None:
            open_details += stripped.count("<details") - stripped.count("</details>")
    tail = []
    if fence:
        tail.append(fence)
    tail += ["", "</details>"] * max(0, min(open_details, 20))
    return "\n".join(kept + tail) + note


def run_url() -> str | None:
    server, repo, run = (
        os.environ.get(k) for k in ("GITHUB_SERVER_URL", "GITHUB_REPOSITORY", "GITHUB_RUN_ID")
    )
    if server and repo and run:
        return f"{server}/{repo}/actions/runs/{run}"
    return None
